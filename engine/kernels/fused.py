"""The switches for the fused kernels the model calls around its Linears, and for grouped projections.

Fused paths: RMSNorm -> W4A4 activation quantization (q/k/v and gate/up inputs), and the RMSNorm,
SiLU(gate) * up and q/k head norm + RoPE kernels. They run where the CUDA extension does (sm_90a) on
bf16/fp16 tensors; OVBATCH_FUSED_KERNELS=0 turns them all off (the unfused torch path), which is how the
benchmarks measure what they save. Grouped projections (q/k/v and gate/up as one GEMM each, bf16 and W4A4)
run on the same condition; OVBATCH_GROUPED_PROJECTIONS=0 turns them off alone. The W4A4 gate/up GEMM that
writes silu(gate) * up itself runs where both are on; OVBATCH_SWIGLU_GEMM=0 turns it off alone.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from engine.kernels import ops

log = logging.getLogger(__name__)

HALF = (torch.bfloat16, torch.float16)


def fused_enabled() -> bool:
    return os.environ.get("OVBATCH_FUSED_KERNELS", "1") != "0"


def groups_enabled() -> bool:
    return os.environ.get("OVBATCH_GROUPED_PROJECTIONS", "1") != "0"


def swiglu_gemm_enabled() -> bool:
    return os.environ.get("OVBATCH_SWIGLU_GEMM", "1") != "0"


@functools.cache
def _extension_runs_on(device: str) -> bool:
    from engine.kernels.w4a4 import CudaW4A4Backend  # the same capability check as the W4A4 ops

    ok, reason = CudaW4A4Backend().can_use(device)
    if not ok:
        log.info("fused kernels off on %s: %s", device, reason)
    return ok


def fused_ops(t: torch.Tensor):
    """torch.ops.ovbatch_w4a4 when the fused kernels can take `t` (CUDA sm_90a, bf16/fp16, not switched
    off), else None."""
    if not (t.is_cuda and t.dtype in HALF and fused_enabled()):
        return None
    return ops.load() if _extension_runs_on(str(t.device)) else None
