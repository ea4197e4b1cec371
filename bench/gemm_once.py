"""One W4A4 linear at one OmniVoice shape, for a profiler to look at (bench/kernels.py times them all).

    ncu --kernel-name regex:gemm --launch-skip 2 --launch-count 1 \
        python bench/gemm_once.py --m 8192 --layer qkv
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernels import LAYERS, random_layer  # noqa: E402
from engine.kernels import CudaW4A4Backend  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--m", type=int, default=8192)
    parser.add_argument("--layer", choices=list(LAYERS), default="qkv")
    parser.add_argument("--calls", type=int, default=4)
    args = parser.parse_args()
    n, k = LAYERS[args.layer]
    g = torch.Generator(device="cuda").manual_seed(0)
    backend = CudaW4A4Backend()
    packed = backend.prepare(random_layer(n, k, g))
    x = torch.randn(args.m, k, generator=g, device="cuda").to(torch.bfloat16)
    for _ in range(args.calls):
        backend.forward(x, packed)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
