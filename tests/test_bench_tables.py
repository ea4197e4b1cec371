"""The benchmark tables in README.md and docs/ show what the committed JSON results hold."""

from pathlib import Path

import pytest

from bench.tables import GENERATE_CASES, e2e_rows, generate_rows, tables

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


@pytest.mark.parametrize("name", list(tables()))
def test_documented_rows_match_the_results(name):
    document, rows = tables()[name]
    text = (REPO / document).read_text()
    stale = [row for row in rows if row not in text.splitlines()]
    assert not stale, f"{document}'s {name} table differs from bench/results: rerun bench/tables.py; {stale}"


def test_every_result_file_is_read_by_the_docs_the_tables_or_a_test():
    """bench/results/ holds one canonical result per benchmark, each read by something; git keeps the rest."""
    readers = [REPO / "README.md", REPO / "bench" / "tables.py", *sorted((REPO / "docs").glob("*.md"))]
    readers += [p for p in sorted((REPO / "tests").rglob("*.py")) if p.resolve() != Path(__file__).resolve()]
    text = "\n".join(p.read_text() for p in readers)
    unread = sorted(p.name for p in RESULTS.iterdir() if p.name not in text)
    assert not unread, f"bench/results/ files no doc, bench/tables.py or test names: {unread}"


def test_generation_row_reads_every_variant():
    case = {
        "official_fp16_eager": {"ms": 1000.4},
        "ours_bf16_eager": {"ms": 300.0},
        "ours_bf16_graphs": {"ms": 100.0, "x_realtime": 60.0},
        "ours_bf16_graphs_ungrouped": {"ms": 110.0},
        "ours_bf16_graphs_unfused": {"ms": 220.0},
        "ours_w4a4_graphs": {"ms": 150.0},
        "ours_w4a4_graphs_silu_mul": {"ms": 155.0},
        "ours_w4a4_graphs_ungrouped": {"ms": 160.0},
        "ours_w4a4_graphs_unfused": {"ms": 300.0},
        "speedup_ours_bf16_graphs": 10.004,
    }
    rows = generate_rows({"cases": dict.fromkeys(GENERATE_CASES, case)})
    want = "| 1 | 1000 | 300 | 100 | 60.0 | 10.00x | 110 | 220 | 150 (1.50x bf16) | 155 | 160 | 300 |"
    assert rows[0] == want


def test_e2e_rows_compare_a_job_only_with_the_engine_over_as_many_rows_in_its_session():
    def entry(variant, rows, x, session="s1"):
        return {
            "variant": variant,
            "rows": rows,
            "audio_seconds": 10.0,
            "wall_seconds": 1.0,
            "x_realtime": x,
            "session": session,
        }

    rows = e2e_rows(
        {
            "entries": [
                entry("engine_bf16", 2000, 80.0),
                entry("job_local_bf16", 2000, 88.0),
                entry("job_ray_bf16", 1000, 60.0),
                entry("job_ray_fp8", 2000, 90.0),
                entry("engine_fp8", 2000, 70.0, session="s2"),
            ]
        }
    )
    ratios = {r.split(" | ")[0].strip("| "): r.split(" | ")[5] for r in rows}
    assert ratios == {
        "engine_bf16": "1.00",
        "job_local_bf16": "1.10",
        "job_ray_bf16": "-",
        "engine_fp8": "1.00",
        "job_ray_fp8": "-",
    }


def test_e2e_rows_show_an_entry_that_did_not_run_and_why():
    skipped = {"variant": "official_fp16_b64", "skipped": "CUDA out of memory at batch 64: ..."}
    cells = e2e_rows({"entries": [skipped]})[0].strip("| ").split(" | ")
    assert cells[0] == "official_fp16_b64" and cells[4] == "out of GPU memory"
    assert len(cells) == 12 and set(cells[1:4] + cells[5:]) == {"-"}


def test_e2e_rows_order_the_official_batches_by_size_then_each_precisions_engine_and_jobs():
    variants = [
        "job_ray_fp8",
        "official_fp16_b16",
        "engine_fp8",
        "official_fp16_b8",
        "job_local_bf16",
        "engine_bf16",
    ]
    run = {"rows": 10, "audio_seconds": 10.0, "wall_seconds": 1.0, "x_realtime": 10.0}
    entries = [
        {"variant": v, "skipped": "out of memory"} if "official" in v else {"variant": v, **run}
        for v in variants
    ]
    order = [row.strip("| ").split(" | ")[0] for row in e2e_rows({"entries": entries})]
    assert order == [
        "official_fp16_b8",
        "official_fp16_b16",
        "engine_bf16",
        "job_local_bf16",
        "engine_fp8",
        "job_ray_fp8",
    ]
