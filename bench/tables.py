"""The benchmark tables of README.md and docs/, printed from committed JSON.

After a benchmark rewrites its file under bench/results/ (generate, profile-generate, kernels, ...), run
`python bench/tables.py` and paste each table over its old rows; tests/test_bench_tables.py fails while a
document still shows rows the JSON does not hold.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.floors import (  # noqa: E402
    gemm_floor_us,
    gemm_issue_floor_us,
    quantize_floor_us,
    quantize_issue_floor_us,
)

RESULTS = Path(__file__).resolve().parent / "results"
GENERATE_CASES = {"B1": "1", "B8_same": "8, same lengths", "B16_vary": "16, varied", "B32_vary": "32, varied"}
LAYERS = ("qkv", "o", "gate_up", "down")


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def torch_vs_ours(r: dict, speedup_digits: int) -> str:
    return f"{r['torch_us']:.1f} / {r['fused_us']:.1f} ({r['speedup_fused_vs_torch']:.{speedup_digits}f}x)"


def generate_rows(result: dict) -> list[str]:
    """README: generation speed against the official package, one row per batch case."""
    rows = []
    for key, label in GENERATE_CASES.items():
        case = result["cases"][key]
        ms = {name: round(v["ms"]) for name, v in case.items() if isinstance(v, dict) and "ms" in v}
        w4a4_ratio = case["ours_w4a4_graphs"]["ms"] / case["ours_bf16_graphs"]["ms"]
        rows.append(
            row(
                label,
                ms["official_fp16_eager"],
                ms["ours_bf16_eager"],
                ms["ours_bf16_graphs"],
                case["ours_bf16_graphs"]["x_realtime"],
                f"{case['speedup_ours_bf16_graphs']:.2f}x",
                ms["ours_bf16_graphs_ungrouped"],
                ms["ours_bf16_graphs_unfused"],
                f"{ms['ours_w4a4_graphs']} ({w4a4_ratio:.2f}x bf16)",
                ms["ours_w4a4_graphs_silu_mul"],
                ms["ours_w4a4_graphs_ungrouped"],
                ms["ours_w4a4_graphs_unfused"],
            )
        )
    return rows


def precision_rows(result: dict) -> list[str]:
    """README: bf16, W4A4 and FP8 generation (CUDA graphs) in one profile run, FP8's device time split."""
    rows = []
    for key, case in result["cases"].items():
        v = case["variants"]
        bf16, w4a4, fp8 = (v[f"{p}_graphs"]["wall_ms"] for p in ("bf16", "w4a4", "fp8"))
        shares = v["fp8_graphs"]["categories"]
        split = " / ".join(
            f"{100 * shares[c]['share']:.0f}%"
            for c in ("dense_gemm", "attention", "fp8_quantize", "norm_rope_elementwise")
        )
        rows.append(
            row(
                GENERATE_CASES[key],
                case["packed_tokens"],
                f"{bf16:.0f} ({case['audio_s'] / bf16 * 1e3:.0f}x)",
                f"{w4a4:.0f} ({case['audio_s'] / w4a4 * 1e3:.0f}x)",
                f"{fp8:.0f} ({case['audio_s'] / fp8 * 1e3:.0f}x)",
                f"{bf16 / fp8:.2f}x",
                split,
            )
        )
    return rows


def kernel_summary_rows(result: dict) -> list[str]:
    """docs/benchmarks.md: whole W4A4 linear / cuBLAS bf16 / FP8 per M and layer."""
    by_key = {(r["M"], r["layer"]): r for r in result["rows"]}

    def cell(r: dict) -> str:
        return f"{r['w4a4_us']:.0f} / {r['bf16_us']:.0f} / {r['fp8_us']:.0f} us ({r['speedup_vs_bf16']:.2f}x)"

    return [
        row(m, *(cell(by_key[m, layer]) for layer in LAYERS))
        for m in sorted({r["M"] for r in result["rows"]})
    ]


