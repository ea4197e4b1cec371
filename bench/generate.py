"""Generation speed of our engine against the official OmniVoice package, in the same run on one GPU.

Full-size model (real dimensions, random weights), 32 steps, guidance 2.0, reference 5 s (125 frames),
target 6 s (150 frames) or varied, as in ../shared/anchors (official_baseline.py): B=1, B=8 with equal
lengths, B=16 and B=32 with varied lengths. The official model runs its `_generate_iterative` in fp16
with SDPA (eager, padded batch), as the anchor did; ours runs bf16 on the fastest attention backend,
eagerly and with CUDA graphs, and in W4A4 (backbone Linears on the W4A4 kernels) with CUDA graphs; the
`_unfused` variants run with the fused kernels off (OVBATCH_FUSED_KERNELS=0: torch's RMSNorm, SiLU*up and
q/k norm + RoPE around the Linears), which is what they save; the `_ungrouped` variants run q/k/v and gate/up
as separate layers (OVBATCH_GROUPED_PROJECTIONS=0) instead of one GEMM each; `_silu_mul` runs W4A4 gate/up
as the grouped GEMM + the silu_mul kernel instead of the GEMM that writes silu(gate) * up
(OVBATCH_SWIGLU_GEMM=0).
Medians of the repetitions; RTF = wall time / audio time.

    python bench/generate.py [--out bench/results/generate-h200.json] [--reps 5]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.environment import environment, write_result  # noqa: E402
from bench.parity import (  # noqa: E402
    TEXTS,
    Request,
    build_official,
    official_inputs,
    save_official_checkpoint,
)
from engine.checkpoint import load_model  # noqa: E402
from engine.config import EngineConfig, GenerationConfig  # noqa: E402
from engine.quant.rtn import w4a4_copy  # noqa: E402
from engine.runner import Runner  # noqa: E402

FRAME_RATE = 25
REF_FRAMES, TARGET_FRAMES = 125, 150
# The engine's default graph buckets (engine/config.py) plus 12288 and two above 16384, so that every case,
# up to B = 32 with varied lengths, replays a graph.
BUCKETS = (512, 1024, 2048, 4096, 8192, 12288, 16384, 24576, 32768)
CASES = {"B1": (1, False), "B8_same": (8, False), "B16_vary": (16, True), "B32_vary": (32, True)}


def requests(batch: int, vary: bool) -> list[Request]:
    """The anchor's batches: target lengths 150 or 150 + U[-75, 150) frames, seeded by the batch size."""
    g = torch.Generator().manual_seed(batch)
    lens = [
        TARGET_FRAMES + (int(torch.randint(-75, 150, (1,), generator=g)) if vary else 0) for _ in range(batch)
    ]
    return [Request(TEXTS[0], REF_FRAMES, n) for n in lens]


# the switches a variant's label turns off (engine/kernels/fused.py, engine/quant/linear.py)
SWITCHES = {
    "_unfused": "OVBATCH_FUSED_KERNELS",
    "_ungrouped": "OVBATCH_GROUPED_PROJECTIONS",
    "_silu_mul": "OVBATCH_SWIGLU_GEMM",
}


@contextlib.contextmanager
def switches_for(label: str):
    """Run (and capture) with the switches the label names off, every other one on."""
    before = {name: os.environ.get(name) for name in SWITCHES.values()}
    for suffix, name in SWITCHES.items():
        os.environ[name] = "0" if label.endswith(suffix) else "1"
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def median_seconds(reps: int, fn, *args) -> float:
    fn(*args)  # warm-up: graph capture, allocator, autotuning
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn(*args)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timing(seconds: float, audio_s: float) -> dict:
    return {
        "ms": round(seconds * 1e3, 1),
        "rtf": round(seconds / audio_s, 5),
        "x_realtime": round(audio_s / seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="bench/results/generate-h200.json")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/generate.py needs a CUDA GPU")
    from omnivoice.models.omnivoice import OmniVoiceGenerationConfig

    official = build_official("full", seed=0, device="cuda")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = save_official_checkpoint(official, Path(tmp) / "ckpt")
        _, ours = load_model(ckpt, device="cuda", dtype=torch.bfloat16, attention="auto")
    official = official.half()
    backend = ours.attention_backend(torch.device("cuda"), torch.bfloat16).name
    runners = {
        "ours_bf16_eager": Runner(
            ours, EngineConfig(cuda_graphs=False, buckets=BUCKETS), "cuda", torch.bfloat16
        ),
        "ours_bf16_graphs": Runner(
            ours, EngineConfig(cuda_graphs=True, buckets=BUCKETS), "cuda", torch.bfloat16
        ),
    }
    w4a4 = w4a4_copy(ours)
    for label, model in (
        ("ours_w4a4_graphs", w4a4),
        ("ours_w4a4_graphs_silu_mul", w4a4),
        ("ours_bf16_graphs_unfused", ours),
        ("ours_w4a4_graphs_unfused", w4a4),
        ("ours_bf16_graphs_ungrouped", ours),
        ("ours_w4a4_graphs_ungrouped", w4a4),
    ):
        runners[label] = Runner(
            model, EngineConfig(cuda_graphs=True, buckets=BUCKETS), "cuda", torch.bfloat16
        )
    gen = GenerationConfig()
    official_gen = OmniVoiceGenerationConfig()
    results = {}
    with torch.inference_mode():
        for name, (batch, vary) in CASES.items():
            reqs = requests(batch, vary)
            task, items, _ = official_inputs(official, reqs, seed=batch)
            audio_s = sum(r.target_len for r in reqs) / FRAME_RATE
            reps = max(2, args.reps // 2) if batch >= 32 else args.reps
            row = {"B": batch, "audio_s": audio_s}
            official_s = median_seconds(reps, official._generate_iterative, task, official_gen)
            row["official_fp16_eager"] = timing(official_s, audio_s)
            for label, runner in runners.items():
                with switches_for(label):
                    row[label] = timing(median_seconds(reps, runner.generate, items, gen), audio_s)
            for label in runners:
                row[f"speedup_{label}"] = round(row["official_fp16_eager"]["ms"] / row[label]["ms"], 2)
            print(name, json.dumps(row), flush=True)
            results[name] = row
    report = {
        "environment": environment("transformers", "omnivoice"),
        "attention_backend": backend,
        "num_step": gen.num_step,
        "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2),
        "cases": results,
    }
    write_result(Path(args.out), report)


if __name__ == "__main__":
    main()
