"""Whether the decoding step's fused vocabulary kernel (engine/kernels/guided_argmax.py) can take a batch:
logits on a CUDA GPU in bf16/fp16, Triton importable, greedy class choice (class_temperature 0; the
Gumbel draw over the top classes stays on torch's path). Otherwise torch's path runs, which is also the
kernel's reference (tests/test_guided_argmax.py)."""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)


@functools.cache
def _kernel():
    try:
        from engine.kernels.guided_argmax import guided_argmax
    except ImportError as e:
        log.info("fused decoding kernel off: Triton is not importable (%s)", e)
        return None
    return guided_argmax


def fused_guided_argmax(logits: torch.Tensor, class_temperature: float):
    """guided_argmax(cond, uncond, guidance_scale, mask_id) when it can take these logits, else None."""
    if class_temperature != 0 or not logits.is_cuda or logits.dtype not in (torch.bfloat16, torch.float16):
        return None
    return _kernel()