def floor_rows(result: dict) -> list[str]:
    """docs/kernels.md: the two kernels' floors (bytes, tensor-core time, loop instructions at full issue
    rate) against the 1.5x-over-bf16 target's budget, and each kernel's measured time over its floor."""
    out = []
    for r in result["rows"]:
        m, n, k = r["M"], r["N"], r["K"]
        quantize, gemm, budget = quantize_floor_us(m, k), gemm_floor_us(m, n, k), r["bf16_us"] / 1.5
        gemm_issue, quantize_issue = gemm_issue_floor_us(m, n, k), quantize_issue_floor_us(m, k)
        out.append(
            row(
                m,
                r["layer"],
                f"{budget:.1f}",
                f"{quantize:.1f}",
                f"{gemm:.1f}",
                f"{gemm_issue:.1f}",
                f"{(quantize + gemm) / budget:.2f}",
                f"{(quantize_issue + gemm_issue) / budget:.2f}",
                f"{r['quantize_us'] / quantize:.1f}x",
                f"{r['gemm_us'] / gemm:.1f}x",
                f"{r['gemm_us'] / gemm_issue:.1f}x",
            )
        )
    return out


def _fused_case(result: dict, m: int, case: str) -> dict:
    return next(r for r in result["rows"] if r.get("M") == m and r["case"] == case)


def _token_counts(result: dict) -> list[int]:
    """The M (tokens) of the model's rows; the codec's Snake rows have a shape instead."""
    return sorted({r["M"] for r in result["rows"] if "M" in r})


def fused_rows(result: dict) -> list[str]:
    """docs/benchmarks.md: the fused kernels against torch, and RMSNorm + qkv."""
    rows = []
    for m in _token_counts(result):
        qkv = _fused_case(result, m, "norm_qkv")
        rows.append(
            row(
                m,
                torch_vs_ours(_fused_case(result, m, "rms_norm"), 1),
                torch_vs_ours(_fused_case(result, m, "silu_mul"), 2),
                torch_vs_ours(_fused_case(result, m, "qk_norm_rope"), 1),
                f"{qkv['bf16_us']:.1f} / {qkv['w4a4_unfused_us']:.1f} / {qkv['w4a4_fused_us']:.1f}",
            )
        )
    return rows


def snake_rows(result: dict) -> list[str]:
    """docs/benchmarks.md: the codec's Snake kernel against torch's five ops (float32)."""
    return [
        row(" x ".join(map(str, r["shape"])), torch_vs_ours(r, 2), f"{r['rel_err_fused_vs_torch']:.1g}")
        for r in result["rows"]
        if r["case"] == "snake"
    ]


def group_rows(result: dict) -> list[str]:
    """docs/benchmarks.md: q/k/v and gate/up one by one and as one GEMM, bf16 and W4A4."""
    rows = []
    for m in _token_counts(result):
        for case, label in (("group_qkv", "qkv"), ("group_gate_up", "gate_up")):
            r = _fused_case(result, m, case)
            rows.append(
                row(
                    m,
                    label,
                    f"{r['bf16_separate_us']:.1f}",
                    f"{r['bf16_grouped_us']:.1f}",
                    f"{r['w4a4_separate_us']:.1f}",
                    f"{r['w4a4_grouped_us']:.1f} ({r['w4a4_separate_us'] / r['w4a4_grouped_us']:.2f}x)",
                    f"{r['speedup_w4a4_grouped_vs_bf16_separate']:.2f}x / "
                    f"{r['bf16_grouped_us'] / r['w4a4_grouped_us']:.2f}x",
                )
            )
    return rows


def swiglu_rows(result: dict) -> list[str]:
    """docs/benchmarks.md: RMSNorm -> silu(gate) * up, bf16, W4A4 grouped + silu_mul and the SwiGLU GEMM."""
    rows = []
    for m in _token_counts(result):
        r = _fused_case(result, m, "swiglu")
        rows.append(
            row(
                m,
                f"{r['bf16_us']:.1f}",
                f"{r['w4a4_silu_mul_us']:.1f}",
                f"{r['w4a4_swiglu_gemm_us']:.1f} ({r['w4a4_silu_mul_us'] / r['w4a4_swiglu_gemm_us']:.2f}x)",
                f"{r['speedup_w4a4_swiglu_gemm_vs_bf16']:.2f}x",
            )
        )
    return rows


