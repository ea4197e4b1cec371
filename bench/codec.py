"""Codec throughput: encode and decode, audio seconds per second, at batch 1 and 16, real size.

The codec has OmniVoice's audio_tokenizer architecture (24 kHz, hop 960, 8 codebooks of 1024 x 64,
HuBERT-base) with random weights (bench/codec_parity.py draws them). Rows: our Codec in float32 and
bfloat16, ours in float32 with the Snake kernel (csrc/snake.cu; CUDA only, with its agreement with torch's
ops), and transformers' HiggsAudioV2TokenizerModel in float32 in the same run where torchaudio is
installed (it needs it). Batches hold clips of equal length (transformers' model cannot cut a padded
batch per item); one more row times ours on 16 clips of mixed lengths (3 to 10 s), padding included.
Each figure is the median of timed repeats after warm-up, with the device synchronised around each.
For bfloat16 the report also gives its agreement with float32 (equal codes; decode error relative to
the float32 peak), since speed alone does not make it usable. On CUDA, one encode of the mixed-length clips
(float32, the Snake kernel, as the engine runs it) under torch.profiler: device time, busy fraction and the
top kernels; the same encode with its float32 matmuls in TF32 (speed, and the codes that stay equal); and
HuBERT's first GroupNorm on 64 padded clips, batched (as the codec runs it) against a norm per clip.

    python bench/codec.py [--out bench/results/codec-<gpu>.json] [--size full|tiny] [--seconds 10]
                          [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.codec_parity import random_reference  # noqa: E402
from bench.environment import environment, results_path, write_result  # noqa: E402
from engine.codec import Codec  # noqa: E402
from engine.codec.checkpoint import OMNIVOICE_CODEC_CONFIG  # noqa: E402
from engine.codec.config import CodecConfig  # noqa: E402
from engine.codec.lengths import conv_output_lengths  # noqa: E402
from engine.tiny.codec import TINY_CODEC_CONFIG  # noqa: E402

SAMPLE_RATE = 24000
HOP = 960
BATCHES = (1, 16)


def median_seconds(fn, device: str, repeats: int, warmup: int = 2) -> float:
    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def row(impl: str, dtype: str, op: str, batch: int, audio_seconds: float, seconds: float) -> dict:
    return {
        "impl": impl,
        "dtype": dtype,
        "op": op,
        "batch": batch,
        "audio_seconds": round(audio_seconds, 3),
        "median_s": seconds,
        "audio_s_per_s": audio_seconds / seconds,
    }


def bench_ours(
    codec: Codec, name: str, clips: list[torch.Tensor], codes: list[torch.Tensor], device, repeats
):
    dtype = str(codec.fc.weight.dtype).removeprefix("torch.")
    audio_seconds = sum(c.numel() for c in clips) / SAMPLE_RATE
    rows = [
        row(
            name,
            dtype,
            "encode",
            len(clips),
            audio_seconds,
            median_seconds(lambda: codec.encode(clips), device, repeats),
        ),
        row(
            name,
            dtype,
            "decode",
            len(codes),
            audio_seconds,
            median_seconds(lambda: codec.decode(codes), device, repeats),
        ),
    ]
    return rows


def bench_reference(model, wavs: torch.Tensor, codes: torch.Tensor, device, repeats):
    audio_seconds = wavs.shape[0] * wavs.shape[-1] / SAMPLE_RATE

    def encode():
        with torch.no_grad():
            model.encode(wavs, return_dict=False)

    def decode():
        with torch.no_grad():
            model.decode(codes, return_dict=False)

    return [
        row(
            "transformers",
            "float32",
            "encode",
            wavs.shape[0],
            audio_seconds,
            median_seconds(encode, device, repeats),
        ),
        row(
            "transformers",
            "float32",
            "decode",
            wavs.shape[0],
            audio_seconds,
            median_seconds(decode, device, repeats),
        ),
    ]


def bf16_agreement(fp32: Codec, bf16: Codec, clips: list[torch.Tensor]) -> dict:
    codes32, codes16 = fp32.encode(clips), bf16.encode(clips)
    audio32, audio16 = fp32.decode(codes32), bf16.decode(codes32)
    return {
        "encode_equal_codes_share": statistics.mean(
            (a == b).float().mean().item() for a, b in zip(codes32, codes16)
        ),
        "encode_equal_first_codebook_share": statistics.mean(
            (a[0] == b[0]).float().mean().item() for a, b in zip(codes32, codes16)
        ),
        "decode_max_abs_diff_over_fp32_peak": max(
            ((a - b).abs().max() / a.abs().max()).item() for a, b in zip(audio32, audio16)
        ),
    }


def fused_agreement(codec: Codec, clips: list[torch.Tensor]) -> dict:
    """The Snake kernel against torch's ops: meant to be bit-equal (codes and decoded audio)."""
    codes = codec.encode(clips)
    audio = codec.decode(codes)
    codec.use_fused_kernels(True)
    fused_codes = codec.encode(clips)
    fused_audio = codec.decode(fused_codes)
    codec.use_fused_kernels(False)
    return {
        "encode_equal_codes": all(torch.equal(a, b) for a, b in zip(codes, fused_codes)),
        "decode_bit_equal": all(torch.equal(a, b) for a, b in zip(audio, fused_audio)),
    }


