"""What a wider quantization group would cost in accuracy: W4A4 output error at group sizes 64 (the
numerics contract) and 128 (half the GEMM's per-group folds, docs/kernels.md "Floors"), on the CPU.

Layers with LLM-like statistics (engine/quantizer/synthetic.py: low-rank plus heavy-tailed weights, inputs
with outlier channels) at OmniVoice's shapes, each quantized the same way at both sizes: smoothing (strength
screened on calibration rows, or none), a rank-r SVD branch, round-to-nearest residual (GPTQ is left out:
it would refine both alike). The error is ||Y_w4a4 - Y|| / ||Y|| on held-out rows, with the activations
quantized per token and group of the given size, as the contract's reference does for 64.

    python bench/group_size.py [--out bench/results/group-size-cpu.json] [--rank 32] [--rows 512]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.environment import environment, write_result  # noqa: E402
from engine.quantizer.lowrank import lowrank_factors  # noqa: E402
from engine.quantizer.smooth import smoothing_factors  # noqa: E402
from engine.quantizer.synthetic import (  # noqa: E402
    outlier_channel_scales,
    structured_activations,
    structured_weight,
)
from engine.w4a4.format import quantize_to_grid, weight_group_scales  # noqa: E402
from engine.w4a4.reference import grouped_int_matmul, quantize_activations  # noqa: E402

LAYERS = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
GROUPS = (64, 128)
ALPHAS = (None, 0.25, 0.5, 0.75)


def quantize(w, smooth, rank: int, group: int):
    """w [N, K] smoothed, its rank-r SVD branch (up, down) and the int4 residual (q, scales per group)."""
    ws = w * smooth if smooth is not None else w
    up, down = (f.float() for f in lowrank_factors(ws, rank))
    residual = ws - up @ down.T
    scales = weight_group_scales(residual, group)
    q = quantize_to_grid(residual, scales.repeat_interleave(group, dim=1))
    return q, scales, up, down


def quantized_forward(w, smooth, rank: int, group: int):
    """The W4A4 forward of w [N, K] at this group size, as a function of x [M, K]."""
    q, scales, up, down = quantize(w, smooth, rank, group)

    def forward(x):
        xs = x / smooth if smooth is not None else x
        qx, ascale = quantize_activations(xs, group)
        return grouped_int_matmul(qx, ascale, q, scales, group) + (xs @ down) @ up.T

    return forward


def relative_error(forward, x, w) -> float:
    y = x @ w.T
    return float((forward(x) - y).norm() / y.norm())


def layer_row(name: str, n: int, k: int, rank: int, rows: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = structured_weight(n, k, g)
    channels = outlier_channel_scales(k, g)
    calib, held_out = (structured_activations(rows, channels, g) for _ in range(2))
    row = {"layer": name, "N": n, "K": k}
    for group in GROUPS:
        best = None
        for alpha in ALPHAS:
            smooth = smoothing_factors(calib.abs().amax(0), w, alpha) if alpha is not None else None
            forward = quantized_forward(w, smooth, rank, group)
            err = relative_error(forward, calib, w)
            if best is None or err < best[0]:
                best = (err, alpha, forward)
        row[f"g{group}_alpha"] = best[1]
        row[f"g{group}_error"] = round(relative_error(best[2], held_out, w), 5)
    row["error_ratio_g128_vs_g64"] = round(row["g128_error"] / row["g64_error"], 3)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/group-size-cpu.json"))
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--rows", type=int, default=512, help="calibration rows, and as many held-out rows")
    args = parser.parse_args()
    rows = []
    for seed, (name, (n, k)) in enumerate(LAYERS.items()):
        rows.append(layer_row(name, n, k, args.rank, args.rows, seed))
        print(json.dumps(rows[-1]), flush=True)
    result = {
        "environment": environment(),
        "method": f"smoothing screened over {ALPHAS} + rank-{args.rank} SVD + round-to-nearest; "
        f"{args.rows} calibration and {args.rows} held-out rows; synthetic LLM-like layers",
        "rows": rows,
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
