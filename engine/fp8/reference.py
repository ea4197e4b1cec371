"""The FP8 numerics contract (../shared/DESIGN.md "FP8 numerics") in plain torch, on any device.

Weights, made at load from a bf16/fp16/fp32 checkpoint: wscale[n] = max|W[n, :]| / 448,
qw = e4m3(W / wscale[n]). Activations, per token: ascale[m] = max|x[m, :]| / 448, qx = e4m3(x / ascale[m]).
y = ascale[m] * wscale[n] * (qx[m, :] . qw[n, :]), the dot products accumulated in float32 (+ bias).
Scales use a = max(max|.|, MIN_AMAX) so that a row of zeros gets codes 0 and a finite scale; the codes are
e4m3(x * (448 / a)), one division a row (within an ulp of x / scale before the e4m3 rounding). Divisions
are IEEE float32 and the cast rounds to nearest even: csrc/fp8_quantize.cu gives the same codes and scales.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
MIN_AMAX = 1e-12  # csrc/w4a4_launch.h kFp8MinAmax
KERNEL_MAX_K = 3072  # csrc/w4a4_launch.h kFp8MaxK: wider rows are quantized in torch


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise e4m3 codes [M, K] and float32 scales [M, 1] of x [M, K]."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=MIN_AMAX)
    e4m3_max = torch.full_like(amax, E4M3_MAX)  # a tensor: torch multiplies by 1 / a Python-number divisor
    return (x.float() * (e4m3_max / amax)).to(E4M3), amax / e4m3_max


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


def fp8_matmul_reference(
    qx: torch.Tensor,
    ascale: torch.Tensor,
    qw: torch.Tensor,
    wscale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """y [M, N] = ascale * wscale * (qx . qw) + bias in float32, cast to out_dtype (ascale [M, 1],
    wscale [N])."""
    y = (qx.float() @ qw.float().T) * ascale * wscale.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)
