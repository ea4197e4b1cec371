"""quantize_checkpoint: an official OmniVoice checkpoint -> a W4A4 checkpoint directory (`ovbatch quantize`).

The output is the official layout the engine loads as it is: every backbone Linear's `weight` replaced by
the canonical W4A4 tensors, everything else (embeddings, audio heads, norms, tokenizer, codec) copied
unchanged, config.json["quantization"] describing it, plus quant_report.json: per-layer output errors of
each method stage, and the end-to-end W4A4-vs-FP step-0 logits cosine and 32-step token agreement. The
directory appears atomically (built under a temporary name, renamed when complete).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from engine.checkpoint import (
    checkpoint_fingerprint,
    read_config,
    read_tensors,
    resolve_checkpoint,
    weight_files,
)
from engine.config import EngineConfig, FastPaths, GenerationConfig
from engine.devices import DTYPES, resolve_device
from engine.errors import InputError, QuantError
from engine.frontend.text import TextFrontend
from engine.fsmodes import chmod_tree_as_created
from engine.generate.batching import greedy_batches
from engine.generate.loop import Runner
from engine.generate.packing import GenItem, pack_items, packed_tokens
from engine.loading import load_model
from engine.model import OmniVoiceModel
from engine.quantizer.calibrate import (
    CalibRequest,
    calibrate_layers,
    first_layer_inputs,
    generated_items,
    layer_linears,
    manifest_items,
    record_batches,
)
from engine.quantizer.gptq import GPTQConfig
from engine.quantizer.lowrank import LayerStats, MethodConfig, quantize_siblings
from engine.w4a4.format import (
    SUPPORTED_RANKS,
    QuantMeta,
    W4A4Tensors,
    check_group_multiple,
    write_w4a4_safetensors,
)
from engine.w4a4.linear import W4A4Linear, backend_for

log = logging.getLogger(__name__)

REPORT = "quant_report.json"
EVAL_SEED_OFFSET = 7919  # evaluation prompts are drawn apart from the calibration ones


@dataclass
class QuantizeOptions:
    rank: int = 16
    samples: int = 128  # calibration requests
    eval_requests: int = 8  # held-out requests for the end-to-end comparison
    sample_rows: int = 512  # calibration rows kept per Linear to measure output error
    device: str = "auto"
    dtype: str = "auto"  # activations during calibration and the W4A4-vs-FP check: auto | fp32 | bf16 | fp16
    seed: int = 0
    max_batch_tokens: int = 16384
    stage_report: bool = False  # also measure GPTQ without low-rank per layer (slower)

    def method(self) -> MethodConfig:
        return MethodConfig(rank=self.rank, gptq=GPTQConfig(), stage_report=self.stage_report)


def device_and_dtype(name: str, dtype: str = "auto") -> tuple[torch.device, torch.dtype]:
    """The device, and the activation dtype: bf16 on CUDA and fp32 elsewhere unless asked."""
    try:
        device = resolve_device(name)
    except InputError as e:
        raise QuantError(f"--device {name}: {e}") from None
    if dtype == "auto":
        return device, (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if dtype not in DTYPES:
        raise QuantError(f"dtype {dtype!r}: choose auto, {', '.join(DTYPES)}.")
    return device, DTYPES[dtype]


def check_source(src: Path, out: Path, rank: int) -> tuple[dict, OmniVoiceModel]:
    """Refuse bad input before any work: already quantized, odd shapes, bad rank, existing output."""
    cfg, raw = read_config(src)
    if "quantization" in raw:
        raise QuantError(
            f"{src} is already a W4A4 checkpoint (config.json has 'quantization'); quantize the original "
            "FP checkpoint instead."
        )
    if rank not in SUPPORTED_RANKS:
        raise QuantError(f"--rank {rank}: the W4A4 format supports ranks {SUPPORTED_RANKS}.")
    if out.exists():
        raise QuantError(f"output {out} already exists; pass a new --out directory or remove it first.")
    source, target = src.resolve(), out.resolve()
    if target == source or source in target.parents or target in source.parents:
        raise QuantError(
            f"--out {out} lies inside the source checkpoint {src} (or holds it): pass a directory beside it."
        )
    try:  # the folder the result lands in, made now rather than after the minutes of quantizing
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise QuantError(
            f"--out {out}: its folder cannot be made ({e.strerror}): pass a writable path."
        ) from None
    with torch.device("meta"):
        model = OmniVoiceModel(cfg)
    for i, layer in enumerate(model.llm.layers):
        for name, lin in layer_linears(layer, f"llm.layers.{i}").items():
            check_group_multiple(name, lin.in_features)
    return raw, model


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, new)


class _LayerQuantizer:
    """The calibrate_layers callback: quantize a decoder layer's Linears, swap them, keep the results."""

    def __init__(self, model: OmniVoiceModel, method: MethodConfig, progress=None):
        self.model, self.method, self.progress = model, method, progress
        self.tensors: dict[str, W4A4Tensors] = {}
        self.report: list[dict] = []

    def __call__(self, index: int, linears: dict[str, nn.Linear], stats: dict[str, LayerStats]) -> None:
        layer = self.model.llm.layers[index]
        for names in sibling_groups(layer, f"llm.layers.{index}", list(linears)):
            start = time.perf_counter()
            lins = [linears[name] for name in names]
            results = quantize_siblings(
                [lin.weight.float() for lin in lins],
                stats[names[0]],
                self.method,
                [lin.bias for lin in lins],
                names,
            )
            seconds = (time.perf_counter() - start) / len(names)
            for name, lin, res in zip(names, lins, results):
                _swap(self.model, name, W4A4Linear.from_tensors(res.tensors).to(lin.weight.device))
                self.tensors[name] = res.tensors.to("cpu")
                self.report.append(
                    {
                        "name": name,
                        "shape": [lin.out_features, lin.in_features],
                        "errors": {k: round(v, 6) for k, v in res.errors.items()},
                        "alpha": res.alpha,
                        "screened_alpha": res.screened_alpha,
                        "refits": res.refits,
                        "calib_rows": stats[name].rows,
                        "seconds": round(seconds, 3),
                    }
                )
                if self.progress is not None:
                    self.progress.set_postfix_str(f"{name.split('.', 2)[-1]} err {res.errors['final']:.4f}")


