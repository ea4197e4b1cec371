"""Lower bounds on a W4A4 linear's time from the H200's ceilings: the bytes each kernel must move, the
GEMM's tensor-core operations, and the instructions the kernels' loops issue. bench/kernels.py records the
first two beside its measurements; bench/tables.py sets the floors against the 1.5x-over-bf16 target
(docs/kernels.md, Floors).
"""

from __future__ import annotations

# Device-to-device copy (read + write) and cuBLAS bf16 at 8192^3 measured on an H200 (../shared/anchors);
# dense INT8 wgmma, FP8's rate too, from NVIDIA's H100/H200 SXM datasheet (the anchors measured mma.sync s8
# at 1279.5 TOPS and cuBLAS fp8 at up to 1155).
HBM_BYTES_PER_S = 4.3e12
WGMMA_S8_OPS_PER_S = 1979e12
BF16_FLOPS_PER_S = 790e12

RANK = 32  # the low-rank width bench/kernels.py measures at

# Instruction issue: 4 warp instructions a cycle on each of 132 SMs, at the H200's top SM clock (1980 MHz).
WARP_INSTRUCTIONS_PER_S = 4 * 132 * 1.98e9
# Warp instructions per 64-wide K group: the GEMM's loop on 256-row tiles, its fewest per output (static SASS;
# 4 warps per tile of 64 weight rows), and the quantize kernel's loop (a warp's 16 rows; ncu at o, M = 8192,
# rank 32 with smoothing). Recount them when a kernel's loop changes (docs/kernels.md, Floors).
GEMM_LOOP_INSTRUCTIONS = 255
QUANTIZE_LOOP_INSTRUCTIONS = 463


def activation_bytes(m: int, k: int) -> int:
    """What the quantize kernel hands the GEMM: int8 activation tiles (4-bit values in 8-bit containers),
    scales, low-rank activations. Scales count 4 bytes a group, as in the committed results' w4a4_floor_us;
    the kernel writes 2 (fp16 ratios) and 4 a row (the row's largest), so these floors carry up to ~1% more
    bytes than the exact count (docs/kernels.md's conclusions hold with either)."""
    return m * k + m * (k // 64) * 4 + m * RANK * 4


def quantize_bytes(m: int, k: int) -> int:
    """x in, the activations out."""
    return m * k * 2 + activation_bytes(m, k)


def gemm_bytes(m: int, n: int, k: int) -> int:
    """The activations in, packed weights + scales + proj_up, y out."""
    return activation_bytes(m, k) + n * k // 2 + n * (k // 64) * 8 + n * RANK * 4 + m * n * 2


def linear_bytes(m: int, n: int, k: int) -> int:
    """Both kernels' bytes: the whole W4A4 linear's fewest."""
    return quantize_bytes(m, k) + gemm_bytes(m, n, k)


def gemm_floor_us(m: int, n: int, k: int) -> float:
    return 1e6 * max(2.0 * m * n * k / WGMMA_S8_OPS_PER_S, gemm_bytes(m, n, k) / HBM_BYTES_PER_S)


def quantize_floor_us(m: int, k: int) -> float:
    return 1e6 * quantize_bytes(m, k) / HBM_BYTES_PER_S


def overlapped_floor_us(m: int, n: int, k: int) -> float:
    """Both kernels' bytes and the GEMM's operations, all overlapped: the floor of any design that keeps
    the int8 activation tiles."""
    return 1e6 * max(2.0 * m * n * k / WGMMA_S8_OPS_PER_S, linear_bytes(m, n, k) / HBM_BYTES_PER_S)


def gemm_issue_floor_us(m: int, n: int, k: int) -> float:
    """The GEMM's K-group loop alone, every instruction issued back to back: no fixed work, no stall."""
    warp_groups = (m / 256) * (n / 64) * 4 * (k / 64)
    return 1e6 * warp_groups * GEMM_LOOP_INSTRUCTIONS / WARP_INSTRUCTIONS_PER_S


def quantize_issue_floor_us(m: int, k: int) -> float:
    """The quantize kernel's group loop alone, likewise: the arithmetic that moves with the quantization if
    another kernel's epilogue takes it over."""
    return 1e6 * (m / 16) * (k / 64) * QUANTIZE_LOOP_INSTRUCTIONS / WARP_INSTRUCTIONS_PER_S
