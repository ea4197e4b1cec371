"""Where generation time goes on the GPU: one warm Runner.generate call per variant under torch.profiler.

Full-size OmniVoice dimensions with random weights (bench/pipeline.py's checkpoint, no official package),
the batches of bench/generate.py (default B8_same and B32_vary: 32 steps, 5 s references), and four
variants: bf16 eager, bf16 with CUDA graphs, W4A4 with CUDA graphs (bench/generate.py's round-to-nearest
copy on the CUDA kernels; skipped, with the reason, when they cannot run) and FP8 with CUDA graphs.
Per variant: the median wall time of 3 unprofiled calls, then one profiled call: its wall time, device
time (kernels, memcpy, memset: summed, and merged into busy time), GPU busy fraction (busy / wall),
kernels run, host launch calls (kernels, graphs), device time per category and the top 25 kernels.
Categories come from kernel names only (classify): elementwise kernels of the decoding step (log, where,
masked_fill) count as elementwise, the model's index kernels as decoding.

    python bench/profile_generate.py [--out PATH] [--cases B8_same,B32_vary]

(default --out bench/results/profile-generate-<gpu>.json; cases are bench/generate.py's CASES)
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.environment import environment, results_path, write_result  # noqa: E402
from bench.generate import BUCKETS, CASES, FRAME_RATE, median_seconds, requests, w4a4_copy  # noqa: E402
from bench.parity import REF_TEXT  # noqa: E402
from bench.pipeline import full_size_checkpoint  # noqa: E402
from engine.config import EngineConfig, GenerationConfig  # noqa: E402
from engine.errors import InputError  # noqa: E402
from engine.frontend.text import TextFrontend  # noqa: E402
from engine.generate.loop import GenItem, Runner  # noqa: E402
from engine.generate.packing import packed_tokens  # noqa: E402
from engine.loading import backbone_to_fp8, load_model  # noqa: E402

# First match wins (case-insensitive substrings): attention and W4A4 before dense GEMM, as flash kernels
# carry cutlass types in their names and the W4A4 GEMM is called a gemm.
RULES = (
    ("memcpy_memset", "memcpy memset".split()),
    ("w4a4_quantize", ["quantize_act"]),
    ("w4a4_gemm", ["w4a4_gemm"]),
    ("fp8_quantize", ["fp8_quantize", "fp8_silu_mul"]),
    ("attention", "flash fmha attention varlen".split()),
    ("dense_gemm", "gemm gemv nvjet cutlass xmma cublas splitkreduce".split()),
    (
        "sampling_decoding",
        "topk sort scatter gather index softmax argmax maxops maxnan distribution philox scan".split(),
    ),
    ("norm_rope_elementwise", "elementwise reduce_kernel catarray norm rope copy".split()),
)
CATEGORIES = tuple(c for c, _ in RULES) + ("other",)
GEMMS = ("dense_gemm", "w4a4_gemm")
TOP = 25


def classify(name: str) -> str:
    """The category of a device activity (kernel, memcpy or memset) from its name."""
    low = name.lower()
    return next((c for c, keys in RULES if any(k in low for k in keys)), "other")


def summarize(rows: list[tuple[str, float, int]], top: int = TOP) -> dict:
    """(name, device time us, count) rows -> total device time, kernels run (memcpy/memset apart),
    per-category time, count and share, and the `top` names by time."""
    by_name: dict[str, list[float]] = {}
    for name, us, count in rows:
        acc = by_name.setdefault(name, [0.0, 0])
        acc[0] += us
        acc[1] += count
    total = sum(us for us, _ in by_name.values())
    categories = {c: {"us": 0.0, "count": 0} for c in CATEGORIES}
    for name, (us, count) in by_name.items():
        category = categories[classify(name)]
        category["us"] += us
        category["count"] += count
    for c in categories.values():
        c["us"] = round(c["us"], 1)
        c["share"] = round(c["us"] / total, 4) if total else 0.0
    ranked = sorted(by_name.items(), key=lambda kv: kv[1][0], reverse=True)[:top]
    return {
        "device_us": round(total, 1),
        "kernels": sum(c["count"] for k, c in categories.items() if k != "memcpy_memset"),
        "categories": categories,
        "top_kernels": [
            {
                "name": name,
                "category": classify(name),
                "total_us": round(us, 1),
                "count": count,
                "mean_us": round(us / count, 2),
                "share": round(us / total, 4),
            }
            for name, (us, count) in ranked
        ],
    }


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: time with at least one activity on the device."""
    busy, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            busy += e - max(s, end)
            end = e
    return busy


def graph_kernels_recorded(categories: dict, graph_launches: int) -> bool | None:
    """Whether the kernels inside CUDA graph replays were recorded: every replayed forward pass runs
    GEMMs, and outside the graphs none run. None for a call without graph launches."""
    if graph_launches == 0:
        return None
    return sum(categories[c]["count"] for c in GEMMS) >= graph_launches


