"""Building blocks of the Qwen3 backbone: RMSNorm, rotary tables, the q/k head norm + RoPE, SiLU * up,
and the SwiGLU MLP.

Numerics follow Qwen3 as transformers implements it (the official OmniVoice runs that code), so the
same weights give the same activations: RMSNorm in float32 then cast back, rotate-half RoPE with
cos/sin computed in float32 and cast to the activation dtype.

Fused kernels (engine/kernels/fused.py) take over where they can, with the same roundings: RMSNorm,
SiLU(gate) * up and the q/k head norm + RoPE as one kernel each. Each module's `fused` flag (set at load
from EngineConfig.fused_kernels) allows them; the torch code beside each call is the fallback.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.kernels.fused import fused_ops

LinearFactory = Callable[[str, int, int], nn.Module]  # (qualified name, in_features, out_features)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = True

    def forward(self, x: Tensor, delta: Tensor | None = None) -> Tensor:
        """norm(x); with delta, the block's residual add first: x + delta is written over x and normed."""
        k = x.shape[-1]
        ops = fused_ops(x) if self.fused else None
        if ops is None or k % 8 or self.weight.dtype != x.dtype or not all(map(fits_row_kernels, (x, delta))):
            if delta is not None:
                x.add_(delta)
            return rms_norm(x, self.weight, self.eps)
        if delta is None:
            return ops.rms_norm(x.view(-1, k), self.weight, self.eps).view(x.shape)
        return ops.add_rms_norm(x.view(-1, k), delta.view(-1, k), self.weight, self.eps).view(x.shape)


def fits_row_kernels(t: Tensor | None) -> bool:
    """Whether a row kernel can read t as contiguous rows with 16-byte accesses (None: nothing to read)."""
    return t is None or (t.is_contiguous() and t.data_ptr() % 16 == 0)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm in torch: float32 statistics, the normed x cast back before the weight multiplies it."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope_cos_sin(
    position_ids: Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos and sin tables [T, head_dim] for the given positions (rotate-half layout: halves repeated)."""
    exponents = torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    freqs = position_ids.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [T, heads, head_dim] by per-token angles; cos/sin are [T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def qk_norm_rope(
    q: Tensor, k: Tensor, q_norm: RMSNorm, k_norm: RMSNorm, cos: Tensor, sin: Tensor, fused: bool
) -> tuple[Tensor, Tensor]:
    """apply_rope(q_norm(q)) and apply_rope(k_norm(k)) for q [T, Hq, D], k [T, Hk, D]."""
    fits = fused and q_norm.eps == k_norm.eps and q.shape[-1] in (16, 32, 64, 128, 256)
    ops = fused_ops(q) if fits else None
    if ops is None or any(t.data_ptr() % 16 or t.stride(0) % 8 for t in (q, k)):
        return apply_rope(q_norm(q), cos, sin), apply_rope(k_norm(k), cos, sin)
    return ops.qk_norm_rope(q, k, q_norm.weight, k_norm.weight, cos, sin, q_norm.eps)


def silu_mul(gate: Tensor, up: Tensor, fused: bool) -> Tensor:
    """silu(gate) * up (gate and up may be strided rows, e.g. the halves of a merged gate/up output)."""
    ops = fused_ops(gate) if fused else None
    if ops is None or gate.shape != up.shape or gate.shape[-1] % 8:
        return F.silu(gate) * up
    rows = [t.reshape(-1, t.shape[-1]) for t in (gate, up)]
    if not all(t.stride(-1) == 1 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0 for t in rows):
        return F.silu(gate) * up
    return ops.silu_mul(*rows).view(gate.shape)


class SiblingBlock(nn.Module):
    """A block whose Linears named in SIBLINGS read one input: at load they are merged into one Linear
    (named MERGED) where their implementation can run them as one GEMM; the quantizer gives them one
    smoothing so that they can."""

    SIBLINGS: tuple[str, ...]
    MERGED: str

    def merge_projections(self, merge: Callable[[list], nn.Module | None]) -> None:
        if getattr(self, self.MERGED) is not None:
            return
        merged = merge([getattr(self, name) for name in self.SIBLINGS])
        if merged is not None:
            setattr(self, self.MERGED, merged)
            for name in self.SIBLINGS:
                delattr(self, name)


class SwiGLU(SiblingBlock):
    """The MLP block with its residual: x + down(silu(gate(h)) * up(h)) for h = norm(x), x the residual
    stream (x + delta when the previous block left its add to this block's norm)."""

    SIBLINGS, MERGED = ("gate_proj", "up_proj"), "gate_up_proj"

    def __init__(self, prefix: str, hidden: int, intermediate: int, linear_factory: LinearFactory) -> None:
        super().__init__()
        self.gate_proj = linear_factory(f"{prefix}.gate_proj", hidden, intermediate)
        self.up_proj = linear_factory(f"{prefix}.up_proj", hidden, intermediate)
        self.down_proj = linear_factory(f"{prefix}.down_proj", intermediate, hidden)
        self.gate_up_proj = None
        self.fused = True

    def forward(self, x: Tensor, delta: Tensor | None, norm: RMSNorm) -> tuple[Tensor, Tensor | None]:
        """The residual stream after the block, as Linear.forward_residual returns it."""
        if self.gate_up_proj is not None:
            h = self.gate_up_proj.forward_swiglu(x, norm, delta)
        else:
            gate = self.gate_proj.forward_normed(x, norm, delta)  # x + delta is in x from here on
            h = silu_mul(gate, self.up_proj.forward_normed(x, norm), self.fused)
        return self.down_proj.forward_residual(h, x)
