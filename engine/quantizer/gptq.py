"""Weight rounding to int4 per row and group of 64: round-to-nearest and GPTQ (arXiv 2210.17323).

GPTQ quantizes one input column at a time and spreads each column's rounding error over the columns not yet
quantized, weighted by the inverse Hessian of the layer's inputs (H = X^T X), which minimises the output
error ||X W^T - X Q^T|| instead of the weight error. Columns are processed in blocks with lazy updates of
the rest of the matrix; with `act_order` the columns with the largest Hessian diagonal go first, and the
group scales are fixed up front from the weights handed in (the stored groups stay 64 consecutive inputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import QuantError
from engine.w4a4.format import (
    GROUP_SIZE,
    check_group_multiple,
    quantize_to_grid,
    weight_group_scales,
)


@dataclass(frozen=True)
class GPTQConfig:
    damp: float = 0.01  # added to H's diagonal, as a fraction of its mean diagonal
    block_size: int = 128  # columns per lazy-update block (a multiple of the group size)
    act_order: bool = True

    def __post_init__(self) -> None:
        if self.block_size % GROUP_SIZE or self.block_size <= 0:
            raise QuantError(
                f"GPTQ block_size={self.block_size} must be a positive multiple of {GROUP_SIZE}."
            )
        if not 0 < self.damp < 1:
            raise QuantError(f"GPTQ damp={self.damp} must lie in (0, 1); 0.01 is the usual value.")


def quantize_rtn(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest: w [N, K] -> (q int8 [N, K], scales float32 [N, K/64])."""
    n, k = w.shape
    check_group_multiple("weight", k)
    scales = weight_group_scales(w)
    q = quantize_to_grid(w.float(), scales.repeat_interleave(GROUP_SIZE, dim=1))
    return q.to(torch.int8), scales


def _inverse_hessian_factor(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp * mean(diag H) * I)^-1, computed in float64."""
    h = h.double()
    k = h.shape[0]
    h = h + torch.eye(k, dtype=h.dtype, device=h.device) * (damp * torch.diagonal(h).mean())
    chol, info = torch.linalg.cholesky_ex(h)
    if int(info) != 0:
        raise QuantError(
            f"GPTQ: the calibration Hessian is not positive definite even with damp={damp}; "
            "use more calibration samples or a larger damping."
        )
    hinv = torch.cholesky_inverse(chol)
    return torch.linalg.cholesky(hinv, upper=True).float()


def gptq_quantize(
    w: torch.Tensor, h: torch.Tensor, cfg: GPTQConfig = GPTQConfig()
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ: w [N, K], h = X^T X [K, K] -> (q int8 [N, K], scales float32 [N, K/64]), on w's device."""
    n, k = w.shape
    check_group_multiple("weight", k)
    if h.shape != (k, k):
        raise QuantError(f"GPTQ: Hessian shape {tuple(h.shape)} does not match the weight's {k} inputs.")
    w = w.float().clone()
    h = h.to(device=w.device, dtype=torch.float32).clone()
    dead = torch.diagonal(h) == 0  # inputs never active in calibration: keep them, round them plainly
    h[dead, dead] = 1.0

    scales = torch.zeros(n, k // GROUP_SIZE, device=w.device)
    perm = None
    if cfg.act_order:
        scales = weight_group_scales(w)
        perm = torch.argsort(torch.diagonal(h), descending=True)
        w, h = w[:, perm], h[perm][:, perm]
        col_scales = scales[:, perm // GROUP_SIZE]
    else:
        col_scales = torch.zeros_like(w)  # filled one group at a time, from the error-updated weights
    hinv = _inverse_hessian_factor(h, cfg.damp)
    q = torch.zeros_like(w)

    for start in range(0, k, cfg.block_size):
        stop = min(start + cfg.block_size, k)
        block = w[:, start:stop].clone()
        errs = torch.zeros_like(block)
        hinv_block = hinv[start:stop, start:stop]
        for i in range(stop - start):
            col = start + i
            if not cfg.act_order and col % GROUP_SIZE == 0:
                g = weight_group_scales(block[:, i : i + GROUP_SIZE])
                scales[:, col // GROUP_SIZE] = g[:, 0]
                col_scales[:, col : col + GROUP_SIZE] = g
            s = col_scales[:, col]
            qcol = quantize_to_grid(block[:, i], s)
            q[:, col] = qcol
            err = (block[:, i] - qcol * s) / hinv_block[i, i]
            block[:, i:].addr_(err, hinv_block[i, i:], alpha=-1.0)
            errs[:, i] = err
        w[:, stop:] -= errs @ hinv[start:stop, stop:]

    if perm is not None:
        q = q[:, torch.argsort(perm)]
    return q.to(torch.int8), scales
