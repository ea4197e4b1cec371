"""qk_norm_rope on OmniVoice's q and k (16 + 8 heads of 128, views into the q/k/v output), for a profiler to
look at (bench/fused.py times it).

    ncu --kernel-name regex:qk_norm --launch-skip 2 --launch-count 1 \
        python bench/qk_norm_rope_once.py --m 32768
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.kernels import ops as kops  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--m", type=int, default=32768)
    parser.add_argument("--calls", type=int, default=4)
    args = parser.parse_args()
    m, bf16 = args.m, {"device": "cuda", "dtype": torch.bfloat16}
    qkv = torch.randn(m, 4096, **bf16)
    q, k = qkv[:, :2048].view(m, 16, 128), qkv[:, 2048:3072].view(m, 8, 128)
    weight = torch.rand(128, **bf16) + 0.5
    cos, sin = torch.rand(m, 128, **bf16), torch.rand(m, 128, **bf16)
    ops = kops.load()
    for _ in range(args.calls):
        ops.qk_norm_rope(q, k, weight, weight, cos, sin, 1e-6)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
