"""The W4A4 linear forward in plain torch: THE numerics contract the CUDA kernels must match.

For a layer with canonical tensors (engine/w4a4/format.py) and an input x [M, K]:

1. Smoothing: xs = float32(x) / float32(smooth)   (xs = float32(x) when the layer has no smooth)
2. Activation quantization, per token m and per group g of 64 consecutive k:
       ascale[m, g] = max_k |xs[m, g, k]| / 7                 (float32 IEEE division)
       qx[m, g, k]  = clamp(round_half_even(xs / ascale), -8, 7)
   A group whose max |xs| is 0 has ascale 0 and qx 0 (it contributes exactly 0; no division happens).
3. Group dot products, exact integers: dot[m, n, g] = sum_k qx[m, g, k] * qw[n, g, k]. |dot| <= 64 * 64,
   so they are exact in int32 and in float32 alike; this file computes them as float32 matmuls of
   integer-valued operands (exact: every partial sum is an integer below 2^24, whatever the order).
4. y[m, n] = sum_g (ascale[m, g] * wscale[n, g]) * dot[m, n, g]      (float32, g ascending)
           + (xs @ float32(proj_down)) @ float32(proj_up).T         (float32)
           + float32(bias)                                          (when present)
5. The result is cast to x's dtype.

Kernels are correct when they match this on fresh random inputs (including odd M) within a tolerance
stated by their tests; they may reorder the float32 sums of step 4 and use fp16 MMA for the low-rank branch.
"""

from __future__ import annotations

import torch

from engine.errors import QuantError
from engine.w4a4.format import GROUP_SIZE, QMAX, W4A4Tensors, quantize_to_grid, unpack_int4


def quantize_activations(x: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype) -> (q int8 [M, K] in [-8, 7], scales float32 [M, K/64])."""
    if x.dim() != 2 or x.shape[1] % group_size:
        raise QuantError(
            f"quantize_activations needs x [M, K] with K a multiple of {group_size}, got {tuple(x.shape)}."
        )
    m, k = x.shape
    xg = x.float().reshape(m, k // group_size, group_size)
    # a 0-d tensor divisor: torch on CUDA multiplies by the reciprocal of a Python scalar divisor, which can
    # differ from IEEE division by an ulp and flip a rounding tie; tensor / tensor divides on every device
    scales = xg.abs().amax(-1) / xg.new_full((), QMAX)
    q = quantize_to_grid(xg, scales[..., None])
    return q.to(torch.int8).reshape(m, k), scales


def dequantize_weight(
    qweight: torch.Tensor, wscales: torch.Tensor, group_size: int = GROUP_SIZE
) -> torch.Tensor:
    """float32 [N, K] = qw * wscale (per row, per group): the int4 part of the (smoothed) weight."""
    q = unpack_int4(qweight).float()
    n, k = q.shape
    return (q.reshape(n, k // group_size, group_size) * wscales.float()[..., None]).reshape(n, k)


def effective_weight(t: W4A4Tensors) -> torch.Tensor:
    """The float32 weight [N, K] the layer stands for, activation quantization aside (W ~ this).

    The stored tensors describe W * smooth (applied to x / smooth), so the smoothing is divided back out.
    """
    w = dequantize_weight(t.qweight, t.wscales) + t.proj_up.float() @ t.proj_down.float().T
    return w / t.smooth.float() if t.smooth is not None else w


def grouped_int_matmul(
    qx: torch.Tensor,
    ascale: torch.Tensor,
    qw: torch.Tensor,
    wscale: torch.Tensor,
    group_size: int = GROUP_SIZE,
) -> torch.Tensor:
    """Step 4's quantized term: sum_g ascale[:, g] wscale[:, g] (qx_g . qw_g), float32 [M, N]."""
    m, k = qx.shape
    y = torch.zeros(m, qw.shape[0], dtype=torch.float32, device=qx.device)
    for g in range(k // group_size):
        cols = slice(g * group_size, (g + 1) * group_size)
        dot = qx[:, cols].float() @ qw[:, cols].float().T
        y += (ascale[:, g, None] * wscale[None, :, g]) * dot
    return y


def w4a4_linear_reference(x: torch.Tensor, layer: W4A4Tensors) -> torch.Tensor:
    """y = W4A4 linear of x [..., K] -> [..., N] in x's dtype, per the module docstring."""
    k, n = layer.in_features, layer.out_features
    if x.shape[-1] != k:
        raise QuantError(f"W4A4 layer expects inputs with last dimension {k}, got {tuple(x.shape)}.")
    lead = x.shape[:-1]
    xs = x.reshape(-1, k).float()
    if layer.smooth is not None:
        xs = xs / layer.smooth.float()
    qx, ascale = quantize_activations(xs)
    y = grouped_int_matmul(qx, ascale, unpack_int4(layer.qweight), layer.wscales.float())
    y += (xs @ layer.proj_down.float()) @ layer.proj_up.float().T
    if layer.bias is not None:
        y += layer.bias.float()
    return y.to(x.dtype).reshape(*lead, n)


def layer_tensors(layer) -> W4A4Tensors:
    """The canonical tensors of `layer`: a W4A4Linear (anything with .tensors()) or W4A4Tensors."""
    return layer if isinstance(layer, W4A4Tensors) else layer.tensors()


class ReferenceW4A4Backend:
    """The backend interface over the reference: any device, no build step; correct everywhere, fast
    nowhere."""

    name = "reference"
    has_fused_rmsnorm = False
    has_fused_residual = False

    def can_use(self, device) -> tuple[bool, str]:
        return True, ""

    def prepare(self, layer) -> W4A4Tensors:
        return layer_tensors(layer)

    def forward(self, x: torch.Tensor, packed: W4A4Tensors) -> torch.Tensor:
        return w4a4_linear_reference(x, packed)