def matmul_tf32_trial(codec: Codec, clips: list[torch.Tensor], device: str, repeats: int) -> dict:
    """The encode as the engine runs it (the Snake kernel) with its float32 matmuls (HuBERT's Linears, fc,
    the quantizer's projections) in TF32, against full float32 matmuls (torch's default, as the official
    package runs): both timed here, and the share of codes that stay equal. The switch is process-wide;
    whether the codes may change is a numerics decision not made yet."""
    saved = torch.backends.cuda.matmul.allow_tf32
    codec.use_fused_kernels(True)
    timed, codes = {}, {}
    try:
        for tf32 in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            codes[tf32] = codec.encode(clips)
            timed[tf32] = median_seconds(lambda: codec.encode(clips), device, repeats)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
        codec.use_fused_kernels(False)
    pairs = list(zip(codes[False], codes[True], strict=True))
    return {
        "clips": len(clips),
        "audio_seconds": round(sum(c.numel() for c in clips) / SAMPLE_RATE, 2),
        "encode_s_float32_matmuls": timed[False],
        "encode_s_tf32_matmuls": timed[True],
        "speedup": timed[False] / timed[True],
        "equal_codes_share": statistics.mean((a == b).float().mean().item() for a, b in pairs),
        "equal_first_codebook_share": statistics.mean((a[0] == b[0]).float().mean().item() for a, b in pairs),
    }


def group_norm_trial(codec: Codec, device: str, repeats: int, g: torch.Generator) -> dict:
    """HuBERT's first GroupNorm over 64 padded clips of 3-10 s: the batched norm the codec runs against a
    norm per clip (what it ran before: a copy of the batch, then each clip's norm written into it), each
    timed alone (host launches included), and their largest difference on the valid frames."""
    layer = codec.semantic_model.feature_extractor.conv_layers[0]
    rate = codec.config.semantic_sample_rate
    seconds = 3 + 7 * torch.rand(64, generator=g)
    frames = conv_output_lengths(layer.conv, [int(s * rate) for s in seconds.tolist()])
    x = torch.randn(len(frames), layer.conv.out_channels, max(frames), generator=g).to(device)

    def per_clip() -> torch.Tensor:
        out = x.clone()
        for i, n in enumerate(frames):
            out[i, :, :n] = layer.layer_norm(x[i : i + 1, :, :n])[0]
        return out

    with torch.inference_mode():
        a, b = per_clip(), layer._group_norm(x, frames)
        difference = max((a[i, :, :n] - b[i, :, :n]).abs().max().item() for i, n in enumerate(frames))
        per_clip_s = median_seconds(per_clip, device, repeats)
        batched_s = median_seconds(lambda: layer._group_norm(x, frames), device, repeats)
    return {
        "clips": len(frames),
        "frames": sum(frames),
        "per_clip_ms": round(per_clip_s * 1e3, 3),
        "batched_ms": round(batched_s * 1e3, 3),
        "max_abs_difference": difference,
    }


