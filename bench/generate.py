"""Generation speed of our engine against the official OmniVoice package, in the same run on one GPU.

Full-size model (real dimensions, random weights), 32 steps, guidance 2.0, reference 5 s (125 frames),
target 6 s (150 frames) or varied, as in ../shared/anchors (official_baseline.py): B=1, B=8 with equal
lengths, B=16 and B=32 with varied lengths. The official model runs its `_generate_iterative` in fp16
with SDPA (eager, padded batch), as the anchor did; ours runs bf16 on the fastest attention backend,
eagerly and with CUDA graphs, in W4A4 (backbone Linears on the W4A4 kernels) and in FP8 (backbone
Linears as e4m3 with per-channel weight and per-token activation scales, cuBLASLt's row-wise scaled GEMM,
activations quantized by the kernels that produce them) with CUDA graphs; the
`_unfused` variants run with the fused kernels off (FastPaths.fused_kernels: torch's RMSNorm, SiLU*up and
q/k norm + RoPE around the Linears), which is what they save; the `_ungrouped` variants run q/k/v and gate/up
as separate layers (FastPaths.grouped_projections; each computes its input's RMSNorm) instead of one GEMM
each; `_silu_mul` runs bf16 and W4A4 gate/up as one GEMM (bf16: cuBLAS's) + the silu_mul kernel instead of
the GEMM that writes silu(gate) * up (FastPaths.swiglu_gemm; bf16's is a Triton kernel); `_qk_rope_apart` runs
bf16 q/k/v on cuBLAS + the qk_norm_rope kernel instead of the Triton GEMM that norms and rotates q and k
(FastPaths.qkv_rope_gemm). Each variant is its own model, loaded with its switches.
Medians of the repetitions; RTF = wall time / audio time. Each case also reports every variant's 32-step
token agreement with ours_bf16_graphs (the same requests and seeds; with random weights a figure for how far
a precision's numerics move the sampled codes, not a quality measure).

    python bench/generate.py [--out bench/results/generate-<gpu>.json] [--reps 5] [--cases B32_vary]
                             [--variants ours_bf16_graphs,ours_fp8_graphs] [--attention varlen]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.environment import environment, results_path, write_result  # noqa: E402
from bench.parity import (  # noqa: E402
    TEXTS,
    Request,
    build_official,
    official_inputs,
    save_official_checkpoint,
)
from engine.config import EngineConfig, FastPaths, GenerationConfig  # noqa: E402
from engine.generate.loop import Runner  # noqa: E402
from engine.loading import backbone_to_fp8, load_model, prepare_for_inference  # noqa: E402
from engine.quantizer.rtn import w4a4_copy  # noqa: E402

FRAME_RATE = 25
REF_FRAMES, TARGET_FRAMES = 125, 150
# The engine's default graph buckets (engine/config.py) and their 512 steps on up to 32768, so that every
# case, up to B = 32 with varied lengths, replays a graph.
BUCKETS = tuple(range(512, 32769, 512))
CASES = {"B1": (1, False), "B8_same": (8, False), "B16_vary": (16, True), "B32_vary": (32, True)}
REFERENCE = "ours_bf16_graphs"  # what each variant's 32-step tokens are compared with (same seeds)


def requests(batch: int, vary: bool) -> list[Request]:
    """The anchor's batches: target lengths 150 or 150 + U[-75, 150) frames, seeded by the batch size."""
    g = torch.Generator().manual_seed(batch)
    lens = [
        TARGET_FRAMES + (int(torch.randint(-75, 150, (1,), generator=g)) if vary else 0) for _ in range(batch)
    ]
    return [Request(TEXTS[0], REF_FRAMES, n) for n in lens]


# the fast path a variant's label turns off (engine/config.py FastPaths)
SWITCHES = {
    "_unfused": "fused_kernels",
    "_ungrouped": "grouped_projections",
    "_silu_mul": "swiglu_gemm",
    "_qk_rope_apart": "qkv_rope_gemm",
}


