"""Parity of our codec (engine/codec) with transformers' HiggsAudioV2TokenizerModel on the same weights.

transformers' model is built at the real size (OmniVoice's audio_tokenizer config: 24 kHz, hop 960,
8 codebooks of 1024 x 64, HuBERT-base) with random weights drawn so that activations stay moderate
through the layers, the codebooks cover the latents (with transformers' own init all codes would be 0)
and the decoded audio peaks near 0.5. It is saved with save_pretrained, and our Codec loads that folder
by the official names. Clips: white noise and log sine sweeps, lengths on and off the 960-sample hop.
Reported per clip: the share of equal codes (ours vs transformers, one clip at a time and in one padded
batch of all clips) and the largest absolute difference of the decoded audio (both decode transformers'
codes), next to the reference peak. fp32 throughout, TF32 off. Needs torchaudio (transformers' model
imports it).

    python bench/codec_parity.py [--out bench/results/codec-parity-<gpu>.json] [--size full|tiny]
                                 [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.environment import environment, results_path, write_result  # noqa: E402
from engine.codec import Codec  # noqa: E402
from engine.codec.checkpoint import OMNIVOICE_CODEC_CONFIG  # noqa: E402
from engine.tiny.codec import TINY_CODEC_CONFIG  # noqa: E402

SAMPLE_RATE = 24000
CLIP_SECONDS = (1.0, 3.04, 7.5, 10.0)
# Weights ~ N(0, (WEIGHT_GAIN / sqrt(fan_in))^2): keeps the snake activations' inputs around 0.3 at both
# sizes. A gain of 1 lets the DAC stacks grow them to ~1e4, where sin(alpha * x) turns float rounding
# into visible differences (a chaotic network, not an implementation difference).
WEIGHT_GAIN = 0.5  # 3.04 s = 76 frames; 7.5 s is off the hop (transformers pads it)


def random_reference(size: str, seed: int, device: str):
    """transformers' model with random weights that keep activations moderate; returns (model, saved dir)."""
    from transformers import HiggsAudioV2TokenizerConfig, HiggsAudioV2TokenizerModel

    cfg = HiggsAudioV2TokenizerConfig.from_dict(
        OMNIVOICE_CODEC_CONFIG if size == "full" else TINY_CODEC_CONFIG
    )
    torch.manual_seed(seed)
    model = HiggsAudioV2TokenizerModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "parametrizations" not in name:
                p.normal_(0.0, WEIGHT_GAIN / math.sqrt(p[0].numel()))
        latent_std = []
        hook = model.quantizer.quantizers[0].project_in.register_forward_hook(
            lambda _m, _i, out: latent_std.append(out.std().item())
        )
        model.encode(torch.randn(1, 1, SAMPLE_RATE) * 0.1, return_dict=False)
        hook.remove()
        for quantizer in model.quantizer.quantizers:
            quantizer.codebook.embed.normal_(0.0, latent_std[0])
        # audio-like output scale (peak about 0.5), so that 1e-4 is a meaningful tolerance
        codes = model.encode(torch.randn(1, 1, SAMPLE_RATE) * 0.1, return_dict=False)
        peak = model.decode(codes, return_dict=False).abs().max().item()
        model.acoustic_decoder.conv2.weight.mul_(0.5 / peak)
        model.acoustic_decoder.conv2.bias.mul_(0.5 / peak)
    folder = Path(tempfile.mkdtemp(prefix="codec-parity-"))
    model.save_pretrained(folder)
    return model.to(device), folder


def parity_clips(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    clips = {}
    for seconds in CLIP_SECONDS:
        n = int(seconds * SAMPLE_RATE)
        t = torch.arange(n, dtype=torch.float64) / SAMPLE_RATE
        clips[f"noise-{seconds:g}s"] = (torch.randn(n, generator=g) * 0.1).float()
        # log sweep 50 Hz -> 8 kHz over the clip
        f0, f1 = 50.0, 8000.0
        k = math.log(f1 / f0) / seconds
        clips[f"sweep-{seconds:g}s"] = (
            0.5 * torch.sin(2 * math.pi * f0 * (torch.exp(k * t) - 1) / k)
        ).float()
    return clips


def run_parity(size: str, device: str, seed: int) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    reference, folder = random_reference(size, seed, device)
    codec = Codec.from_dir(folder, device=device)
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        checkpoint_tensors = len(list(f.keys()))
    clips = {name: wav.to(device) for name, wav in parity_clips(seed).items()}
    batched = dict(zip(clips, codec.encode(list(clips.values()))))
    per_clip = {}
    for name, wav in clips.items():
        with torch.no_grad():
            want = reference.encode(wav[None, None], return_dict=False)[0]
            want_audio = reference.decode(want[None], return_dict=False)[0, 0]
        got = codec.encode([wav])[0]
        got_audio = codec.decode([want])[0]
        per_clip[name] = {
            "samples": wav.numel(),
            "frames": want.shape[1],
            "codes_mismatched": int((got != want).sum()),
            "codes_mismatched_batched": int((batched[name] != want).sum()),
            "codes_total": want.numel(),
            "distinct_codes_first_codebook": int(want[0].unique().numel()),
            "decode_max_abs_diff": (got_audio - want_audio).abs().max().item(),
            "reference_peak": want_audio.abs().max().item(),
        }
    batch_audio = codec.decode([batched[name] for name in clips])
    batch_decode_diff = max(
        (audio - codec.decode([batched[name]])[0]).abs().max().item()
        for name, audio in zip(clips, batch_audio)
    )
    return {
        "size": size,
        "device": device,
        "dtype": "float32",
        "tf32": False,
        "checkpoint_tensors": checkpoint_tensors,
        "clips": per_clip,
        "all_codes_equal": all(c["codes_mismatched"] == 0 for c in per_clip.values()),
        "all_batched_codes_equal": all(c["codes_mismatched_batched"] == 0 for c in per_clip.values()),
        "worst_decode_max_abs_diff": max(c["decode_max_abs_diff"] for c in per_clip.values()),
        "batched_vs_single_decode_max_abs_diff": batch_decode_diff,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=results_path("codec-parity"))
    parser.add_argument("--size", choices=["full", "tiny"], default="full")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    result = {
        "environment": environment("transformers", "torchaudio"),
        **run_parity(args.size, args.device, args.seed),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "clips"}, indent=2))
    write_result(Path(args.out), result)


if __name__ == "__main__":
    main()
