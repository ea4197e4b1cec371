"""bench/generate.py's variants: a label turns off the fast paths its suffixes name, and only those."""

import torch

from bench.generate import fast_paths_for, token_agreement
from engine.config import FastPaths


def test_a_label_turns_off_what_it_names():
    assert fast_paths_for("ours_bf16_graphs") == FastPaths()
    assert fast_paths_for("ours_w4a4_graphs_unfused") == FastPaths(fused_kernels=False)
    assert fast_paths_for("ours_bf16_graphs_ungrouped") == FastPaths(grouped_projections=False)
    assert fast_paths_for("ours_w4a4_graphs_silu_mul") == FastPaths(swiglu_gemm=False)


def test_token_agreement_counts_equal_codes_over_all_requests():
    reference = [torch.zeros(8, 10, dtype=torch.long), torch.ones(8, 30, dtype=torch.long)]
    same = [t.clone() for t in reference]
    assert token_agreement(same, reference) == 1.0
    same[1][:, :15] = 7  # half of the second request's 240 codes, of 320
    assert token_agreement(same, reference) == (320 - 120) / 320