def fast_paths_for(label: str) -> FastPaths:
    """The label's switches off, every other one on."""
    return FastPaths(**{field: not label.endswith(suffix) for suffix, field in SWITCHES.items()})


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


def token_agreement(tokens: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """The share of codes (every codebook, every target frame, every request) equal to the reference's."""
    same = sum(int((a.cpu() == b.cpu()).sum()) for a, b in zip(tokens, reference, strict=True))
    return same / sum(b.numel() for b in reference)


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
    parser.add_argument("--out", type=Path, default=results_path("generate"))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of the cases")
    parser.add_argument("--variants", help="comma-separated subset of our variants (default: all)")
    parser.add_argument("--attention", default="auto", help="our attention backend (engine.attention)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/generate.py needs a CUDA GPU")
    from omnivoice.models.omnivoice import OmniVoiceGenerationConfig

    official = build_official("full", seed=0, device="cuda")
    labels = [
        "ours_bf16_eager",
        "ours_bf16_graphs",
        "ours_bf16_graphs_silu_mul",
        "ours_bf16_graphs_qk_rope_apart",
        "ours_w4a4_graphs",
        "ours_w4a4_graphs_silu_mul",
        "ours_bf16_graphs_unfused",
        "ours_w4a4_graphs_unfused",
        "ours_bf16_graphs_ungrouped",
        "ours_w4a4_graphs_ungrouped",
        "ours_fp8_graphs",
        "ours_fp8_graphs_unfused",
    ]
    if args.variants:
        unknown = set(args.variants.split(",")) - set(labels)
        if unknown:
            sys.exit(f"--variants: unknown {sorted(unknown)}; choose from {labels}")
        labels = [label for label in labels if label in args.variants.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = save_official_checkpoint(official, Path(tmp) / "ckpt")
        apart = FastPaths(grouped_projections=False)  # the Linears as loaded; each variant merges its own
        _, base = load_model(
            ckpt, device="cuda", dtype=torch.bfloat16, attention=args.attention, fast_paths=apart
        )
    convert = {"_bf16": lambda m: m, "_w4a4": w4a4_copy, "_fp8": lambda m: backbone_to_fp8(copy.deepcopy(m))}
    bases = {kind: make(base) for kind, make in convert.items() if any(kind in label for label in labels)}
    runners = {}
    for label in labels:
        paths = fast_paths_for(label)
        kind = next(k for k in bases if k in label)
        model = prepare_for_inference(copy.deepcopy(bases[kind]), paths)
        run_cfg = EngineConfig(cuda_graphs="_graphs" in label, buckets=BUCKETS, fast_paths=paths)
        runners[label] = Runner(model, run_cfg, "cuda", torch.bfloat16)
    del base, bases
    official = official.half()
    backend = next(iter(runners.values())).model.attention_backend(torch.device("cuda"), torch.bfloat16).name
    gen = GenerationConfig()
    official_gen = OmniVoiceGenerationConfig()
    results = {}
    with torch.inference_mode():
        for name in args.cases.split(","):
            batch, vary = CASES[name]
            reqs = requests(batch, vary)
            task, items, _ = official_inputs(official, reqs, seed=batch)
            audio_s = sum(r.target_len for r in reqs) / FRAME_RATE
            reps = max(2, args.reps // 2) if batch >= 32 else args.reps
            row = {"B": batch, "audio_s": audio_s}
            official_s = median_seconds(reps, official._generate_iterative, task, official_gen)
            row["official_fp16_eager"] = timing(official_s, audio_s)
            tokens = {}
            for label, runner in runners.items():
                row[label] = timing(median_seconds(reps, runner.generate, items, gen), audio_s)
                tokens[label] = runner.generate(items, gen)
            for label in runners:
                row[f"speedup_{label}"] = round(row["official_fp16_eager"]["ms"] / row[label]["ms"], 2)
            if REFERENCE in tokens:
                row[f"token_agreement_vs_{REFERENCE}"] = {
                    label: round(token_agreement(t, tokens[REFERENCE]), 4) for label, t in tokens.items()
                }
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
