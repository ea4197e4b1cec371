"""Building blocks of the Qwen3 backbone: Linear factory, RMSNorm, rotary tables, SwiGLU MLP.

Numerics follow Qwen3 as transformers implements it (the official OmniVoice runs that code), so the
same weights give the same activations: RMSNorm in float32 then cast back, rotate-half RoPE with
cos/sin computed in float32 and cast to the activation dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


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


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, prefix: str, hidden: int, intermediate: int, linear_factory: LinearFactory) -> None:
        super().__init__()
        self.gate_proj = linear_factory(f"{prefix}.gate_proj", hidden, intermediate)
        self.up_proj = linear_factory(f"{prefix}.up_proj", hidden, intermediate)
        self.down_proj = linear_factory(f"{prefix}.down_proj", intermediate, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