def encode_profile(codec: Codec, clips: list[torch.Tensor]) -> dict:
    """One warm encode under torch.profiler (CUDA): wall, device time, busy fraction (busy / wall: well
    under 1 means the host's launches hold the device back, which threads beside it in a job make worse),
    kernels launched, and the top kernels by device time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from bench.profile_generate import busy_us, summarize

    codec.encode(clips)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        codec.encode(clips)
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    device = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    summary = summarize([(e.name, e.time_range.elapsed_us(), 1) for e in device], top=15)
    busy = busy_us([(e.time_range.start, e.time_range.end) for e in device])
    return {
        "clips": len(clips),
        "audio_seconds": round(sum(c.numel() for c in clips) / SAMPLE_RATE, 2),
        "profiled_wall_ms": round(wall_us / 1e3, 2),
        "device_ms": round(summary["device_us"] / 1e3, 2),
        "gpu_busy_fraction": round(busy / wall_us, 4),
        "kernels": summary["kernels"],
        "top_kernels": [{k: v for k, v in r.items() if k != "category"} for r in summary["top_kernels"]],
    }


def run(size: str, seconds: float, repeats: int, device: str, seed: int) -> dict:
    frames = int(seconds * SAMPLE_RATE) // HOP
    samples = frames * HOP
    g = torch.Generator().manual_seed(seed)
    try:
        reference, folder = random_reference(size, seed, device)
    except ImportError as e:  # no torchaudio: ours alone, from the same config with its own init
        reference, folder = None, None
        unavailable = repr(e)
    if folder is not None:
        fp32 = Codec.from_dir(folder, device=device)
        bf16 = Codec.from_dir(folder, device=device, dtype=torch.bfloat16)
    else:
        config = OMNIVOICE_CODEC_CONFIG if size == "full" else TINY_CODEC_CONFIG
        fp32 = Codec(CodecConfig.from_dict(config)).to(device)
        bf16 = Codec(fp32.config).to(device, torch.bfloat16)
        bf16.load_state_dict(fp32.state_dict())
    rows = []
    for batch in BATCHES:
        wavs = (torch.randn(batch, samples, generator=g) * 0.1).to(device)
        clips = list(wavs)
        codes = fp32.encode(clips)
        rows += bench_ours(fp32, "ours", clips, codes, device, repeats)
        rows += bench_ours(bf16, "ours", clips, codes, device, repeats)
        if device.startswith("cuda"):
            fp32.use_fused_kernels(True)
            rows += bench_ours(fp32, "ours-fused-snake", clips, codes, device, repeats)
            fp32.use_fused_kernels(False)
        if reference is not None:
            rows += bench_reference(reference, wavs[:, None], torch.stack(codes), device, repeats)
    lengths = torch.randint(3 * SAMPLE_RATE, int(seconds * SAMPLE_RATE) + 1, (16,), generator=g).tolist()
    mixed = [(torch.randn(n, generator=g) * 0.1).to(device) for n in lengths]
    mixed_rows = bench_ours(fp32, "ours-mixed-lengths", mixed, fp32.encode(mixed), device, repeats)
    result = {
        "clip_seconds": samples / SAMPLE_RATE,
        "repeats": repeats,
        "device": device,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "rows": rows + mixed_rows,
        "bf16_vs_fp32": bf16_agreement(fp32, bf16, mixed[:4]),
    }
    if device.startswith("cuda"):
        result["fused_snake_vs_torch"] = fused_agreement(fp32, mixed[:4])
        result["matmul_tf32"] = matmul_tf32_trial(fp32, mixed, device, repeats)
        result["first_group_norm"] = group_norm_trial(fp32, device, repeats, g)
        fp32.use_fused_kernels(True)  # as the engine runs it
        result["encode_profile_mixed_lengths"] = encode_profile(fp32, mixed)
        fp32.use_fused_kernels(False)
    if reference is None:
        result["transformers_unavailable"] = unavailable
    else:
        result["speedup_vs_transformers"] = {
            f"{r['op']}/batch{r['batch']}/{r['dtype']}": r["audio_s_per_s"] / t["audio_s_per_s"]
            for r in rows
            if r["impl"] == "ours"
            for t in rows
            if t["impl"] == "transformers" and (t["op"], t["batch"]) == (r["op"], r["batch"])
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=results_path("codec"))
    parser.add_argument("--size", choices=["full", "tiny"], default="full")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    result = {
        "environment": environment("transformers", "torchaudio"),
        "size": args.size,
        **run(args.size, args.seconds, args.repeats, args.device, args.seed),
    }
    for r in result["rows"]:
        label = f"{r['impl']:>20} {r['dtype']:>8} {r['op']:>6} batch {r['batch']:>2}"
        print(f"{label}: {r['audio_s_per_s']:10.1f} audio s/s")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))
    write_result(Path(args.out), result)


if __name__ == "__main__":
    main()
