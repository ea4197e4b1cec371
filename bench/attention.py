"""The varlen attention backends on the engine's own packed layouts: time, rate, error, CUDA-graph capture.

Full-size shapes (16 query heads over 8 k/v heads, head_dim 128, bf16). Layouts: generate.py's B32_vary
batch (32 requests, targets 150 + U[-75, 150) frames, 125 reference frames, a prompt of PROMPT_TOKENS text
tokens) packed as the engine packs it, once in its graph layout (sequence slots and max_seqlen rounded up;
its padding tokens are in no sequence, so attention never sees them) and once at its exact sizes; and a
job-sized batch of 56 such requests. Each backend the machine can run (engine/model/attention.py BACKENDS;
sdpa is the fp32 reference, not timed) is timed as the median of REPS replays of a CUDA graph of CALLS
calls (as the engine runs it; eager calls where capture fails), checked against the reference (relative
Frobenius error), its first call on each layout timed (JIT compilation included), and captured in a CUDA
graph whose replay must equal its eager call bit for bit.

    python bench/attention.py [--out bench/results/attention-<gpu>.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.environment import environment, results_path, write_result  # noqa: E402
from bench.generate import BUCKETS, REF_FRAMES, requests  # noqa: E402
from engine.generate.loop import choose_layout  # noqa: E402
from engine.generate.packing import GenItem, pack_items  # noqa: E402
from engine.model.attention import BACKENDS  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128
PROMPT_TOKENS = 78  # with generate.py's B32_vary targets: 18,782 packed tokens, as that bench packs them
CALLS, REPS = 20, 7


def layout(batch: int, padded: bool) -> tuple[torch.Tensor, int]:
    """cu_seqlens (int32, CUDA) and max_seqlen of generate.py's varied batch of `batch` requests, packed in
    its graph layout or at its exact tokens."""
    items = [
        GenItem([1] * PROMPT_TOKENS, torch.zeros(8, REF_FRAMES, dtype=torch.long), r.target_len, 0)
        for r in requests(batch, vary=True)
    ]
    packed = pack_items(items, 8, 1024, choose_layout(items, BUCKETS) if padded else None)
    return packed.cu_seqlens.to("cuda"), packed.max_seqlen


def attention_flop(cu: torch.Tensor) -> float:
    lengths = (cu[1:] - cu[:-1]).double()
    return float(4 * (lengths**2).sum() * HEADS * HEAD_DIM)


def time_ms(backend, q, k, v, cu, max_seqlen) -> tuple[float, str]:
    """Median ms a call over REPS replays of a CUDA graph of CALLS calls, as the engine runs attention (a
    Python-heavy wrapper's host time then drops out); eager calls if the backend cannot be captured."""
    backend(q, k, v, cu, max_seqlen)  # warm-up: compilation, plan caches
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(CALLS):
                backend(q, k, v, cu, max_seqlen)
        run, mode = graph.replay, "graph"
    except Exception:  # reported as eager timing, which includes the host's launch time
        torch.cuda.synchronize()

        def run():
            for _ in range(CALLS):
                backend(q, k, v, cu, max_seqlen)

        mode = "eager"
    run()
    times = []
    for _ in range(REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / CALLS)
    return statistics.median(times), mode


def graph_replay_matches(backend, q, k, v, cu, max_seqlen) -> bool | str:
    try:
        eager = backend(q, k, v, cu, max_seqlen)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = backend(q, k, v, cu, max_seqlen)
        graph.replay()
        torch.cuda.synchronize()
        return bool(torch.equal(out, eager))
    except Exception as e:  # a backend that cannot be captured says so in the results
        return f"capture failed: {type(e).__name__}: {e}"[:300]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=results_path("attention"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/attention.py needs a CUDA GPU")
    device, dtype = torch.device("cuda"), torch.bfloat16
    usable, skipped = {}, {}
    for name, cls in BACKENDS.items():
        backend = cls()
        ok, reason = backend.can_use(device, dtype)
        if ok:
            usable[name] = backend
        else:
            skipped[name] = reason
    reference = usable.pop("sdpa")
    layouts = {
        "B32_vary_bucket": layout(32, padded=True),
        "B32_vary_exact": layout(32, padded=False),
        "B56_exact": layout(56, padded=False),
    }
    g = torch.Generator(device="cuda").manual_seed(0)
    results = {}
    for lname, (cu, max_seqlen) in layouts.items():
        tokens = int(cu[-1])
        q, k, v = (
            torch.randn(tokens, h, HEAD_DIM, generator=g, device=device, dtype=dtype) for h in (16, 8, 8)
        )
        want = reference(q.float(), k.float(), v.float(), cu, max_seqlen)
        flop = attention_flop(cu)
        entry = {
            "tokens": tokens,
            "sequences": len(cu) - 1,
            "max_seqlen": max_seqlen,
            "gflop": round(flop / 1e9, 1),
        }
        for name, backend in usable.items():
            try:
                torch.cuda.synchronize()
                first = time.perf_counter()
                got = backend(q, k, v, cu, max_seqlen)
                torch.cuda.synchronize()
                first = time.perf_counter() - first
                error = ((got.float() - want).norm() / want.norm()).item()
                ms, timed_as = time_ms(backend, q, k, v, cu, max_seqlen)
            except Exception as e:  # a backend that fails on this layout is reported, not fatal
                entry[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
                continue
            entry[name] = {
                "ms": round(ms, 4),
                "timed_as": timed_as,
                "first_call_s": round(first, 2),
                "tflop_per_s": round(flop / ms / 1e9, 1),
                "rel_error": float(f"{error:.2e}"),
                "graph_replay_equal": graph_replay_matches(backend, q, k, v, cu, max_seqlen),
            }
            print(lname, name, entry[name], flush=True)
        results[lname] = entry
    out = {
        "environment": environment("flash-attn", "flash-attn-4", "nvidia-cutlass-dsl"),
        "shapes": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bf16"},
        "skipped": skipped,
        "layouts": results,
    }
    write_result(args.out, out)


if __name__ == "__main__":
    main()
