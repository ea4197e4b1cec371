"""W4A4Linear: the model's Linear interface over the canonical W4A4 tensors, and W4A4Group, several W4A4
Linears that read one input (q/k/v, gate/up) merged into one.

The forward pass goes through a backend: `engine.kernels.choose_w4a4_backend` (the CUDA kernels where
they are built and supported, the reference otherwise; `backend_name` asks for one), or the reference
directly when the kernels package cannot be imported. A backend turns a layer, or a group, into its own
layout once per device (`prepare`, `prepare_group`, `prepare_swiglu`).
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from engine.model.linear import Linear, QuantizedLinear
from engine.w4a4.format import STORE_DTYPE, W4A4Tensors
from engine.w4a4.reference import ReferenceW4A4Backend

log = logging.getLogger(__name__)

_BACKENDS: dict[tuple[str, str], object] = {}


def backend_for(device: torch.device, prefer: str = "auto"):
    """The W4A4 backend for a device, chosen (and logged) once per process, device and preference."""
    key = (str(device), prefer)
    if key not in _BACKENDS:
        try:
            from engine.kernels import choose_w4a4_backend
        except ImportError as e:
            if prefer not in ("auto", ReferenceW4A4Backend.name):
                raise
            log.warning("W4A4 on %s: reference backend (engine.kernels cannot be imported: %s)", device, e)
            _BACKENDS[key] = ReferenceW4A4Backend()
        else:
            _BACKENDS[key] = choose_w4a4_backend(device, prefer)
    return _BACKENDS[key]


class _Prepared(nn.Module):
    """What W4A4Linear and W4A4Group share: the backend choice, the fused-kernel flags and the cache of
    packed forms, which belong to one device and are dropped when the module moves."""

    backend_name = "auto"  # EngineConfig.w4a4_backend, set at load

    def _reset_packed(self) -> None:
        self._packed: dict[str, tuple[object, object]] = {}  # kind -> (backend, packed form)

    def _backend(self, x: Tensor):
        return backend_for(x.device, self.backend_name)

    def _get_packed(self, kind: str, x: Tensor, make):
        backend = self._backend(x)
        cached = self._packed.get(kind)
        if cached is None or cached[0] is not backend:
            cached = self._packed[kind] = (backend, make(backend))
        return backend, cached[1]

    def _fuses(self, x: Tensor, backend_has_it: bool) -> bool:
        if not (self.fused and backend_has_it):
            return False
        from engine.kernels.fused import fused_ops  # importable: the backend came from engine.kernels

        return fused_ops(x) is not None

    def _normed(self, x: Tensor, norm, backend, packed, delta: Tensor | None) -> Tensor:
        if self._fuses(x, backend.has_fused_rmsnorm):
            if delta is not None:
                x.add_(delta)
            return backend.forward_rmsnorm(x, norm.weight, norm.eps, packed)
        return backend.forward(norm(x, delta), packed)


class W4A4Linear(_Prepared, QuantizedLinear):
    """y = W4A4(x) per engine/w4a4/reference.py; in/out features as the Linear it replaces."""

    def __init__(
        self, in_features: int, out_features: int, rank: int, smooth: bool = False, bias: bool = False
    ):
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.splits = (out_features,)
        self.register_buffer("qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("wscales", torch.zeros(out_features, in_features // 64, dtype=STORE_DTYPE))
        self.register_buffer("proj_down", torch.zeros(in_features, rank, dtype=STORE_DTYPE))
        self.register_buffer("proj_up", torch.zeros(out_features, rank, dtype=STORE_DTYPE))
        self.register_buffer("smooth", torch.ones(in_features, dtype=STORE_DTYPE) if smooth else None)
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        self._reset_packed()

    @classmethod
    def from_tensors(cls, t: W4A4Tensors) -> W4A4Linear:
        layer = cls(
            t.in_features, t.out_features, t.rank, smooth=t.smooth is not None, bias=t.bias is not None
        )
        layer.load_tensors(t)
        return layer

    def load_tensors(self, t: W4A4Tensors) -> None:
        for key, value in t.items():
            getattr(self, key).copy_(value)
        self._reset_packed()

    def tensors(self) -> W4A4Tensors:
        return W4A4Tensors(
            self.qweight, self.wscales, self.proj_down, self.proj_up, smooth=self.smooth, bias=self.bias
        )

    def _apply(self, fn, recurse=True):
        self._reset_packed()  # packed forms belong to the old device
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        self._reset_packed()
        return super()._load_from_state_dict(*args, **kwargs)

    def _layer(self, x: Tensor):
        return self._get_packed("layer", x, lambda backend: backend.prepare(self))

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        backend, packed = self._layer(x)
        if residual is None:
            return backend.forward(x, packed)
        if self._fuses(x, backend.has_fused_residual):
            return backend.forward(x, packed, residual=residual)  # added in the GEMM's epilogue
        return residual + backend.forward(x, packed)

    def forward_normed(self, x: Tensor, norm, delta: Tensor | None = None) -> Tensor:
        return self._normed(x, norm, *self._layer(x), delta)

    def forward_residual(self, h: Tensor, x: Tensor) -> tuple[Tensor, Tensor | None]:
        backend, _ = self._layer(h)
        if self._fuses(h, backend.has_fused_residual):
            return self(h, residual=x), None  # added in the GEMM's epilogue
        return super().forward_residual(h, x)

    @classmethod
    def merge(cls, linears: list[Linear]) -> W4A4Group | None:
        if len(linears) < 2 or not all(type(linear) is cls for linear in linears):
            return None
        if len({linear.in_features for linear in linears}) != 1:
            return None
        return W4A4Group(linears)

    def extra_repr(self) -> str:
        smooth = ", smooth" if self.smooth is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}{smooth}"


class W4A4Group(_Prepared, Linear):
    """W4A4 Linears that read one input, run as one grouped GEMM where the backend can pack them as one
    (one activation quantization, the weights stacked along N: `prepare_group`), else one by one. As a
    (gate, up) pair it may also run the GEMM that writes silu(gate) * up (`prepare_swiglu`)."""

    def __init__(self, members: list[W4A4Linear]) -> None:
        super().__init__()
        self.members = nn.ModuleList(members)
        self.in_features = members[0].in_features
        self.out_features = sum(m.out_features for m in members)
        self.splits = tuple(m.out_features for m in members)
        self.fused = all(m.fused for m in members)
        self.backend_name = members[0].backend_name
        self.swiglu_gemm = members[0].swiglu_gemm
        self._reset_packed()

    def _apply(self, fn, recurse=True):
        self._reset_packed()
        return super()._apply(fn, recurse)

    def _group(self, x: Tensor):
        """(backend, packed group), the packed group None where the backend cannot run them as one."""
        return self._get_packed("group", x, self._prepare_group)

    def _prepare_group(self, backend):
        prepare = getattr(backend, "prepare_group", None)
        return None if prepare is None else prepare(list(self.members))

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        backend, packed = self._group(x)
        y = torch.cat([m(x) for m in self.members], dim=-1) if packed is None else backend.forward(x, packed)
        return y if residual is None else residual + y

    def forward_normed(self, x: Tensor, norm, delta: Tensor | None = None) -> Tensor:
        backend, packed = self._group(x)
        if packed is None:
            first, *rest = self.members
            outputs = [first.forward_normed(x, norm, delta)]  # x + delta is in x from here on
            return torch.cat(outputs + [m.forward_normed(x, norm) for m in rest], dim=-1)
        return self._normed(x, norm, backend, packed, delta)

    def forward_swiglu(self, x: Tensor, norm, delta: Tensor | None = None) -> Tensor:
        if self.swiglu_gemm and len(self.members) == 2 and self._fuses(x, True):
            backend, packed = self._get_packed("swiglu", x, self._prepare_swiglu)
            if packed is not None:
                return self._normed(x, norm, backend, packed, delta)
        return super().forward_swiglu(x, norm, delta)

    def _prepare_swiglu(self, backend):
        prepare = getattr(backend, "prepare_swiglu", None)
        return None if prepare is None else prepare(list(self.members))
