"""silu(gate) * up of a merged bf16/fp16 (gate, up) Linear in one Triton GEMM (Hopper). Each tile multiplies
input rows by 128 gate rows and the same outputs' 128 up rows, read each k step as one [2, 128, 64] box of
the weight viewed as [2, I, K] (no copy, no new layout), and writes h = silu(gate) * up from its float32 sums:
h [M, I] instead of gate and up [M, 2I], and no silu_mul pass over them (cuBLAS has no such epilogue).
Persistent blocks (engine/kernels/persistent.py), operands and output through the tensor copy engine.

h = silu(x . w_gate) * (x . w_up), summed in float32 and rounded once; the path it replaces (cuBLAS, then the
silu_mul kernel) rounds gate and up to bf16/fp16 first (tests/test_swiglu_gemm.py holds both).

Imported only where Triton runs (engine/model/linear.py decides).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from engine.kernels.persistent import OUT_TYPES, launch, takes, tile_origin

# 128 rows x (128 gate + 128 up) outputs: the fastest tile on an H100 at OmniVoice's shapes (docs/kernels.md,
# tried and not kept).
BLOCK_M, HALF_N, BLOCK_K, STAGES, WARPS, GROUP_M = 128, 128, 64, 3, 8, 8


@triton.jit
def _swiglu_gemm_kernel(
    x_desc, w_desc, h_desc, M, N, K, num_programs,
    BM: tl.constexpr, HALF: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, OUT: tl.constexpr,
):  # fmt: skip
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, HALF)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, num_programs, flatten=True):
        off_m, off_n = tile_origin(tile, tiles_m, tiles_n, BM, HALF, GROUP)
        sums = tl.zeros((BM, 2 * HALF), tl.float32)
        for k in range(tl.cdiv(K, BK)):
            w = w_desc.load([0, off_n, k * BK]).reshape(2 * HALF, BK)  # HALF gate rows, then their up rows
            sums = tl.dot(x_desc.load([off_m, k * BK]), w.T, sums)
        gate, up = sums.reshape(BM, 2, HALF).permute(0, 2, 1).split()
        h_desc.store([off_m, off_n], (gate / (1.0 + tl.exp(-gate)) * up).to(OUT))


def can_run(weight: torch.Tensor) -> bool:
    """Whether the kernel takes this (gate, up) weight [2I, K]: bf16/fp16 on a Hopper GPU, contiguous, rows
    the tensor copy engine can address (16-byte strides)."""
    return takes(weight) and weight.shape[0] % 16 == 0  # gate and up rows of 16-byte strides in h


def swiglu_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h [M, I] = silu(x . w_gate) * (x . w_up) of rows x [M, K] and a (gate, up) weight [2I, K] (gate rows
    first), in the weight's dtype."""
    x = x.contiguous()
    m, k = x.shape
    width = weight.shape[0] // 2
    h = torch.empty(m, width, device=x.device, dtype=weight.dtype)
    if m == 0:
        return h
    launch(
        _swiglu_gemm_kernel, x.device, triton.cdiv(m, BLOCK_M) * triton.cdiv(width, HALF_N),
        TensorDescriptor.from_tensor(x, [BLOCK_M, BLOCK_K]),
        TensorDescriptor.from_tensor(weight.view(2, width, k), [2, HALF_N, BLOCK_K]),
        TensorDescriptor.from_tensor(h, [BLOCK_M, HALF_N]),
        m, width, k,
        BM=BLOCK_M, HALF=HALF_N, BK=BLOCK_K, GROUP=GROUP_M, OUT=OUT_TYPES[weight.dtype],
        num_warps=WARPS, num_stages=STAGES,
    )  # fmt: skip
    return h
