"""Calibration: run the FP model on requests and gather each backbone Linear's input statistics, one
decoder layer at a time, so a whole model quantizes with bounded memory.

1. The FP runner decodes the calibration requests with a short schedule (CALIB_DECODE_STEPS) and the
   packed batches the model sees at a few of its steps are recorded: from all-MASK targets to about half
   decoded, the range the 32-step decode runs through (its time schedule is shifted towards the start).
2. Each recorded batch runs up to the first decoder layer, whose inputs (hidden states and the rest of its
   call arguments) are kept on the device.
3. Layer by layer: the layer runs on the kept hidden states with hooks on its Linears, which accumulate
   H = X^T X, per-channel max |x| and a row sample (LayerStats). The caller quantizes the layer and swaps
   its Linears; the (now quantized) layer then runs again to produce the next layer's inputs, so every
   layer is calibrated on what the quantized layers before it actually produce.
Only one layer's statistics and the hidden states of the recorded batches are alive at any time.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from engine.config import EngineConfig, GenerationConfig
from engine.errors import AudioError, InputError, QuantError
from engine.frontend.audio import ReferenceSettings, read_clip_bytes
from engine.frontend.duration import estimate_target_frames
from engine.frontend.instruct import has_chinese, resolve_instruct
from engine.frontend.prompt import build_prompt
from engine.generate.batching import greedy_batches
from engine.generate.loop import Runner
from engine.generate.packing import GenItem, packed_tokens
from engine.model import OmniVoiceModel, PackedBatch
from engine.quantizer.lowrank import LayerStats

# Calibration decodes with 8 steps (4x cheaper than 32) and records the model inputs of steps 0, 4, 6, 7:
# about 0%, 9%, 23% and 41% of the targets decoded (t_shift 0.1), the states 32-step decoding passes
# through at its steps 0, 16, 24 and 28.
CALIB_DECODE_STEPS = 8
CALIB_STEPS = (0, 4, 6, 7)

_WORDS = (
    "the quick brown fox jumps over a lazy dog while bright morning light fills quiet rooms and distant "
    "voices carry stories of rivers mountains cities music science history weather travel friendship "
    "gardens markets trains bridges libraries oceans forests winter summer evening conversation question "
    "answer remember tomorrow yesterday beautiful careful gentle sudden ancient modern simple important "
    "people children teachers doctors engineers artists neighbours travellers"
).split()


@dataclass
class CalibRequest:
    """One calibration request from a manifest row (reference clip encoded with the checkpoint's codec)."""

    text: str
    ref_audio: str
    ref_text: str
    language: str | None = None
    instruct: str | None = None
    seed: int = 0


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(lo, hi))]
    return " ".join(words).capitalize() + rng.choice([".", "!", "?", "."])


def generated_items(frontend, n: int, num_codebooks: int, codebook_size: int, seed: int) -> list[GenItem]:
    """n seeded voice-clone requests: random sentences, random reference codes of 2-6 s, estimated lengths."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    items = []
    for i in range(n):
        text, ref_text = _sentence(rng, 4, 24), _sentence(rng, 4, 14)
        ref_frames = rng.randint(50, 150)
        ref = torch.randint(0, codebook_size, (num_codebooks, ref_frames), generator=gen)
        language = rng.choice([None, "en"])
        ids = frontend.prompt_ids(text, ref_text, language, None, denoise=True, has_ref=True)
        frames = estimate_target_frames(text, ref_text, ref_frames)
        items.append(GenItem(prompt_ids=ids, ref_tokens=ref, target_len=frames, seed=seed * 100_003 + i))
    return items


def manifest_items(frontend, codec, requests: list[CalibRequest], source: str) -> list[GenItem]:
    """GenItems for manifest rows; rows whose clip or text cannot be used are skipped, and if none is
    usable, QuantError names the first problems."""
    items, problems = [], []
    for i, req in enumerate(requests):
        try:
            prompt = build_prompt(
                read_clip_bytes(req.ref_audio), req.ref_audio, req.ref_text, codec, ReferenceSettings()
            )
            instruct = resolve_instruct(req.instruct, use_zh=has_chinese(req.text)) if req.instruct else None
            ids = frontend.prompt_ids(req.text, req.ref_text, req.language, instruct, True, True)
            frames = estimate_target_frames(req.text, req.ref_text, prompt.tokens.shape[-1])
        except (AudioError, InputError, OSError) as e:
            problems.append(f"row {i}: {e}")
            continue
        items.append(GenItem(prompt_ids=ids, ref_tokens=prompt.tokens, target_len=frames, seed=req.seed))
    if not items:
        shown = "; ".join(problems[:3]) or "it has no rows"
        raise QuantError(
            f"calibration manifest {source} has no usable rows ({shown}). Fix those rows or leave --calib "
            "out to calibrate on generated prompts."
        )
    return items


@torch.inference_mode()
def record_batches(
    model: OmniVoiceModel,
    items: list[GenItem],
    device,
    dtype,
    max_tokens: int = 16384,
    steps: tuple[int, ...] = CALIB_STEPS,
    gen: GenerationConfig | None = None,
) -> list[PackedBatch]:
    """The packed batches the FP model sees at `steps` while decoding `items` (eager runner, no graphs)."""
    gen = gen or GenerationConfig(num_step=CALIB_DECODE_STEPS)
    runner = Runner(model, EngineConfig(cuda_graphs=False, max_batch_tokens=max_tokens), device, dtype)
    recorded, calls = [], [0]

    def keep(module, args):
        if calls[0] % gen.num_step in steps:
            recorded.append(args[0].apply(torch.clone))
        calls[0] += 1

    handle = model.register_forward_pre_hook(keep)
    try:
        for chunk in greedy_batches(items, packed_tokens, max_tokens):
            calls[0] = 0
            runner.generate(chunk, gen)
    finally:
        handle.remove()
    return recorded


class _Stop(Exception):
    pass


@dataclass
class LayerInput:
    """What one decoder layer is called with for one recorded batch: hidden states + the other arguments."""

    hidden: torch.Tensor
    args: tuple
    kwargs: dict


@torch.inference_mode()
def first_layer_inputs(model: OmniVoiceModel, batches: list[PackedBatch]) -> list[LayerInput]:
    """Run each batch up to the first decoder layer and keep that layer's call arguments."""
    first = model.llm.layers[0]
    kept: list[LayerInput] = []

    def grab(module, args, kwargs):
        kept.append(LayerInput(args[0], tuple(args[1:]), dict(kwargs)))
        raise _Stop

    handle = first.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for batch in batches:
            try:
                model(batch)
            except _Stop:
                pass
    finally:
        handle.remove()
    return kept


