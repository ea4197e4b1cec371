"""bench/generate.py's variants: a label turns off the fast paths its suffixes name, and only those."""

from bench.generate import fast_paths_for
from engine.config import FastPaths


def test_a_label_turns_off_what_it_names():
    assert fast_paths_for("ours_bf16_graphs") == FastPaths()
    assert fast_paths_for("ours_w4a4_graphs_unfused") == FastPaths(fused_kernels=False)
    assert fast_paths_for("ours_bf16_graphs_ungrouped") == FastPaths(grouped_projections=False)
    assert fast_paths_for("ours_w4a4_graphs_silu_mul") == FastPaths(swiglu_gemm=False)
