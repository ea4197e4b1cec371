"""bench/generate.py's variants: a label turns off the switches its suffixes name, then restores them."""

import os

from bench.generate import SWITCHES, switches_for


def test_a_label_turns_off_what_it_names_and_restores_the_environment(monkeypatch):
    monkeypatch.setenv("OVBATCH_FUSED_KERNELS", "0")  # a value set before the run must come back
    monkeypatch.delenv("OVBATCH_GROUPED_PROJECTIONS", raising=False)
    on = {"OVBATCH_FUSED_KERNELS": "1", "OVBATCH_GROUPED_PROJECTIONS": "1", "OVBATCH_SWIGLU_GEMM": "1"}
    expected = {
        "ours_bf16_graphs": on,
        "ours_w4a4_graphs_unfused": {**on, "OVBATCH_FUSED_KERNELS": "0"},
        "ours_bf16_graphs_ungrouped": {**on, "OVBATCH_GROUPED_PROJECTIONS": "0"},
        "ours_w4a4_graphs_silu_mul": {**on, "OVBATCH_SWIGLU_GEMM": "0"},
    }
    for label, want in expected.items():
        with switches_for(label):
            assert {name: os.environ[name] for name in SWITCHES.values()} == want
    assert os.environ["OVBATCH_FUSED_KERNELS"] == "0"
    assert "OVBATCH_GROUPED_PROJECTIONS" not in os.environ