def layer_linears(layer: nn.Module, prefix: str) -> dict[str, nn.Linear]:
    """Qualified name -> nn.Linear of every (still unquantized) Linear inside a decoder layer."""
    return {f"{prefix}.{n}": m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}


class _StatsHook:
    def __init__(self, in_features: int, sample_per_call: int, device, seed: int):
        self.h = torch.zeros(in_features, in_features, device=device)
        self.absmax = torch.zeros(in_features, device=device)
        self.samples: list[torch.Tensor] = []
        self.rows = 0
        self.sample_per_call = sample_per_call
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, module, args):
        x = args[0].reshape(-1, args[0].shape[-1]).float()
        self.h.addmm_(x.T, x)
        self.absmax = torch.maximum(self.absmax, x.abs().amax(0))
        take = torch.randperm(x.shape[0], generator=self.gen)[: self.sample_per_call].to(x.device)
        self.samples.append(x.index_select(0, take))
        self.rows += x.shape[0]

    def stats(self) -> LayerStats:
        sample = torch.cat(self.samples) if self.samples else self.h.new_zeros(0, self.h.shape[0])
        return LayerStats(hessian=self.h, absmax=self.absmax, sample=sample, rows=self.rows)


def run_layer(layer: nn.Module, inputs: list[LayerInput]) -> None:
    """Run a decoder layer on every kept input, replacing each hidden state by the layer's output: the
    residual stream x + delta (a layer returns its last block's output apart, for the next norm to add)."""
    for inp in inputs:
        x, delta = layer(inp.hidden, *inp.args, **inp.kwargs)
        inp.hidden = x if delta is None else x + delta


@torch.inference_mode()
def calibrate_layers(
    model: OmniVoiceModel,
    inputs: list[LayerInput],
    quantize_layer: Callable[[int, dict[str, nn.Linear], dict[str, LayerStats]], None],
    sample_rows: int = 512,
    progress: Callable[[range], Iterable[int]] = lambda r: r,
) -> None:
    """Walk the decoder layers: gather stats of layer i's Linears, call quantize_layer(i, linears, stats)
    (which swaps the Linears), then advance the kept hidden states through the quantized layer."""
    per_call = max(1, math.ceil(sample_rows / max(1, len(inputs))))
    for i in progress(range(len(model.llm.layers))):
        layer = model.llm.layers[i]
        linears = layer_linears(layer, f"llm.layers.{i}")
        hooks = {
            name: _StatsHook(lin.in_features, per_call, lin.weight.device, seed=i)
            for name, lin in linears.items()
        }
        handles = [lin.register_forward_pre_hook(hooks[name]) for name, lin in linears.items()]
        try:
            for inp in inputs:  # on a copy: the layer adds its attention output into x in place
                layer(inp.hidden.clone(), *inp.args, **inp.kwargs)
        finally:
            for handle in handles:
                handle.remove()
        stats = {name: hook.stats() for name, hook in hooks.items()}
        del hooks
        quantize_layer(i, linears, stats)
        del stats
        run_layer(layer, inputs)