def residual_rows(result: dict) -> list[str]:
    """docs/benchmarks.md: x + linear(h) for o and down: bf16, W4A4 + torch's add, the add in the epilogue."""
    rows = []
    for m in _token_counts(result):
        for case, label in (("residual_o", "o"), ("residual_down", "down")):
            r = _fused_case(result, m, case)
            rows.append(
                row(
                    m,
                    label,
                    f"{r['bf16_us']:.1f}",
                    f"{r['w4a4_add_us']:.1f}",
                    f"{r['w4a4_fused_us']:.1f} ({r['w4a4_add_us'] / r['w4a4_fused_us']:.2f}x)",
                    f"{r['speedup_w4a4_fused_vs_bf16']:.2f}x",
                )
            )
    return rows


def plan_rows(result: dict) -> list[str]:
    """docs/benchmarks.md: planning manifests whose rows each bring their own clip, and the old planner."""
    out = []
    for e in result["entries"]:
        phases = e["phases_seconds"]
        out.append(
            row(
                f"{e['rows']:,}",
                f"{e['seconds']:.1f}",
                f"{e['seconds_per_1000_rows']:.1f}",
                f"{phases['manifest_and_cut']:.1f} / {phases['clips']:.1f} / {phases['rows']:.1f}",
                f"~{e['baseline_seconds_estimated']:,.0f} ({e['speedup_vs_baseline']:,.0f}x)",
            )
        )
    return out


def fp8_noise_rows(result: dict) -> list[str]:
    """docs/quantization.md: e4m3 variants' step-0 logits cosine to bf16's and fp32's (CPU, random)."""
    total = result["backbone_linears"]
    return [
        row(
            e["variant"],
            e["scales"],
            e["in_bf16"],
            f"{e['e4m3_linears']} / {total}",
            f"{e['cos_vs_bf16']:.5f}",
            f"{e['cos_vs_fp32']:.5f}",
        )
        for e in result["entries"]
    ]


def gemm_epilogue_rows(result: dict, case: str) -> list[str]:
    """docs/benchmarks.md: one bf16 Triton GEMM with its epilogue against cuBLAS + the kernel it replaced,
    per M, and over a generation."""
    out = [
        row(
            f"{r['M']:,}",
            f"{r['before_us']:.1f}",
            f"{r['epilogue_us']:.1f} ({r['speedup']:.2f}x)",
            f"{r['before_rel_err']:.1e} / {r['epilogue_rel_err']:.1e}",
        )
        for r in result["rows"]
        if r["case"] == case
    ]
    ms = result["per_generation_ms"][case]
    return out + [row("a B = 32 generation", f"{ms['before']:.0f} ms", f"{ms['epilogue']:.0f} ms", "")]


def fp8_accumulation_gemm_rows(result: dict) -> list[str]:
    """docs/ARCHITECTURE.md: each backbone FP8 GEMM at generation's M, float32 sums vs fast accumulation."""
    out = []
    for name, r in result["cases"]["18944"]["gemms"].items():
        f32, fast = r["float32"], r["fast_accum"]
        out.append(
            row(
                name,
                f"{r['float32_us']:.1f} / {r['fast_accum_us']:.1f} ({r['speedup_fast_accum']:.2f}x)",
                f"{f32['rel_err']:.1e} / {fast['rel_err']:.1e}",
                f"{f32['worst_bf16_ulps']:.0f} / {fast['worst_bf16_ulps']:.0f}",
            )
        )
    return out


def fp8_accumulation_gate_up_rows(result: dict) -> list[str]:
    """docs/ARCHITECTURE.md: gate/up to down_proj's codes four ways at generation's M."""
    return [
        row(
            label,
            f"{r['us']:.1f} ({r['speedup']:.2f}x)",
            f"{r['h']['rel_err']:.1e}",
            f"{r['h']['worst_bf16_ulps']:.0f}",
        )
        for label, r in result["cases"]["18944"]["gate_up_to_codes"].items()
    ]


def fp8_accumulation_generation_rows(result: dict) -> list[str]:
    """docs/ARCHITECTURE.md: each way of summing over a generation's backbone GEMMs and gate/up's SiLU."""
    return [row(label, f"{ms:.0f}") for label, ms in result["per_generation_ms"].items()]


E2E_KINDS = ("official", "engine", "job_local", "job_ray")


def _e2e_order(entry: dict) -> tuple:
    """The official package first, by batch size, then each precision's engine, local job and Ray job."""
    variant = entry["variant"]
    kind = next(k for k in E2E_KINDS if variant.startswith(k))
    precision = "" if kind == "official" else variant[len(kind) + 1 :]
    batch = variant.rpartition("_b")[2]  # official_fp16_b8 -> "8"
    return (
        kind != "official",
        precision,
        E2E_KINDS.index(kind),
        int(batch) if batch.isdigit() else 0,
        variant,
    )


