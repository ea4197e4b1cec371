"""The merged bf16/fp16 q/k/v projection with the q and k heads' RMSNorm and RoPE in its epilogue, in one
Triton GEMM (Hopper): a tile of 256 output columns holds whole heads (head_dim 64 or 128), so the epilogue
normalizes each q or k head by its own RMS, scales it by q_norm's or k_norm's weight and rotates it
(rotate-half, by the row's position) before the one store; v tiles are stored as summed. cuBLAS wrote q/k/v
and the qk_norm_rope kernel read q and k back and wrote them again. Persistent blocks
(engine/kernels/persistent.py), operands and output through the tensor copy engine.

Everything in float32 from the sums, rounded once (the replaced path rounds the GEMM's output, then the
normed heads): tests/test_qkv_rope_gemm.py holds both to a float64 reference.

Imported only where Triton runs (engine/model/linear.py decides).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from engine.kernels.persistent import OUT_TYPES, launch, takes, tile_origin

# The fastest tile on an H100 at OmniVoice's shapes (docs/kernels.md, tried and not kept).
BLOCK_M, BLOCK_N, BLOCK_K, STAGES, WARPS, GROUP_M = 128, 256, 64, 3, 8, 8
HEAD_DIMS = (64, 128)


@triton.jit
def _qkv_rope_gemm_kernel(
    x_desc, w_desc, out_desc, q_weight, k_weight, cos, sin, M, N, K, q_end, k_end, eps, num_programs,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr,
    OUT: tl.constexpr,
):  # fmt: skip
    heads_per_tile: tl.constexpr = BN // D
    half: tl.constexpr = D // 2
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, num_programs, flatten=True):
        off_m, off_n = tile_origin(tile, tiles_m, tiles_n, BM, BN, GROUP)
        sums = tl.zeros((BM, BN), tl.float32)
        for k in range(tl.cdiv(K, BK)):
            sums = tl.dot(x_desc.load([off_m, k * BK]), w_desc.load([off_n, k * BK]).T, sums)
        if off_n < k_end:  # q or k heads: RMSNorm, then RoPE
            if off_n < q_end:
                weight = tl.load(q_weight + tl.arange(0, D)).to(tl.float32)
            else:
                weight = tl.load(k_weight + tl.arange(0, D)).to(tl.float32)
            heads = sums.reshape(BM, heads_per_tile, D)
            rstd = tl.rsqrt(tl.sum(heads * heads, axis=2) / D + eps)
            heads = heads * rstd[:, :, None] * weight[None, None, :]
            x1, x2 = heads.reshape(BM, heads_per_tile, 2, half).permute(0, 1, 3, 2).split()
            rows = off_m + tl.arange(0, BM)
            table = rows[:, None] * D + tl.arange(0, half)[None, :]  # the tables' halves are equal
            c = tl.load(cos + table, mask=rows[:, None] < M, other=0.0).to(tl.float32)[:, None, :]
            s = tl.load(sin + table, mask=rows[:, None] < M, other=0.0).to(tl.float32)[:, None, :]
            rotated = tl.join(x1 * c - x2 * s, x2 * c + x1 * s).permute(0, 1, 3, 2).reshape(BM, BN)
            out_desc.store([off_m, off_n], rotated.to(OUT))
        else:
            out_desc.store([off_m, off_n], sums.to(OUT))


def can_run(weight: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel takes this merged q/k/v weight [(q_heads + 2 kv_heads) * head_dim, K]: bf16/fp16 on
    a Hopper GPU, and q, k and v each whole tiles of whole heads."""
    return (
        takes(weight)
        and head_dim in HEAD_DIMS
        and weight.shape[0] == (q_heads + 2 * kv_heads) * head_dim
        and (q_heads * head_dim) % BLOCK_N == 0
        and (kv_heads * head_dim) % BLOCK_N == 0
    )


def qkv_rope_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    q_heads: int,
    kv_heads: int,
) -> torch.Tensor:
    """[M, (q_heads + 2 kv_heads) * D]: rope(q_norm(q)), rope(k_norm(k)) and v of rows x [M, K] by the merged
    weight, side by side (cos, sin [M, D]: the rotate-half tables, halves repeated)."""
    x = x.contiguous()
    m, k = x.shape
    n, d = weight.shape[0], cos.shape[-1]
    out = torch.empty(m, n, device=x.device, dtype=weight.dtype)
    if m == 0:
        return out
    launch(
        _qkv_rope_gemm_kernel, x.device, triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N),
        TensorDescriptor.from_tensor(x, [BLOCK_M, BLOCK_K]),
        TensorDescriptor.from_tensor(weight, [BLOCK_N, BLOCK_K]),
        TensorDescriptor.from_tensor(out, [BLOCK_M, BLOCK_N]),
        q_weight, k_weight, cos.contiguous(), sin.contiguous(), m, n, k,
        q_heads * d, (q_heads + kv_heads) * d, eps,
        BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, D=d, GROUP=GROUP_M, OUT=OUT_TYPES[weight.dtype],
        num_warps=WARPS, num_stages=STAGES,
    )  # fmt: skip
    return out
