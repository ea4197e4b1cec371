"""Building blocks of the Qwen3 backbone: Linear factory, RMSNorm, rotary tables, SwiGLU MLP.

Numerics follow Qwen3 as transformers implements it (the official OmniVoice runs that code), so the
same weights give the same activations: RMSNorm in float32 then cast back, rotate-half RoPE with
cos/sin computed in float32 and cast to the activation dtype.

Fused kernels (engine/kernels/fused.py) take over where they can, with the same roundings: RMSNorm,
SiLU(gate) * up and the q/k head norm + RoPE as one kernel each, and a Linear that offers
`fuses_rmsnorm(x)` (W4A4Linear on the CUDA kernels) computes its input's RMSNorm inside its activation
quantization. q/k/v and gate/up run as one GEMM each where the fused paths run (W4A4 groups, or bf16
Linears whose weights view one stacked tensor); a rank-16 W4A4 gate/up GEMM also writes silu(gate) * up
itself (swiglu_input), and the W4A4 o and down GEMMs add the residual stream (plus_linear).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.kernels.fused import fused_ops, groups_enabled, swiglu_gemm_enabled
from engine.quant.linear import grouped_forward

LinearFactory = Callable[[str, int, int], nn.Module]  # (qualified name, in_features, out_features)


def default_linear(name: str, in_features: int, out_features: int) -> nn.Module:
    """The unquantized Linear of the official model (no bias anywhere in the backbone)."""
    return nn.Linear(in_features, out_features, bias=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        k = x.shape[-1]
        ops = fused_ops(x)
        if ops is None or k % 8 or self.weight.dtype != x.dtype or not x.is_contiguous() or x.data_ptr() % 16:
            return rms_norm(x, self.weight, self.eps)
        return ops.rms_norm(x.view(-1, k), self.weight, self.eps).view(x.shape)


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
    q: Tensor, k: Tensor, q_norm: RMSNorm, k_norm: RMSNorm, cos: Tensor, sin: Tensor
) -> tuple[Tensor, Tensor]:
    """apply_rope(q_norm(q)) and apply_rope(k_norm(k)) for q [T, Hq, D], k [T, Hk, D]."""
    ops = fused_ops(q) if q_norm.eps == k_norm.eps and q.shape[-1] in (16, 32, 64, 128, 256) else None
    if ops is None or any(t.data_ptr() % 16 or t.stride(0) % 8 for t in (q, k)):
        return apply_rope(q_norm(q), cos, sin), apply_rope(k_norm(k), cos, sin)
    return ops.qk_norm_rope(q, k, q_norm.weight, k_norm.weight, cos, sin, q_norm.eps)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up (gate and up may be strided rows, e.g. the halves of a grouped gate/up output)."""
    ops = fused_ops(gate)
    if ops is None or gate.shape != up.shape or gate.shape[-1] % 8:
        return F.silu(gate) * up
    rows = [t.reshape(-1, t.shape[-1]) for t in (gate, up)]
    if not all(t.stride(-1) == 1 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0 for t in rows):
        return F.silu(gate) * up
    return ops.silu_mul(*rows).view(gate.shape)


def normed_projections(x: Tensor, norm: RMSNorm, linears: tuple[nn.Module, ...]) -> list[Tensor]:
    """[linear(norm(x)) for each linear]: as one GEMM where the fused paths run and the linears can share
    one (W4A4 groups; bf16 Linears viewing one stacked weight), the norm fused into W4A4 activation
    quantization where all can. Linears with hooks (calibration records their inputs) run one by one, as
    all do with OVBATCH_GROUPED_PROJECTIONS=0."""
    group = not has_hooks(linears) and groups_enabled()
    grouped = grouped_forward(linears, x, norm) if group else None
    if grouped is not None:
        return grouped
    if all(getattr(linear, "fuses_rmsnorm", lambda _: False)(x) for linear in linears):
        return [linear.forward_rmsnorm(x, norm) for linear in linears]
    h = norm(x)
    stack = group and not torch.is_grad_enabled() and fused_ops(h) is not None
    weight = stacked_weight(linears) if stack else None
    if weight is None:
        return [linear(h) for linear in linears]
    return list(F.linear(h, weight).split([linear.out_features for linear in linears], dim=-1))


