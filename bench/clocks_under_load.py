"""SM clock and board power while one kernel runs back to back (docs/kernels.md, Floors: the loop ceiling).

bench/kernels.py times short bursts; a batch job keeps the GPU busy, where the board's power cap can lower
the clock, by how much depending on the kernel. Here the W4A4 GEMM, its quantize kernel, the whole W4A4
linear, cuBLAS bf16 and torch._scaled_mm fp8 each replay a CUDA graph of many calls for a few seconds while
nvidia-smi samples the SM clock, the power draw and the active clock-event reasons (the driver's reasons for
a clock below the maximum). Reported per workload: the sustained time of one call, the median clock and
power of the samples, the reasons seen. With --probe, the configurations of bench/gemm_loop_ceiling.cu are
sampled the same way, and their SM cycles per group follow from the sampled clock.

    python bench/clocks_under_load.py [--out bench/results/clocks-under-load-h200.json] [--shapes qkv:8192] \
        [--probe /tmp/gemm_loop_ceiling]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.environment import environment, write_result  # noqa: E402
from bench.kernels import LAYERS, random_layer  # noqa: E402
from engine.kernels import CudaW4A4Backend  # noqa: E402
from engine.kernels import ops as kops  # noqa: E402

CALLS_PER_GRAPH = 20
# nvidia-smi's clock-event reason bits (nvmlClocksEventReasons).
REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
QUERY = "clocks.sm,power.draw,clocks_event_reasons.active"


def smi(query: str) -> str:
    cmd = ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()


def reason_names(mask: int) -> list[str]:
    return [name for bit, name in REASONS.items() if mask & bit] or ["none"]


class Sampler:
    """nvidia-smi sampling every 100 ms in the background; each sample stamped with its arrival time."""

    def __enter__(self) -> Sampler:
        self.samples: list[tuple[float, list[str]]] = []
        self.process = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "100"],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        return self

    def _read(self) -> None:
        for line in self.process.stdout:
            self.samples.append((time.time(), [v.strip() for v in line.split(",")]))

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        self.reader.join(timeout=5)

    def summary(self, start: float, end: float) -> dict:
        """The samples of the second half of [start, end] (the first may predate the clocks settling)."""
        kept = [v for t, v in self.samples if (start + end) / 2 <= t <= end]
        if not kept:
            return {"samples": 0}
        clocks = [float(v[0]) for v in kept]
        masks = {int(v[2], 16) for v in kept}
        return {
            "sm_clock_mhz_median": statistics.median(clocks),
            "sm_clock_mhz_range": [min(clocks), max(clocks)],
            "power_w_median": statistics.median(float(v[1]) for v in kept),
            "clock_event_reasons": sorted({name for mask in masks for name in reason_names(mask)}),
            "samples": len(kept),
        }


def sustained(fn, seconds: float, sampler: Sampler) -> dict:
    """Replay a graph of CALLS_PER_GRAPH calls of fn for `seconds`: the time of one call and the samples."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    replays, start = 0, time.time()
    while time.time() - start < seconds:
        for _ in range(10):
            graph.replay()
        replays += 10
        torch.cuda.synchronize()
    end = time.time()
    us_per_call = 1e6 * (end - start) / (replays * CALLS_PER_GRAPH)
    return {"us_per_call": round(us_per_call, 2), **sampler.summary(start, end)}


def probe_rows(binary: Path, seconds: float, sampler: Sampler) -> list[dict]:
    """bench/gemm_loop_ceiling.cu's rows, each run for `seconds`, with the samples taken meanwhile and the SM
    cycles per warpgroup and K group they imply."""
    run = subprocess.run([str(binary), str(seconds)], capture_output=True, text=True, check=True)
    out = json.loads(run.stdout)
    rows = []
    for row in out["rows"]:
        row.update(sampler.summary(row["wall_start"], row["wall_end"]))
        if row["samples"]:
            row["sm_cycles_per_group"] = sm_cycles_per_group(row, out["sms"])
        rows.append(row)
    return rows


def sm_cycles_per_group(row: dict, sms: int) -> float:
    """One SM's cycles per warpgroup and K group (2 * weight_rows * bm * 64 operations) at the row's rate and
    clock."""
    seconds_per_group = 2 * row["weight_rows"] * row["bm"] * 64 / (row["tops"] * 1e12 / sms)
    return round(seconds_per_group * row["sm_clock_mhz_median"] * 1e6, 1)


def workloads(shape: str, g: torch.Generator) -> dict:
    layer, m = shape.split(":")
    m = int(m)
    n, k = LAYERS[layer]
    backend = CudaW4A4Backend()
    p = backend.prepare(random_layer(n, k, g))
    x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).bfloat16()
    x8, w8 = x.to(torch.float8_e4m3fn), (w * 50).to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    ops = kops.load()
    quant = lambda: ops.quantize_act_lora_down(x, p.smooth, p.pd_t[torch.bfloat16])
    qact, aratios, amax, lora = quant()
    return {
        "w4a4_gemm": lambda: ops.gemm_lora_up(
            qact, aratios, amax, lora, p.qweight, p.wscales, p.proj_up, None, m, n, x.dtype
        ),
        "w4a4_quantize": quant,
        "w4a4_linear": lambda: backend.forward(x, p),
        "bf16": lambda: x @ w.t(),
        "fp8": lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/clocks-under-load-h200.json"))
    parser.add_argument("--shapes", nargs="+", default=["qkv:8192", "gate_up:8192"], help="layer:M")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--probe", type=Path, help="a build of bench/gemm_loop_ceiling.cu to sample as well")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/clocks_under_load.py needs a CUDA GPU", file=sys.stderr)
        return 1
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, probe = [], []
    with Sampler() as sampler:
        for shape in args.shapes:
            for name, fn in workloads(shape, g).items():
                rows.append({"shape": shape, "workload": name, **sustained(fn, args.seconds, sampler)})
                print(rows[-1], flush=True)
        if args.probe is not None:
            probe = probe_rows(args.probe, args.seconds, sampler)
            for row in probe:
                print(row, flush=True)
    limits = smi("power.limit,clocks.max.sm").split(",")
    result = {
        "environment": environment("triton"),
        "power_limit_w": float(limits[0]),
        "max_sm_clock_mhz": float(limits[1]),
        "notes": f"CUDA graphs of {CALLS_PER_GRAPH} calls replayed for {args.seconds} s each; nvidia-smi "
        "samples every 100 ms, the second half kept. Rank 32, smoothing, bf16.",
        "rows": rows,
        "loop_ceiling_rows": probe,
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
