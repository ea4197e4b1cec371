"""HuBERT's Linears in split precision, emulated on the CPU: would the codes stay equal?

The codec's encode spends 31% of its device time in HuBERT's float32 GEMMs, which run on the CUDA cores
(codec-h200.json's encode profile): tensor cores would take them in a few lower-precision products instead.
This bench emulates, on the CPU, each candidate's rounding of the GEMM operands (the products of the rounded
parts are exact in float32, as the tensor cores accumulate them) and compares against float32:
- tf32x1: operands rounded to TF32 (10 mantissa bits), one product (what allow_tf32 would do);
- tf32x3: each operand split into a TF32 part and a TF32 remainder, three products (small ones first);
- bf16x3: the same with bfloat16 parts (8 bits);
- bf16x6: three bfloat16 parts, the six products above 2^-24;
- float64: the product in float64, rounded once to float32: no tensor cores, the size of a float32
  GEMM's own summation-order noise, against which the others are to be read.
Over real speech (tests/data's clips at three offsets each, 3 s cuts) and the full-size codec with random
weights at bench/codec_parity's gains: the share of equal codes (all codebooks, and the first), clips with
every code equal, and the HuBERT features' relative error against float32. Speed is for the GPU to tell.

    python bench/hubert_split.py [--out bench/results/hubert-split-cpu.json]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.codec_parity import WEIGHT_GAIN  # noqa: E402
from bench.environment import environment, write_result  # noqa: E402
from engine.codec.checkpoint import OMNIVOICE_CODEC_CONFIG  # noqa: E402
from engine.codec.config import CodecConfig  # noqa: E402
from engine.codec.model import Codec  # noqa: E402
from engine.codec.semantic import semantic_features  # noqa: E402
from engine.frontend.audio import decode, resample  # noqa: E402

RATE, HOP, CUT_SECONDS, OFFSETS = 24000, 960, 3.0, (0, 7001, 15013)


def tf32(x: torch.Tensor) -> torch.Tensor:
    """x rounded to TF32 (nearest, ties to even), kept in float32."""
    bits = x.contiguous().view(torch.int32)
    bits = (bits + 0xFFF + ((bits >> 13) & 1)) & ~0x1FFF
    return bits.view(torch.float32)


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def split(x: torch.Tensor, part, parts: int) -> list[torch.Tensor]:
    """x as `parts` terms of `part`'s precision, largest first."""
    terms = []
    for _ in range(parts):
        terms.append(part(x - sum(terms)) if terms else part(x))
    return terms


def split_linear(part, parts: int, products: list[tuple[int, int]]):
    """F.linear over the (x term, weight term) products, smallest first, the bias with the largest."""

    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        xs, ws = split(x, part, parts), split(w, part, parts)
        *small, (i, j) = products
        y = None
        for a, c in small:
            y = F.linear(xs[a], ws[c]) if y is None else y + F.linear(xs[a], ws[c])
        top = F.linear(xs[i], ws[j], b)
        return top if y is None else y + top

    return linear


def float64_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double()).float()


VARIANTS = {
    "tf32x1": split_linear(tf32, 1, [(0, 0)]),
    "tf32x3": split_linear(tf32, 2, [(1, 0), (0, 1), (0, 0)]),
    "bf16x3": split_linear(bf16, 2, [(1, 0), (0, 1), (0, 0)]),
    "bf16x6": split_linear(bf16, 3, [(2, 0), (0, 2), (1, 1), (1, 0), (0, 1), (0, 0)]),
    "float64": float64_linear,
}


def random_codec(seed: int) -> Codec:
    """The full-size codec with bench/codec_parity's random weights (gain WEIGHT_GAIN over fan-in; codebooks
    at the first quantizer's input scale)."""
    torch.manual_seed(seed)
    codec = Codec(CodecConfig.from_dict(OMNIVOICE_CODEC_CONFIG)).eval()
    with torch.no_grad():
        for p in codec.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, WEIGHT_GAIN / math.sqrt(p[0].numel()))
        scale = []
        hook = codec.quantizer.quantizers[0].project_in.register_forward_hook(
            lambda _m, _i, out: scale.append(out.std().item())
        )
        codec.encode([torch.randn(RATE) * 0.1])
        hook.remove()
        for quantizer in codec.quantizer.quantizers:
            quantizer.codebook.embed.normal_(0.0, scale[0])
    return codec


def speech_clips() -> list[torch.Tensor]:
    clips = []
    for path in sorted((ROOT / "tests" / "data").glob("en_*")):
        audio, rate = decode(path.read_bytes(), path.name)
        audio = resample(audio, rate, RATE)
        for offset in OFFSETS:
            cut = audio[offset : offset + int(CUT_SECONDS * RATE)]
            clips.append(torch.from_numpy(np.ascontiguousarray(cut[: len(cut) - len(cut) % HOP])))
    return clips


class HubertLinears:
    """While active, HuBERT's nn.Linear layers compute with `linear` (x, weight, bias) instead."""

    def __init__(self, codec: Codec, linear):
        self.layers = [m for m in codec.semantic_model.modules() if isinstance(m, nn.Linear)]
        self.linear = linear

    def __enter__(self):
        for layer in self.layers:
            layer.forward = lambda x, layer=layer: self.linear(x, layer.weight, layer.bias)

    def __exit__(self, *exc):
        for layer in self.layers:
            del layer.forward


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@torch.inference_mode()
def run(seed: int) -> dict:
    codec, clips = random_codec(seed), speech_clips()
    codes = codec.encode(clips)
    features = semantic_features(codec.semantic_model, clips, codec.config)
    variants = {}
    for name, linear in VARIANTS.items():
        with HubertLinears(codec, linear):
            got = codec.encode(clips)
            got_features = semantic_features(codec.semantic_model, clips, codec.config)
        equal = torch.cat([(a == b).flatten() for a, b in zip(got, codes)])
        first = torch.cat([a[0] == b[0] for a, b in zip(got, codes)])
        variants[name] = {
            "codes_equal_share": round(equal.float().mean().item(), 6),
            "first_codebook_equal_share": round(first.float().mean().item(), 6),
            "clips_all_equal": sum(torch.equal(a, b) for a, b in zip(got, codes)),
            "features_relative_error": float(
                f"{statistics.fmean(map(relative_error, got_features, features)):.3g}"
            ),
        }
    return {
        "bench": "hubert_split",
        "environment": environment(),
        "device": "cpu (emulated rounding)",
        "clips": len(clips),
        "audio_seconds": round(sum(len(c) for c in clips) / RATE, 2),
        "codes": sum(c.numel() for c in codes),
        "variants": variants,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/hubert-split-cpu.json")
    args = p.parse_args()
    report = run(args.seed)
    print(report)
    write_result(args.out, report)


if __name__ == "__main__":
    main()
