"""HuBERT's Linears in split precision: would the codes stay equal, and how fast would the encode be?

The codec's encode spends 31% of its device time in HuBERT's float32 GEMMs, which run on the CUDA cores
(codec-h200.json's encode profile). On tensor cores they would take a few lower-precision products instead:
each operand is split into parts (x = xh + xl + ...), and the products kept are summed in float32 by one GEMM
over the parts laid side by side along K ([xh | xl | xh] . [wh | wh | wl]).
- tf32x1: operands rounded to TF32 (10 mantissa bits, nearest even), one product (what allow_tf32 does);
- tf32x3: a TF32 part and a TF32 remainder each, three products;
- bf16x3: the same with bfloat16 parts (8 bits);
- bf16x6: three bfloat16 parts, the six products above 2^-24;
- float64: the product in float64, rounded once to float32: no tensor cores, the size of a float32 GEMM's own
  summation-order noise, against which the others are to be read.
On the CPU the parts' products are formed in float32, where they are exact, as tensor cores form them. On
CUDA the GEMMs run for real (TF32 with allow_tf32 around HuBERT's calls only; bfloat16 with a float32
output), and the encode is timed at B = 16 (10 s clips, the Snake kernel on, as the engine runs it).

Over real speech (tests/data's clips at three offsets each, 3 s cuts) and the full-size codec with random
weights at bench/codec_parity's gains: the share of equal codes (all codebooks, and the first), clips with
every code equal, and the HuBERT features' relative error, each against float32 on the same device.

    python bench/hubert_split.py [--device cpu|cuda] [--out bench/results/hubert-split-<cpu|h200>.json]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.codec import median_seconds  # noqa: E402
from bench.codec_parity import WEIGHT_GAIN  # noqa: E402
from bench.environment import environment, write_result  # noqa: E402
from engine.codec.checkpoint import OMNIVOICE_CODEC_CONFIG  # noqa: E402
from engine.codec.config import CodecConfig  # noqa: E402
from engine.codec.model import Codec  # noqa: E402
from engine.codec.semantic import semantic_features  # noqa: E402
from engine.frontend.audio import decode, resample  # noqa: E402

RATE, HOP, CUT_SECONDS, OFFSETS = 24000, 960, 3.0, (0, 7001, 15013)
TIMED_CLIPS, TIMED_SECONDS = 16, 10.0


def tf32(x: torch.Tensor) -> torch.Tensor:
    """x rounded to TF32 (nearest, ties to even), kept in float32."""
    bits = x.contiguous().view(torch.int32)
    bits = (bits + 0xFFF + ((bits >> 13) & 1)) & ~0x1FFF
    return bits.view(torch.float32)


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def split(x: torch.Tensor, part, parts: int) -> list[torch.Tensor]:
    """x as `parts` terms of `part`'s precision (float32 tensors), largest first."""
    terms = []
    for _ in range(parts):
        terms.append(part(x - sum(terms)) if terms else part(x))
    return terms


@dataclass(frozen=True)
class Split:
    """A split-precision product: operand parts of `part`'s precision, the (x part, weight part) products
    kept, and whether the GEMM runs on bfloat16 (else float32 inputs, TF32 on CUDA)."""

    part: object
    parts: int
    products: tuple[tuple[int, int], ...]
    bfloat16: bool

    def linear(self, layer: nn.Linear):
        """layer's forward in this precision; the weight is split once, here."""
        w = split(layer.weight.detach().float(), self.part, self.parts)
        w_side = torch.cat([w[j] for _, j in self.products], dim=1)  # [N, K * products]
        if self.bfloat16:
            w_side = w_side.to(torch.bfloat16)
        bias = layer.bias

        def forward(x: torch.Tensor) -> torch.Tensor:
            xs = split(x.float(), self.part, self.parts)
            x_side = torch.cat([xs[i] for i, _ in self.products], dim=-1).reshape(-1, w_side.shape[1])
            if not x.is_cuda:  # exact products, float32 sums
                y = x_side @ w_side.float().t()
            elif self.bfloat16:
                y = torch.mm(x_side.to(torch.bfloat16), w_side.t(), out_dtype=torch.float32)
            else:
                y = tf32_mm(x_side, w_side.t())
            y = y if bias is None else y + bias
            return y.view(*x.shape[:-1], -1)

        return forward