def has_hooks(linears: tuple[nn.Module, ...]) -> bool:
    return any(linear._forward_hooks or linear._forward_pre_hooks for linear in linears)


def swiglu_input(x: Tensor, norm: RMSNorm, gate: nn.Module, up: nn.Module) -> Tensor:
    """silu(gate(norm(x))) * up(norm(x)): one W4A4 GEMM that applies silu(gate) * up in its epilogue where
    the fused paths and grouped projections run, the switch is on (engine/kernels/fused.py) and the layers
    allow it (engine/kernels/w4a4.py swiglu_obstacle), else the projections (normed_projections) and then
    silu_mul."""
    if not has_hooks((gate, up)) and groups_enabled() and swiglu_gemm_enabled() and fused_ops(x) is not None:
        fused = grouped_forward((gate, up), x, norm, swiglu=True)
        if fused is not None:
            return fused
    return silu_mul(*normed_projections(x, norm, (gate, up)))


def plus_linear(x: Tensor, linear: nn.Module, h: Tensor) -> Tensor:
    """x + linear(h), the add inside the W4A4 GEMM's epilogue where the fused paths run (rounded as torch
    rounds it: the same result, one kernel fewer)."""
    if not has_hooks((linear,)) and getattr(linear, "fuses_residual", lambda _: False)(h):
        return linear.forward_plus(h, x)
    return x + linear(h)


def stacked_weight(linears: tuple[nn.Module, ...]) -> Tensor | None:
    """A [sum of out_features, K] view over the linears' weights, so that they run as one GEMM (for
    inference: the view carries no gradient). The first call moves the weights into one tensor that they
    then view (no copy stays behind); a weight replaced since (a device move, an assignment) is moved
    again. None unless they are bias-free nn.Linears with weights of one input width, dtype and device."""
    weights = [linear.weight for linear in linears if type(linear) is nn.Linear and linear.bias is None]
    if len(weights) != len(linears) or len({(w.shape[1], w.dtype, w.device) for w in weights}) != 1:
        return None
    rows, k = sum(w.shape[0] for w in weights), weights[0].shape[1]
    if not _adjacent(weights):
        with torch.inference_mode(False), torch.no_grad():
            stacked = torch.cat([w.detach() for w in weights])
            for w, part in zip(weights, stacked.split([w.shape[0] for w in weights])):
                w.data = part
    return weights[0].detach().as_strided((rows, k), (k, 1))


def _adjacent(weights: list[Tensor]) -> bool:
    """Whether the weights lie back to back in one storage, in order, each contiguous."""
    start, offset = weights[0].data_ptr(), 0
    storage = weights[0].untyped_storage().data_ptr()
    for w in weights:
        if not w.is_contiguous() or w.untyped_storage().data_ptr() != storage:
            return False
        if w.data_ptr() != start + offset:
            return False
        offset += w.numel() * w.element_size()
    return True


class SwiGLU(nn.Module):
    """The MLP block with its residual: x + down(silu(gate(h)) * up(h)) for h = norm(x)."""

    def __init__(self, prefix: str, hidden: int, intermediate: int, linear_factory: LinearFactory) -> None:
        super().__init__()
        self.gate_proj = linear_factory(f"{prefix}.gate_proj", hidden, intermediate)
        self.up_proj = linear_factory(f"{prefix}.up_proj", hidden, intermediate)
        self.down_proj = linear_factory(f"{prefix}.down_proj", intermediate, hidden)

    def forward(self, x: Tensor, norm: RMSNorm) -> Tensor:
        return plus_linear(x, self.down_proj, swiglu_input(x, norm, self.gate_proj, self.up_proj))