def profile_call(runner: Runner, items: list[GenItem], gen: GenerationConfig) -> dict:
    """One generate call under the profiler (call it warm): wall time and where the device time went."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        runner.generate(items, gen)
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    events = prof.events()
    device = [e for e in events if e.device_type == DeviceType.CUDA]
    host = Counter(e.name for e in events if e.device_type == DeviceType.CPU)
    summary = summarize([(e.name, e.time_range.elapsed_us(), 1) for e in device])
    busy = busy_us([(e.time_range.start, e.time_range.end) for e in device])
    graph_launches = sum(n for name, n in host.items() if "GraphLaunch" in name)
    return {
        "profiled_wall_ms": round(wall_us / 1e3, 2),
        "device_ms": round(summary["device_us"] / 1e3, 2),
        "busy_ms": round(busy / 1e3, 2),
        "gpu_busy_fraction": round(busy / wall_us, 4),
        "kernels": summary["kernels"],
        "host_kernel_launch_calls": sum(n for name, n in host.items() if "LaunchKernel" in name),
        "host_graph_launch_calls": graph_launches,
        "graph_kernels_recorded": graph_kernels_recorded(summary["categories"], graph_launches),
        "categories": summary["categories"],
        "top_kernels": summary["top_kernels"],
    }


def case_items(frontend: TextFrontend, name: str, num_codebooks: int, mask_id: int) -> list[GenItem]:
    """bench/generate.py's requests of a case, prompted with our tokenizer, with seeded reference codes
    in [0, mask_id)."""
    batch, vary = CASES[name]
    g = torch.Generator().manual_seed(batch)
    return [
        GenItem(
            prompt_ids=frontend.prompt_ids(r.text, REF_TEXT, "en", None, denoise=True, has_ref=True),
            ref_tokens=torch.randint(0, mask_id, (num_codebooks, r.ref_frames), generator=g),
            target_len=r.target_len,
            seed=i,
        )
        for i, r in enumerate(requests(batch, vary))
    ]


def parse_cases(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in names if c not in CASES]
    if not names or unknown:
        raise InputError(f"--cases {text!r}: choose from {', '.join(CASES)} (comma-separated).")
    return names


def print_table(case: str, variants: dict) -> None:
    short = {"memcpy_memset": "memcpy", "w4a4_quantize": "w4a4_q", "norm_rope_elementwise": "elementw",
             "sampling_decoding": "sampling"}  # fmt: skip
    cols = [short.get(c, c) for c in CATEGORIES]
    print(f"{case:<18}{'wall':>8}{'prof':>8}{'busy':>6}{'kernels':>8}" + "".join(f"{c:>11}" for c in cols))
    for label, v in variants.items():
        if "skipped" in v:
            print(f"{label:<18}skipped: {v['skipped']}")
            continue
        ms = "".join(f"{v['categories'][c]['us'] / 1e3:>11.1f}" for c in CATEGORIES)
        print(f"{label:<18}{v['wall_ms']:>8.1f}{v['profiled_wall_ms']:>8.1f}{v['gpu_busy_fraction']:>6.2f}"
              f"{v['kernels']:>8}{ms}")  # fmt: skip
    print("(ms; busy: merged device time / profiled wall)", flush=True)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=results_path("profile-generate"))
    p.add_argument("--cases", default="B8_same,B32_vary", help=f"comma-separated, of {', '.join(CASES)}")
    args = p.parse_args(argv)
    cases = parse_cases(args.cases)
    if not torch.cuda.is_available():
        sys.exit("bench/profile_generate.py needs a CUDA GPU (torch sees none): run it on the H200.")
    from engine.kernels import CudaW4A4Backend

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = full_size_checkpoint(Path(tmp) / "ckpt")
        cfg, model = load_model(ckpt, device="cuda", dtype=torch.bfloat16, attention="auto")
        frontend = TextFrontend(ckpt / "tokenizer.json")
    runners: dict[str, Runner | str] = {
        "bf16_eager": Runner(model, EngineConfig(cuda_graphs=False, buckets=BUCKETS), "cuda", torch.bfloat16),
        "bf16_graphs": Runner(model, EngineConfig(cuda_graphs=True, buckets=BUCKETS), "cuda", torch.bfloat16),
    }
    w4a4_ok, w4a4_reason = CudaW4A4Backend().can_use(torch.device("cuda"))
    runners["w4a4_graphs"] = (
        Runner(w4a4_copy(model), EngineConfig(cuda_graphs=True, buckets=BUCKETS), "cuda", torch.bfloat16)
        if w4a4_ok
        else f"W4A4 CUDA kernels unavailable: {w4a4_reason}"
    )
    fp8 = backbone_to_fp8(copy.deepcopy(model))
    runners["fp8_graphs"] = Runner(
        fp8, EngineConfig(cuda_graphs=True, buckets=BUCKETS), "cuda", torch.bfloat16
    )
    gen = GenerationConfig()
    results = {}
    for case in cases:
        items = case_items(frontend, case, cfg.num_audio_codebook, cfg.audio_mask_id)
        variants = {}
        for label, runner in runners.items():
            if isinstance(runner, str):
                variants[label] = {"skipped": runner}
                continue
            wall_s = median_seconds(3, runner.generate, items, gen)  # its warm-up captures the graph
            profiled = profile_call(runner, items, gen)
            variants[label] = {
                "cuda_graphs": runner.use_graphs,
                "wall_ms": round(wall_s * 1e3, 2),
                # device time hardly changes under the profiler, the host side does: busy over the
                # unprofiled wall is the closer estimate of how idle the GPU is in a normal run
                "gpu_busy_fraction_unprofiled_wall": round(profiled["busy_ms"] / (wall_s * 1e3), 4),
                **profiled,
            }
        results[case] = {
            "B": len(items),
            "audio_s": sum(it.target_len for it in items) / FRAME_RATE,
            "packed_tokens": sum(map(packed_tokens, items)),
            "variants": variants,
        }
        print_table(case, variants)
    report = {
        "bench": "profile_generate",
        "environment": environment("transformers"),
        "attention_backend": model.attention_backend(torch.device("cuda"), torch.bfloat16).name,
        "num_step": gen.num_step,
        "note": "busy = union of device activity intervals; graph_kernels_recorded False means the profiler "
        "missed the kernels inside graph replays, so a graph variant's categories hold decoding only",
        "cases": results,
    }
    out = Path(args.out)
    write_result(out, report)
    return report


if __name__ == "__main__":
    main()
