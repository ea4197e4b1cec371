"""Full-size W4A4 quantization on one GPU: time, peak host RSS, peak GPU memory, per-layer errors, and the
W4A4-vs-FP16 check (step-0 logits cosine, 32-step token agreement).

The model has OmniVoice's real dimensions (28 layers, hidden 1024, MLP 3072, vocab 151676) with seeded
random weights given the structure of trained LLMs (engine/quantizer/synthetic.py): backbone Linears with a
decaying low-rank part and heavy-tailed entries, and RMSNorm weights with a few large channels shared by
all layers, which gives the Linears' inputs the outlier channels real activations have. `ovbatch quantize`
runs in a child process on 128 generated calibration requests, so its peak RSS is its own.
Targets: < 8 GB host RAM, < 10 minutes.

    python bench/quantize.py [--out bench/results/quantize-<gpu>.json] [--samples 128] [--dtype fp16]
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.environment import environment, results_path, write_result  # noqa: E402
from engine.config import LLMConfig, ModelConfig  # noqa: E402
from engine.model import OmniVoiceModel  # noqa: E402
from engine.quantizer.synthetic import structured_weight  # noqa: E402
from engine.tiny import ensure_tiny_checkpoint  # noqa: E402

HOST_RSS_TARGET = 8 * 2**30
SECONDS_TARGET = 600
OUTLIER_CHANNELS, OUTLIER_GAIN = 6, 15.0


def write_structured_checkpoint(out_dir: Path, device: str, layers: int = 28, seed: int = 0) -> None:
    """A full-size OmniVoice checkpoint (bf16) with LLM-like weight statistics, plus the tiny tokenizer."""
    cfg = ModelConfig(llm=LLMConfig(num_hidden_layers=layers))
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = cfg.llm.hidden_size
    outliers = torch.randperm(hidden, generator=gen, device=device)[:OUTLIER_CHANNELS]
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in OmniVoiceModel(cfg).state_dict().items()}
    state = {}
    for name, shape in shapes.items():
        if name.endswith("layernorm.weight"):
            w = 1.0 + 0.1 * torch.randn(shape, generator=gen, device=device)
            w[outliers] *= OUTLIER_GAIN
        elif name.endswith("norm.weight"):
            w = 1.0 + 0.1 * torch.randn(shape, generator=gen, device=device)
        elif name == "audio_heads.weight":
            w = torch.randn(shape, generator=gen, device=device) * (2.5 / math.sqrt(hidden))
        elif name.endswith("embeddings.weight") or name.endswith("embed_tokens.weight"):
            w = torch.randn(shape, generator=gen, device=device)
        else:
            w = structured_weight(shape[0], shape[1], gen, std=1.0 / math.sqrt(shape[1]))
        state[name] = w.to(torch.bfloat16).cpu().contiguous()
    out_dir.mkdir(parents=True)
    (out_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tiny = ensure_tiny_checkpoint()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(tiny / name, out_dir / name)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=results_path("quantize"))
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--eval-requests", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument(
        "--dtype", default="fp16", help="activation dtype of calibration and the FP reference"
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=28, help="decoder layers (fewer for a quick look)")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("bench/quantize.py needs a CUDA GPU (pass --device cpu to try it on the CPU, slowly)")

    work = Path(tempfile.mkdtemp(prefix="ovbatch-quant-bench-"))
    try:
        src, dst = work / "src", work / "w4a4"
        start = time.perf_counter()
        write_structured_checkpoint(src, args.device, args.layers)
        make_s = time.perf_counter() - start
        print(f"wrote the full-size structured checkpoint in {make_s:.1f} s", flush=True)
        kernels = "not tried (CPU run)"
        if args.device.startswith("cuda"):
            # Build (or find cached) the W4A4 extension first: the timing below is quantization, not nvcc.
            from engine.kernels.build import load_extension

            start = time.perf_counter()
            ok, reason = load_extension()
            kernels = (
                f"built/loaded in {time.perf_counter() - start:.1f} s" if ok else f"unavailable: {reason}"
            )
            print(f"W4A4 kernels: {kernels}", flush=True)
        cmd = [sys.executable, "-m", "pipeline.cli", "quantize", str(src), "--out", str(dst),
               "--samples", str(args.samples), "--eval-requests", str(args.eval_requests),
               "--rank", str(args.rank), "--device", args.device, "--dtype", args.dtype]  # fmt: skip
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1])
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            sys.exit(f"ovbatch quantize failed with exit code {proc.returncode}")
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux reports KiB
        report = json.loads((dst / "quant_report.json").read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)

    result = {
        "env": environment(),
        "model": f"OmniVoice full-size dims ({args.layers} layers), seeded structured random weights (bf16)",
        "calibration_requests": args.samples,
        "eval_requests": args.eval_requests,
        "rank": args.rank,
        "dtype": report["dtype"],
        "w4a4_backend": report["w4a4_backend"],
        "kernels_before_timing": kernels,
        "seconds": round(wall, 1),
        "quantize_seconds": report["seconds"],
        "peak_host_rss_bytes": rss,
        "peak_gpu_bytes": report.get("peak_gpu_bytes"),
        "targets": {
            "host_rss_under_8GB": rss < HOST_RSS_TARGET,
            "under_10_minutes": wall < SECONDS_TARGET,
        },
        "end_to_end": report["end_to_end"],
        "mean_error": report["summary"]["mean_error"],
        "smoothed_layers": report["summary"]["smoothed_layers"],
        "layers": [
            {
                "name": x["name"],
                "shape": x["shape"],
                **x["errors"],
                "alpha": x["alpha"],
                "refits": x["refits"],
                "seconds": x["seconds"],
            }
            for x in report["layers"]
        ],  # fmt: skip
    }
    write_result(args.out, result)
    e2e = result["end_to_end"]
    print(
        f"{result['seconds']:.0f} s, peak host RSS {rss / 2**30:.2f} GiB, peak GPU "
        f"{(result['peak_gpu_bytes'] or 0) / 2**30:.2f} GiB; W4A4 vs {result['dtype']}: cosine "
        f"{e2e['logits_cosine_mean']:.4f}, token agreement {e2e['token_agreement']:.1%} -> {args.out}"
    )


if __name__ == "__main__":
    main()
