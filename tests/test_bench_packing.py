"""bench/packing.py's arithmetic: graph tokens are each batch's bucket (its own size above them all)."""

from bench.packing import packer_entry
from engine.generate.batching import BATCH_COST_TOKENS


def test_packer_entry_counts_buckets_padding_and_cost():
    e = packer_entry("x", [3000, 4096, 5000], [1024, 4096])  # 4096 + 4096 + 5000 (eager)
    assert e["graph_tokens"] == 13192 and e["packed_tokens"] == 12096 and e["batches"] == 3
    assert e["padding_fraction"] == round(1 - 12096 / 13192, 4)
    assert e["cost_over_tokens"] == round((13192 + 3 * BATCH_COST_TOKENS) / 12096 - 1, 4)