def tf32_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b on TF32 tensor cores, the process-wide flag set for this call only (the bench's one thread)."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        return a @ b
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def float64_linear(layer: nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        bias = None if layer.bias is None else layer.bias.double()
        return F.linear(x.double(), layer.weight.double(), bias).float()

    return forward


VARIANTS = {
    "tf32x1": Split(tf32, 1, ((0, 0),), bfloat16=False).linear,
    "tf32x3": Split(tf32, 2, ((1, 0), (0, 1), (0, 0)), bfloat16=False).linear,
    "bf16x3": Split(bf16, 2, ((1, 0), (0, 1), (0, 0)), bfloat16=True).linear,
    "bf16x6": Split(bf16, 3, ((2, 0), (0, 2), (1, 1), (1, 0), (0, 1), (0, 0)), bfloat16=True).linear,
    "float64": float64_linear,
}
TIMED = ("tf32x1", "tf32x3", "bf16x3", "bf16x6")  # on CUDA; float64 is the noise reference only


def random_codec(seed: int, device: str) -> Codec:
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
    codec = codec.to(device)
    codec.use_fused_kernels(device.startswith("cuda"))  # as the engine runs it
    return codec


def speech_clips(device: str) -> list[torch.Tensor]:
    clips = []
    for path in sorted((ROOT / "tests" / "data").glob("en_*")):
        audio, rate = decode(path.read_bytes(), path.name)
        audio = resample(audio, rate, RATE)
        for offset in OFFSETS:
            cut = audio[offset : offset + int(CUT_SECONDS * RATE)]
            cut = np.ascontiguousarray(cut[: len(cut) - len(cut) % HOP])
            clips.append(torch.from_numpy(cut).to(device))
    return clips


class HubertLinears:
    """While active, HuBERT's nn.Linear layers compute with make(layer) (x -> y) instead."""

    def __init__(self, codec: Codec, make):
        self.layers = [m for m in codec.semantic_model.modules() if isinstance(m, nn.Linear)]
        self.forwards = [make(layer) for layer in self.layers]

    def __enter__(self):
        for layer, forward in zip(self.layers, self.forwards):
            layer.forward = forward

    def __exit__(self, *exc):
        for layer in self.layers:
            del layer.forward


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def agreement(codes, features, got_codes, got_features) -> dict:
    equal = torch.cat([(a == b).flatten() for a, b in zip(got_codes, codes)])
    first = torch.cat([a[0] == b[0] for a, b in zip(got_codes, codes)])
    error = statistics.fmean(map(relative_error, got_features, features))
    return {
        "codes_equal_share": round(equal.float().mean().item(), 6),
        "first_codebook_equal_share": round(first.float().mean().item(), 6),
        "clips_all_equal": sum(torch.equal(a, b) for a, b in zip(got_codes, codes)),
        "features_relative_error": float(f"{error:.3g}"),
    }


def encode_rate(codec: Codec, clips: list[torch.Tensor], device: str) -> float:
    """Audio seconds encoded per second (median of 5)."""
    seconds = median_seconds(lambda: codec.encode(clips), device, repeats=5)
    return round(sum(len(c) for c in clips) / RATE / seconds, 1)


@torch.inference_mode()
def run(seed: int, device: str) -> dict:
    codec, clips = random_codec(seed, device), speech_clips(device)
    codes = codec.encode(clips)
    features = semantic_features(codec.semantic_model, clips, codec.config)
    timed = []
    if device.startswith("cuda"):
        g = torch.Generator().manual_seed(seed)
        samples = int(TIMED_SECONDS * RATE)
        timed = [(torch.randn(samples, generator=g) * 0.1).to(device) for _ in range(TIMED_CLIPS)]
    result = {
        "bench": "hubert_split",
        "environment": environment(),
        "device": device if timed else "cpu (products formed in float32)",
        "clips": len(clips),
        "audio_seconds": round(sum(len(c) for c in clips) / RATE, 2),
        "codes": sum(c.numel() for c in codes),
        "variants": {},
    }
    if timed:
        result["encode_float32_audio_s_per_s"] = encode_rate(codec, timed, device)
    for name, make in VARIANTS.items():
        with HubertLinears(codec, make):
            got_codes = codec.encode(clips)
            got_features = semantic_features(codec.semantic_model, clips, codec.config)
            entry = agreement(codes, features, got_codes, got_features)
            if timed and name in TIMED:
                entry["encode_audio_s_per_s"] = encode_rate(codec, timed, device)
                entry["encode_speedup"] = round(
                    entry["encode_audio_s_per_s"] / result["encode_float32_audio_s_per_s"], 3
                )
        result["variants"][name] = entry
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="default: bench/results/hubert-split-cpu.json, or -h200.json on CUDA")
    args = p.parse_args()
    out = args.out or f"bench/results/hubert-split-{'h200' if args.device.startswith('cuda') else 'cpu'}.json"
    report = run(args.seed, args.device)
    print(report)
    write_result(out, report)


if __name__ == "__main__":
    main()