def sibling_groups(layer: nn.Module, prefix: str, names: list[str]) -> list[list[str]]:
    """The Linear names of decoder layer `prefix` in order, each set of siblings the model declares (Linears
    reading one input: `SIBLINGS` on a block) as one group, quantized with one smoothing so that they can
    run as one GEMM."""
    declared = [
        [f"{prefix}.{path}.{member}" for member in block.SIBLINGS]
        for path, block in layer.named_modules()
        if hasattr(block, "SIBLINGS")
    ]
    groups, done = [], set()
    for name in names:
        if name in done:
            continue
        group = next((g for g in declared if name in g and all(n in names for n in g)), [name])
        groups.append(group)
        done.update(group)
    return groups


@torch.inference_mode()
def compare_models(
    fp: OmniVoiceModel, q: OmniVoiceModel, items: list[GenItem], device, dtype, max_tokens: int = 16384
) -> dict:
    """W4A4 vs FP: cosine of step-0 logits per (position, codebook), and 32-step token agreement."""
    cosines = []
    for chunk in greedy_batches(items, packed_tokens, max_tokens):
        batch = pack_items(chunk, fp.cfg.num_audio_codebook, fp.cfg.audio_mask_id).to(device)
        a, b = fp(batch), q(batch)
        cosines.append(F.cosine_similarity(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]), dim=-1))
    cos = torch.cat(cosines).float()
    gen, run_cfg = GenerationConfig(), EngineConfig(cuda_graphs=False, max_batch_tokens=max_tokens)
    same = total = 0
    for chunk in greedy_batches(items, packed_tokens, max_tokens):
        fp_tokens = Runner(fp, run_cfg, device, dtype).generate(chunk, gen)
        q_tokens = Runner(q, run_cfg, device, dtype).generate(chunk, gen)
        for x, y in zip(fp_tokens, q_tokens):
            same += int((x == y).sum())
            total += x.numel()
    return {
        "requests": len(items),
        "logits_cosine_mean": round(float(cos.mean()), 6),
        "logits_cosine_min": round(float(cos.min()), 6),
        "token_agreement": round(same / max(total, 1), 6),
        "steps": gen.num_step,
    }


def write_w4a4_checkpoint(
    tmp: Path, src: Path, raw: dict, quantized: dict[str, W4A4Tensors], meta: QuantMeta
) -> None:
    """Into `tmp`: `src` with the `quantized` Linears' weights replaced by their W4A4 tensors, config.json
    (`raw` plus the quantization metadata) and the source's other files (tokenizer, codec)."""
    state = read_tensors(weight_files(src))
    for name, t in quantized.items():
        state.pop(f"{name}.weight")
        state.pop(f"{name}.bias", None)
        state.update(t.state_dict(name))
    write_w4a4_safetensors(tmp / "model.safetensors", state, meta)
    del state
    (tmp / "config.json").write_text(json.dumps({**raw, "quantization": meta.to_dict()}, indent=2) + "\n")
    for entry in src.iterdir():
        if (
            entry.name == "config.json"
            or entry.name.endswith(".safetensors")
            or entry.name.endswith(".index.json")
        ):
            continue
        if entry.is_dir():
            shutil.copytree(entry, tmp / entry.name)
        else:
            shutil.copy2(entry, tmp / entry.name)


