"""Whether the fused CUDA kernels (RMSNorm, SiLU(gate) * up, q/k head norm + RoPE, RMSNorm inside W4A4
activation quantization; the codec's Snake) can take a tensor: the extension runs on its GPU (sm_90a) and
the tensor is bf16/fp16 (float32 for the codec's). Whether they may is each module's `fused` flag, fixed at
load from EngineConfig.fused_kernels.
"""

from __future__ import annotations

import functools
import logging

import torch

from engine.kernels import ops

log = logging.getLogger(__name__)

HALF = (torch.bfloat16, torch.float16)


@functools.cache
def _extension_runs_on(device: str) -> bool:
    from engine.kernels.w4a4 import CudaW4A4Backend  # the same capability check as the W4A4 ops

    ok, reason = CudaW4A4Backend().can_use(device)
    if not ok:
        log.info("fused kernels off on %s: %s", device, reason)
    return ok


def fused_ops(t: torch.Tensor, dtypes: tuple[torch.dtype, ...] = HALF):
    """torch.ops.ovbatch_w4a4 when the fused kernels can take `t` (CUDA sm_90a, one of `dtypes`: bf16/fp16,
    float32 for the codec's Snake), else None."""
    if not (t.is_cuda and t.dtype in dtypes):
        return None
    return ops.load() if _extension_runs_on(str(t.device)) else None
