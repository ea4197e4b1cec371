"""Per-input-channel smoothing (SmoothQuant-style migration): the layer computes (x / s) @ (W * s)^T.

Dividing the few outlier input channels by a large s shrinks the activation groups' max |x|, so the other
channels of the group keep their int4 resolution; the weight columns grow by s instead, and the low-rank
branch absorbs much of what that costs the weights (SVDQuant).
"""

from __future__ import annotations

import torch

from engine.w4a4.format import STORE_DTYPE

# Channels far below the largest are floored, so a channel silent in calibration cannot get a tiny s
# (which would blow up its activations at run time).
_FLOOR = 1e-3


def smoothing_factors(act_absmax: torch.Tensor, w: torch.Tensor, alpha: float) -> torch.Tensor:
    """s [K] = max|x_k|^alpha / max|W_:,k|^(1 - alpha), rounded to the stored dtype, returned as float32."""
    a = act_absmax.float()
    a = a.clamp_min(float(a.max()) * _FLOOR + 1e-12)
    wmax = w.float().abs().amax(0)
    wmax = wmax.clamp_min(float(wmax.max()) * _FLOOR + 1e-12)
    s = a.pow(alpha) / wmax.pow(1.0 - alpha)
    s = s / s.median()  # only relative factors matter; keep them near 1 for the fp16 range
    return s.clamp(1e-3, 1e3).to(STORE_DTYPE).float()
