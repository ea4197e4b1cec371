"""Calibration walks the decoder layers on exactly the hidden states the FP model computes (review)."""

import pytest
import torch
from torch import nn

from engine.config import FastPaths
from engine.frontend.text import TextFrontend
from engine.loading import load_model
from engine.quantizer.calibrate import (
    calibrate_layers,
    first_layer_inputs,
    generated_items,
    layer_linears,
    record_batches,
)
from engine.tiny import ensure_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_fp():
    src = ensure_tiny_checkpoint()
    _, model = load_model(
        src, device="cpu", dtype=torch.float32, fast_paths=FastPaths(grouped_projections=False)
    )
    frontend = TextFrontend(src / "tokenizer.json")
    items = generated_items(frontend, 2, model.cfg.num_audio_codebook, model.cfg.audio_vocab_size - 1, seed=0)
    batches = record_batches(model, items, "cpu", torch.float32, steps=(0,))
    return model, batches


def _fp_inputs(model, batch) -> dict[str, torch.Tensor]:
    """Every backbone Linear's input in a plain FP forward of `batch`."""
    seen, handles = {}, []
    for i, layer in enumerate(model.llm.layers):
        for name, lin in layer_linears(layer, f"llm.layers.{i}").items():
            hook = lambda module, args, name=name: seen.setdefault(name, args[0].clone())  # noqa: E731
            handles.append(lin.register_forward_pre_hook(hook))
    try:
        with torch.inference_mode():
            model(batch)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def test_layer_statistics_are_taken_on_the_fp_models_inputs(tiny_fp):
    model, batches = tiny_fp
    expected = [_fp_inputs(model, batch) for batch in batches]
    inputs = first_layer_inputs(model, batches)
    hessians = {}

    def keep(i: int, linears: dict[str, nn.Linear], stats) -> None:  # quantizes nothing
        hessians.update({name: s.hessian.clone() for name, s in stats.items()})

    calibrate_layers(model, inputs, keep)
    assert len(hessians) == 7 * len(model.llm.layers)
    for name, h in hessians.items():
        want = sum(
            x.reshape(-1, x.shape[-1]).T @ x.reshape(-1, x.shape[-1]) for x in (e[name] for e in expected)
        )
        torch.testing.assert_close(h, want, rtol=1e-4, atol=1e-4, msg=name)


def test_calibration_hands_each_layer_the_previous_layers_full_output(tiny_fp):
    model, batches = tiny_fp
    with torch.inference_mode():
        want = [model.hidden_states(batch) for batch in batches]
    inputs = first_layer_inputs(model, batches)
    calibrate_layers(model, inputs, lambda i, linears, stats: None)
    for inp, w in zip(inputs, want):
        torch.testing.assert_close(inp.hidden, w, rtol=1e-5, atol=1e-5)
