"""The one Linear interface the model calls, and its dense (fp32/bf16/fp16) implementation.

engine/loading.py decides each Linear's implementation when it loads a checkpoint (DenseLinear here,
W4A4Linear in engine/w4a4/linear.py), and merges the Linears that read one input (q/k/v, gate/up) into
one with `merge`. The model calls only the methods below. An implementation overrides those it can run
faster: the input's RMSNorm inside its activation quantization, the residual add in its GEMM's epilogue
(else the next RMSNorm adds it), silu(gate) * up written by the GEMM itself, q and k head-normed and rotated
by the GEMM itself (DenseLinear's on Hopper: Triton GEMMs, engine/kernels/swiglu.py and qkv_rope.py).
"""

from __future__ import annotations

import functools
import importlib
import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.model.layers import RMSNorm, silu_mul

log = logging.getLogger(__name__)


class Linear(nn.Module):
    """y = x W^T (+ bias), with W [out_features, in_features]. A merged Linear's output is its members'
    outputs side by side; `splits` holds their widths (one entry when nothing is merged)."""

    in_features: int
    out_features: int
    splits: tuple[int, ...]
    fused: bool = True  # may call the fused CUDA kernels (engine/kernels/fused.py); fixed at load
    swiglu_gemm: bool = True  # a (gate, up) Linear may write silu(gate) * up in its GEMM; fixed at load
    qkv_rope_gemm: bool = True  # a q/k/v Linear may norm and rotate q and k in its GEMM; fixed at load

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """x W^T, plus `residual` (the output's shape) when given."""
        raise NotImplementedError

    def forward_normed(self, x: Tensor, norm: RMSNorm, delta: Tensor | None = None) -> Tensor:
        """self(norm(x)); with delta, of norm(x + delta), x + delta written over x (RMSNorm.forward)."""
        return self(norm(x, delta))

    def forward_swiglu(self, x: Tensor, norm: RMSNorm, delta: Tensor | None = None) -> Tensor:
        """silu(gate) * up for a merged (gate, up) Linear on norm(x) (x + delta as forward_normed)."""
        gate, up = self.forward_normed(x, norm, delta).split(self.splits, dim=-1)
        return silu_mul(gate, up, self.fused)

    def forward_qkv_rope(self, x, norm, delta, q_norm, k_norm, cos, sin, heads) -> Tensor | None:
        """A merged q/k/v Linear's output for norm(x) (x + delta as forward_normed) with q and k already
        q_norm'ed / k_norm'ed and rotated by cos / sin (heads: q heads, kv heads), where this implementation
        does that in its GEMM; else None, before touching x (the caller composes qk_norm_rope)."""
        return None

    def forward_residual(self, h: Tensor, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """The residual stream x + self(h) as a block hands it on: (x, self(h)), the add left to the next
        norm's kernel (RMSNorm.forward's delta), or (x + self(h), None) where the GEMM adds it itself."""
        return x, self(h)

    @classmethod
    def merge(cls, linears: list[Linear]) -> Linear | None:
        """One Linear computing the given ones side by side (all of this class), or None when they cannot
        share one GEMM; the caller then keeps them apart."""
        return None


class QuantizedLinear(Linear):
    """A Linear whose buffers keep the dtypes their numerics are defined on: device moves apply to them,
    dtype casts (model.half(), model.to(bf16)) do not."""

    def _apply(self, fn, recurse=True):
        for name, t in self._buffers.items():
            if t is not None:
                self._buffers[name] = t.to(fn(t.reshape(-1)[:0]).device)
        return self


class DenseLinear(Linear, nn.Linear):
    """The unquantized Linear: one cuBLAS GEMM (torch's F.linear). Its parameters are nn.Linear's, so
    official state dicts load into it and calibration hooks see an nn.Linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        nn.Linear.__init__(self, in_features, out_features, bias=bias)
        self.splits = (out_features,)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        y = F.linear(x, self.weight, self.bias)
        return y if residual is None else residual + y

    def forward_swiglu(self, x: Tensor, norm: RMSNorm, delta: Tensor | None = None) -> Tensor:
        """On a Hopper GPU (bf16/fp16, fused kernels and `swiglu_gemm` on) one GEMM writes silu(gate) * up
        (engine/kernels/swiglu.py); elsewhere cuBLAS's gate and up go through the silu_mul kernel."""
        even = len(self.splits) == 2 and self.splits[0] == self.splits[1]
        kernel = self._triton_kernel("swiglu", self.swiglu_gemm and even, x)
        if kernel is None or not kernel.can_run(self.weight):
            return super().forward_swiglu(x, norm, delta)
        normed = norm(x, delta)
        h = kernel.swiglu_gemm(normed.reshape(-1, normed.shape[-1]), self.weight)
        return h.view(*normed.shape[:-1], h.shape[-1])

    def forward_qkv_rope(self, x, norm, delta, q_norm, k_norm, cos, sin, heads) -> Tensor | None:
        """On a Hopper GPU (bf16/fp16, fused kernels and `qkv_rope_gemm` on) one GEMM writes q and k already
        normed and rotated (engine/kernels/qkv_rope.py)."""
        kernel = self._triton_kernel("qkv_rope", self.qkv_rope_gemm and q_norm.eps == k_norm.eps, x)
        if kernel is None or cos.dtype != x.dtype or not kernel.can_run(self.weight, *heads, cos.shape[-1]):
            return None
        normed = norm(x, delta)
        rows = normed.reshape(-1, normed.shape[-1])
        return kernel.qkv_rope_gemm(
            rows, self.weight, q_norm.weight, k_norm.weight, cos, sin, q_norm.eps, *heads
        )

    def _triton_kernel(self, name: str, switch: bool, x: Tensor):
        """engine/kernels/<name>.py where its switch and the fused kernels are on, x is on CUDA in the
        weight's dtype and Triton imports; else None."""
        if not (switch and self.fused and self.bias is None and x.is_cuda and x.dtype == self.weight.dtype):
            return None
        return _triton_module(name)

    @classmethod
    def merge(cls, linears: list[Linear]) -> DenseLinear | None:
        if not all(type(linear) is cls for linear in linears):
            return None
        weights = [linear.weight for linear in linears]
        if len({(w.shape[1], w.dtype, w.device) for w in weights}) != 1:
            return None
        with torch.device("meta"):
            merged = cls(weights[0].shape[1], sum(w.shape[0] for w in weights), bias=False)
        merged.weight = nn.Parameter(torch.cat([w.detach() for w in weights]), requires_grad=False)
        if any(linear.bias is not None for linear in linears):
            biases = [
                linear.bias.detach() if linear.bias is not None else weights[0].new_zeros(linear.out_features)
                for linear in linears
            ]
            merged.bias = nn.Parameter(torch.cat(biases), requires_grad=False)
        merged.splits = tuple(s for linear in linears for s in linear.splits)
        merged.fused = all(linear.fused for linear in linears)
        merged.swiglu_gemm = all(linear.swiglu_gemm for linear in linears)
        merged.qkv_rope_gemm = all(linear.qkv_rope_gemm for linear in linears)
        return merged

    def extra_repr(self) -> str:
        merged = f", splits={self.splits}" if len(self.splits) > 1 else ""
        return super().extra_repr() + merged


# engine/kernels/swiglu.py and qkv_rope.py need tl.range's flatten and host-side tensor descriptors (Triton
# 3.4 on; tested on 3.6): an older Triton would fail at the first forward's compile, not at import
TRITON_GEMMS_MIN = (3, 4)


@functools.cache
def _triton_module(name: str):
    try:
        import triton

        version = tuple(int(part) for part in triton.__version__.split(".")[:2])
        if version < TRITON_GEMMS_MIN:
            log.info("engine/kernels/%s.py off: Triton %s is older than 3.4", name, triton.__version__)
            return None
        return importlib.import_module(f"engine.kernels.{name}")
    except ImportError as e:
        log.info("engine/kernels/%s.py off: Triton is not importable (%s)", name, e)
        return None


def default_linear(name: str, in_features: int, out_features: int) -> DenseLinear:
    """The unquantized Linear of the official model (no bias anywhere in the backbone)."""
    return DenseLinear(in_features, out_features, bias=False)


def merge_linears(linears: list[Linear]) -> Linear | None:
    """The members merged by their implementation's `merge`, or None (different implementations, or
    ones that cannot share a GEMM)."""
    kinds = {type(linear) for linear in linears}
    return kinds.pop().merge(linears) if len(kinds) == 1 else None
