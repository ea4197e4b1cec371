"""W4A4Linear: a drop-in for the backbone's nn.Linear that holds the canonical W4A4 tensors as buffers.

The forward pass goes through a backend: `engine.kernels.choose_w4a4_backend(device)` (the CUDA kernels
where they are built and supported, the reference otherwise), or the reference directly when the kernels
package cannot be imported. A backend turns the layer into its own layout once (`prepare`) per device.

`grouped_forward` runs several layers that read one input (q/k/v, gate/up) as one GEMM on backends that
offer `prepare_group`: one activation quantization instead of one per layer, and one wider GEMM. With
`swiglu=True` it runs gate and up as one GEMM that writes silu(gate) * up (backends with `prepare_swiglu`).
The model decides where to group (engine/model/layers.py normed_projections, swiglu_input).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.quant.format import STORE_DTYPE, W4A4Tensors
from engine.quant.reference import ReferenceW4A4Backend

log = logging.getLogger(__name__)

_BACKENDS: dict[str, object] = {}


def backend_for(device: torch.device):
    """The W4A4 backend for a device, chosen (and logged) once per process and device."""
    key = str(device)
    if key not in _BACKENDS:
        try:
            from engine.kernels import choose_w4a4_backend
        except ImportError as e:
            log.warning("W4A4 on %s: reference backend (engine.kernels cannot be imported: %s)", device, e)
            _BACKENDS[key] = ReferenceW4A4Backend()
        else:
            _BACKENDS[key] = choose_w4a4_backend(device)
    return _BACKENDS[key]


class W4A4Linear(nn.Module):
    """y = W4A4(x) per engine/quant/reference.py; in/out features as the Linear it replaces."""

    def __init__(
        self, in_features: int, out_features: int, rank: int, smooth: bool = False, bias: bool = False
    ):
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.register_buffer("qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("wscales", torch.zeros(out_features, in_features // 64, dtype=STORE_DTYPE))
        self.register_buffer("proj_down", torch.zeros(in_features, rank, dtype=STORE_DTYPE))
        self.register_buffer("proj_up", torch.zeros(out_features, rank, dtype=STORE_DTYPE))
        self.register_buffer("smooth", torch.ones(in_features, dtype=STORE_DTYPE) if smooth else None)
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        self._packed = None
        self._packed_for = None
        self.generation = 0  # counts changes of tensors or device: copies prepared before are stale
        # grouped_forward's groups led by this layer: {swiglu: (what the group was made of, its packed form)}
        self._groups: dict[bool, tuple] = {}

    def _stale(self) -> None:
        self._packed = None
        self._groups = {}
        self.generation += 1

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
        self._stale()

    def tensors(self) -> W4A4Tensors:
        return W4A4Tensors(
            self.qweight, self.wscales, self.proj_down, self.proj_up, smooth=self.smooth, bias=self.bias
        )

    def _apply(self, fn, recurse=True):
        """Device moves apply; dtype casts (model.half(), .to(bf16)) do not: the canonical tensors keep
        their stored dtypes, which the numerics contract is defined on."""
        self._stale()  # prepared copies belong to the old device
        for name, t in self._buffers.items():
            if t is not None:
                self._buffers[name] = t.to(fn(t.reshape(-1)[:0]).device)
        return self

    def _load_from_state_dict(self, *args, **kwargs):
        self._stale()
        return super()._load_from_state_dict(*args, **kwargs)

    def _prepared(self, device: torch.device):
        backend = backend_for(device)
        if self._packed is None or self._packed_for is not backend:
            self._packed, self._packed_for = backend.prepare(self), backend
        return backend, self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        backend, packed = self._prepared(x.device)
        return backend.forward(x, packed)

    def fuses_rmsnorm(self, x: torch.Tensor) -> bool:
        """Whether forward_rmsnorm on inputs like x runs the fused kernel (else it composes)."""
        return self._fused_on(x, backend_for(x.device).has_fused_rmsnorm)

    def fuses_residual(self, x: torch.Tensor) -> bool:
        """Whether forward_plus on inputs like x adds in the GEMM's epilogue (else after it)."""
        return self._fused_on(x, backend_for(x.device).has_fused_residual)

    @staticmethod
    def _fused_on(x: torch.Tensor, backend_has_it: bool) -> bool:
        if not backend_has_it:
            return False
        from engine.kernels.fused import fused_ops  # importable: the backend came from engine.kernels

        return fused_ops(x) is not None

    def forward_plus(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + self(x), rounded as torch rounds it."""
        backend, packed = self._prepared(x.device)
        if not self.fuses_residual(x):
            return residual + backend.forward(x, packed)
        return backend.forward(x, packed, residual=residual)

    def forward_rmsnorm(self, x: torch.Tensor, norm) -> torch.Tensor:
        """self(norm(x)) for an RMSNorm module `norm`."""
        backend, packed = self._prepared(x.device)
        if not self.fuses_rmsnorm(x):
            return backend.forward(norm(x), packed)
        return backend.forward_rmsnorm(x, norm.weight, norm.eps, packed)

    def extra_repr(self) -> str:
        smooth = ", smooth" if self.smooth is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}{smooth}"


def grouped_forward(layers, x: torch.Tensor, norm=None, swiglu: bool = False):
    """[layer(norm(x)) for layer in layers] (x itself without a norm) as one grouped W4A4 GEMM, or None when
    the layers cannot share one (not all W4A4, a backend without groups, different smoothing: the caller
    then runs them one by one). With swiglu, layers are (gate, up) and the result is the one tensor
    silu(gate(h)) * up(h), or None where the backend has no such GEMM for them. A group is prepared once
    and rebuilt when a member changes."""
    if len(layers) < 2 or not all(isinstance(layer, W4A4Linear) for layer in layers):
        return None
    backend = backend_for(x.device)
    prepare = getattr(backend, "prepare_swiglu" if swiglu else "prepare_group", None)
    if prepare is None:
        return None
    first = layers[0]
    key = (backend, tuple(map(id, layers)), tuple(layer.generation for layer in layers))
    if first._groups.get(swiglu, (None,))[0] != key:
        first._groups[swiglu] = (key, prepare(layers))
    packed = first._groups[swiglu][1]
    if packed is None:
        return None
    if norm is None:
        y = backend.forward(x, packed)
    elif first.fuses_rmsnorm(x):
        y = backend.forward_rmsnorm(x, norm.weight, norm.eps, packed)
    else:
        y = backend.forward(norm(x), packed)
    return y if swiglu else list(y.split(packed.splits, dim=-1))
