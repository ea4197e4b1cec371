"""How much of a job's CUDA-graph work is padding, by how a shard's rows are cut into batches.

The end-to-end run's job (bench/e2e.py: the same distinct-clip manifest, its seed and row count, the full
size model's configs, its buckets and max_batch_tokens) is planned on this machine's CPU (planning reads
no weights), and each shard's rows are cut both ways: even_batches (batches of about equal tokens, the
packer before) and pack_batches (bucket_batches: batches that fill their graph buckets). A batch runs at
its bucket's size, so padding = 1 - packed tokens / bucket tokens; cost adds BATCH_COST_TOKENS a batch.

    python bench/packing.py [--rows 6000] [--out bench/results/packing-cpu.json]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.e2e import SETTINGS, padding_fraction  # noqa: E402
from bench.environment import environment, write_result  # noqa: E402
from bench.manifests import write_distinct_clip_manifest  # noqa: E402
from bench.pipeline import full_size_configs  # noqa: E402
from engine.generate.batching import BATCH_COST_TOKENS, bucket_for, even_batches  # noqa: E402
from pipeline.config import load_job_config  # noqa: E402
from pipeline.job import plan_job  # noqa: E402
from pipeline.rows import RequestRow  # noqa: E402
from pipeline.shard_runner import pack_batches  # noqa: E402
from pipeline.sizing import frontend_sizer  # noqa: E402


def packer_entry(name: str, batches: list[int], buckets: list[int]) -> dict:
    """batches: the packed tokens of each batch."""
    graph_tokens = sum(bucket_for(tokens, buckets) or tokens for tokens in batches)
    return {
        "packer": name,
        "batches": len(batches),
        "packed_tokens": sum(batches),
        "graph_tokens": graph_tokens,
        "padding_fraction": padding_fraction(batches, buckets),
        "cost_over_tokens": round((graph_tokens + BATCH_COST_TOKENS * len(batches)) / sum(batches) - 1, 4),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=6000)
    p.add_argument("--out", default="bench/results/packing-cpu.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ovbatch-packing-") as tmp:
        work = Path(tmp)
        ckpt = full_size_configs(work / "ckpt")
        manifest = write_distinct_clip_manifest(work / "m.parquet", work / "clips", args.rows, seed=1)
        size = [s for s in SETTINGS["full"] if not s.startswith("engine.device=")]  # its buckets and budget
        cfg = load_job_config(None, [f"engine.checkpoint={ckpt}", "engine.device=cpu", *size])
        cfg.manifest = str(manifest)
        plan, rows = plan_job(cfg, frontend_sizer, clip_dir=None)
    engine_cfg = cfg.engine_config(cfg.variant_names()[0])
    by_id = {r.id: r for r in rows}
    even, filled = [], []
    for shard in plan.shards:
        requests = sorted((RequestRow.of(by_id[r.id], r) for r in shard.rows), key=lambda r: -r.packed_tokens)
        even += [
            sum(r.packed_tokens for r in b)
            for b in even_batches(requests, lambda r: r.packed_tokens, engine_cfg.max_batch_tokens)
        ]
        filled += [sum(r.packed_tokens for r in b) for b in pack_batches(requests, engine_cfg)]
    buckets = list(engine_cfg.buckets)
    result = {
        "bench": "packing",
        "rows": len(rows),
        "shards": len(plan.shards),
        "buckets": buckets,
        "max_batch_tokens": engine_cfg.max_batch_tokens,
        "batch_cost_tokens": BATCH_COST_TOKENS,
        "entries": [
            packer_entry("even_batches", even, buckets),
            packer_entry("bucket_batches", filled, buckets),
        ],
        "environment": environment(),
    }
    for e in result["entries"]:
        print(e)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