def e2e_rows(result: dict) -> list[str]:
    """README: the official package, the engine alone and the job from submit to the last row, each entry of
    one run; "vs engine" only against the engine entry of the same precision over the same number of rows,
    measured in the same session (one machine)."""
    entries = result["entries"]
    engine = {
        (e["variant"][len("engine_") :], e["rows"], e.get("session")): e["x_realtime"]
        for e in entries
        if "engine_" in e["variant"]
    }

    def cell(e: dict, key: str, form: str) -> str:
        return "-" if e.get(key) is None else format(e[key], form)

    out = []
    for e in sorted(entries, key=_e2e_order):
        if "skipped" in e:  # e.g. the official package out of GPU memory at a batch size
            reason = "out of GPU memory" if "out of memory" in e["skipped"] else "skipped"
            out.append(row(e["variant"], *["-"] * 3, reason, *["-"] * 7))
            continue
        base = engine.get((e["variant"].split("_")[-1], e["rows"], e.get("session")))
        out.append(
            row(
                e["variant"],
                f"{e['rows']:,}",
                f"{e['audio_seconds']:,.0f}",
                f"{e['wall_seconds']:.1f}",
                f"{e['x_realtime']:.1f}x",
                f"{e['x_realtime'] / base:.2f}" if base else "-",
                cell(e, "gpu_busy", ".0%"),
                cell(e, "gpu_busy_execution", ".0%"),
                cell(e, "mean_sm_clock_mhz", ".0f"),
                cell(e, "padding_fraction", ".1%"),
                cell(e, "planning_seconds", ".1f"),
                cell(e, "startup_seconds", ".1f"),
            )
        )
    return out


def tables() -> dict[str, tuple[str, list[str]]]:
    """Table name -> (the document it lives in, its rows)."""
    generate, kernels, fused = load("generate-h200.json"), load("kernels-h200.json"), load("fused-h200.json")
    accumulation, epilogues = load("fp8-accumulation-h100.json"), load("gemm-epilogues-h100.json")
    return {
        "generation": ("README.md", generate_rows(generate)),
        "precisions": ("README.md", precision_rows(load("profile-generate-h200.json"))),
        "generation on the H100": ("README.md", generate_rows(load("generate-h100.json"))),
        "precisions on the H100": ("README.md", precision_rows(load("profile-generate-h100.json"))),
        "W4A4 kernels": ("docs/benchmarks.md", kernel_summary_rows(kernels)),
        "planning": ("docs/benchmarks.md", plan_rows(load("plan-cpu.json"))),
        "end to end": ("README.md", e2e_rows(load("e2e-h200.json"))),
        "end to end on the H100": ("README.md", e2e_rows(load("e2e-h100.json"))),
        "floors": ("docs/kernels.md", floor_rows(kernels)),
        "fused kernels": ("docs/benchmarks.md", fused_rows(fused)),
        "snake": ("docs/benchmarks.md", snake_rows(fused)),
        "groups": ("docs/benchmarks.md", group_rows(fused)),
        "swiglu": ("docs/benchmarks.md", swiglu_rows(fused)),
        "residual": ("docs/benchmarks.md", residual_rows(fused)),
        "fp8 noise": ("docs/quantization.md", fp8_noise_rows(load("fp8-noise-cpu.json"))),
        "bf16 swiglu gemm": ("docs/benchmarks.md", gemm_epilogue_rows(epilogues, "swiglu")),
        "bf16 qkv rope gemm": ("docs/benchmarks.md", gemm_epilogue_rows(epilogues, "qkv_rope")),
        "fp8 accumulation": ("docs/ARCHITECTURE.md", fp8_accumulation_gemm_rows(accumulation)),
        "fp8 gate/up": ("docs/ARCHITECTURE.md", fp8_accumulation_gate_up_rows(accumulation)),
        "fp8 sums per generation": ("docs/ARCHITECTURE.md", fp8_accumulation_generation_rows(accumulation)),
    }


def main() -> None:
    for name, (document, rows) in tables().items():
        print(f"{name} ({document}):")
        print("\n".join(rows), end="\n\n")


if __name__ == "__main__":
    main()