def quantize_checkpoint(
    source: str | os.PathLike,
    out: str | os.PathLike,
    options: QuantizeOptions | None = None,
    calib_requests: list[CalibRequest] | None = None,
    calib_source: str | None = None,
    show_progress: bool = True,
) -> dict:
    """Quantize `source` into the new directory `out`; returns the report (also out/quant_report.json)."""
    options = options or QuantizeOptions()
    started = time.perf_counter()
    src, out = resolve_checkpoint(source), Path(out)
    device, dtype = device_and_dtype(options.device, options.dtype)  # before check_source makes folders
    raw, _ = check_source(src, out, options.rank)
    source_hash = checkpoint_fingerprint(src)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    frontend = TextFrontend(src / "tokenizer.json")
    # calibration records each Linear's inputs, so q/k/v and gate/up stay apart
    _, model = load_model(src, device=device, dtype=dtype, fast_paths=FastPaths(grouped_projections=False))
    c, audio_vocab = model.cfg.num_audio_codebook, model.cfg.audio_vocab_size
    if calib_requests is not None:
        from engine.codec import Codec  # only manifests need it

        codec = Codec.from_dir(src / "audio_tokenizer", device=device)
        items = manifest_items(frontend, codec, calib_requests[: options.samples], calib_source or "manifest")
        del codec
    else:
        items = generated_items(frontend, options.samples, c, audio_vocab - 1, options.seed)
    eval_items = generated_items(
        frontend, options.eval_requests, c, audio_vocab - 1, options.seed + EVAL_SEED_OFFSET
    )

    batches = record_batches(model, items, device, dtype, options.max_batch_tokens)
    inputs = first_layer_inputs(model, batches)
    del batches
    bar = tqdm(
        total=model.cfg.llm.num_hidden_layers, desc="quantize", unit="layer", disable=not show_progress
    )
    quantizer = _LayerQuantizer(model, options.method(), bar)

    def progress(layers):
        for i in layers:
            yield i
            bar.update(1)

    calibrate_layers(model, inputs, quantizer, options.sample_rows, progress)
    bar.close()
    del inputs, model
    if device.type == "cuda":
        torch.cuda.empty_cache()

    settings = {
        **asdict(options),
        "calibration": calib_source or "generated",
        "calib_requests": len(items),
        "method": "gptq + iterative svd low-rank + smoothing search",
    }
    meta = QuantMeta(
        rank=options.rank, source_hash=source_hash, layers=tuple(quantizer.tensors), settings=settings
    )
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write_w4a4_checkpoint(tmp, src, raw, quantizer.tensors, meta)
        _, fp = load_model(src, device=device, dtype=dtype)
        _, q = load_model(tmp, device=device, dtype=dtype)
        end_to_end = compare_models(fp, q, eval_items, device, dtype, options.max_batch_tokens)
        del fp, q
        report = {
            "source": str(src),
            "out": str(out),
            "source_hash": source_hash,
            "device": str(device),
            "dtype": str(dtype).removeprefix("torch."),
            "w4a4_backend": backend_for(device).name,
            "settings": settings,
            "layers": quantizer.report,
            "summary": _summary(quantizer.report),
            "end_to_end": end_to_end,
            "seconds": round(time.perf_counter() - started, 2),
        }
        if device.type == "cuda":
            report["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
        (tmp / REPORT).write_text(json.dumps(report, indent=2) + "\n")
        if out.exists():
            raise QuantError(f"output {out} appeared while quantizing; the result is left unused.")
        chmod_tree_as_created(tmp)  # mkdtemp made it owner-only: others on a shared volume read it too
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def _summary(layers: list[dict]) -> dict:
    stages = layers[0]["errors"].keys() if layers else ()
    common = [s for s in stages if all(s in layer["errors"] for layer in layers)]
    mean = {s: round(sum(layer["errors"][s] for layer in layers) / len(layers), 6) for s in common}
    return {"mean_error": mean, "smoothed_layers": sum(layer["alpha"] is not None for layer in layers)}


def format_report(report: dict) -> str:
    """The per-layer table and the end-to-end lines printed by `ovbatch quantize`."""
    lines = [
        f"{'layer':40s} {'N x K':>11s} {'rtn':>8s} {'final':>8s} {'gain':>6s} {'smooth':>6s} {'refits':>6s}"
    ]
    for layer in report["layers"]:
        e = layer["errors"]
        n, k = layer["shape"]
        alpha = "-" if layer["alpha"] is None else f"{layer['alpha']:g}"
        lines.append(
            f"{layer['name']:40s} {f'{n}x{k}':>11s} {e['rtn']:8.4f} {e['final']:8.4f} "
            f"{e['rtn'] / max(e['final'], 1e-12):5.1f}x {alpha:>6s} {layer['refits']:6d}"
        )
    mean = report["summary"]["mean_error"]
    lines.append(
        "mean relative output error per stage: " + ", ".join(f"{k} {v:.4f}" for k, v in mean.items())
    )
    e2e = report["end_to_end"]
    lines.append(
        f"W4A4 ({report['w4a4_backend']}) vs FP ({report['dtype']}, {e2e['requests']} held-out requests): "
        f"step-0 logits cosine mean "
        f"{e2e['logits_cosine_mean']:.4f} (min {e2e['logits_cosine_min']:.4f}), {e2e['steps']}-step token "
        f"agreement {e2e['token_agreement']:.1%}"
    )
    lines.append(f"wrote {report['out']} in {report['seconds']:.1f} s")
    return "\n".join(lines)
