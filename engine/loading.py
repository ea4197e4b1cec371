"""Load a checkpoint into an OmniVoiceModel ready to run: read the official layout or a W4A4 checkpoint,
choose each Linear's implementation (DenseLinear, W4A4Linear), merge q/k/v and gate/up once, and fix the
fast-path switches (EngineConfig's fused_kernels, grouped_projections, swiglu_gemm, w4a4_backend).

A W4A4 checkpoint (written by `ovbatch quantize`) is the official layout with the Linears named in
config.json["quantization"]["layers"] stored as canonical W4A4 tensors; every other tensor loads as in an
official checkpoint, cast to the requested dtype.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from engine.checkpoint import (
    check_shapes,
    read_config,
    read_tensors,
    resolve_checkpoint,
    tensor_shapes,
    weight_files,
)
from engine.config import FastPaths, ModelConfig
from engine.errors import QuantError
from engine.fp8.linear import Fp8Linear
from engine.model import DenseLinear, Linear, LinearFactory, OmniVoiceModel, default_linear
from engine.w4a4.format import FORMAT_VERSION, QuantMeta, W4A4Tensors, read_w4a4_safetensors
from engine.w4a4.linear import W4A4Group, W4A4Linear

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"


class LoadTimer:
    """Seconds of each named phase of a load. On CUDA a phase ends with a synchronize, so that device work
    counts in the phase that launched it."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds[name] = time.perf_counter() - start


def load_model(
    path_or_repo: str | os.PathLike,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    linear_factory: LinearFactory | None = None,
    attention: str = "auto",
    fast_paths: FastPaths | None = None,
    fp8: bool = False,
    timer: LoadTimer | None = None,
) -> tuple[ModelConfig, OmniVoiceModel]:
    """Read a checkpoint (official or W4A4) into an OmniVoiceModel on `device` in `dtype`, in eval mode,
    with `fast_paths` fixed (None: the defaults, all on); `fp8`: the backbone Linears of an unquantized
    checkpoint become Fp8Linear (weights quantized here, per output channel). `timer` gets the seconds of
    the phases weights, fp8 (if any) and merge (prepare_for_inference)."""
    timer = timer or LoadTimer(device)
    ckpt_dir = resolve_checkpoint(path_or_repo)
    cfg, raw = read_config(ckpt_dir)
    if "quantization" in raw:
        if fp8:
            raise QuantError(f"{ckpt_dir} is a W4A4 checkpoint; fp8 is made from an unquantized one.")
        with timer.phase("weights"):
            model = build_w4a4_model(ckpt_dir, cfg, device=device, dtype=dtype, attention=attention)
    else:
        with timer.phase("weights"):
            files = weight_files(ckpt_dir)
            with torch.device("meta"):
                model = OmniVoiceModel(cfg, linear_factory=linear_factory, attention=attention)
            expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
            check_shapes(expected, tensor_shapes(files), files[0] if len(files) == 1 else ckpt_dir)
            model.load_state_dict(read_tensors(files, device, dtype), strict=True, assign=True)
            model.requires_grad_(False)
        if fp8:
            with timer.phase("fp8"):
                backbone_to_fp8(model)
        log.info("loaded %s (%s%s on %s)", ckpt_dir, dtype, ", fp8 Linears" if fp8 else "", device)
    with timer.phase("merge"):
        model = prepare_for_inference(model.eval(), fast_paths)
    return cfg, model


def backbone_to_fp8(model: OmniVoiceModel) -> OmniVoiceModel:
    """Replace every dense Linear of the backbone (`llm.layers.*`) by its Fp8Linear, in place; embeddings,
    norms and the audio heads stay in the model's dtype."""
    for name, module in list(model.named_modules()):
        if isinstance(module, DenseLinear) and name.startswith("llm.layers."):
            parent, child = name.rsplit(".", 1)
            setattr(model.get_submodule(parent), child, Fp8Linear.from_dense(module))
    return model


def prepare_for_inference(model: OmniVoiceModel, fast_paths: FastPaths | None = None) -> OmniVoiceModel:
    """Fix the fast-path switches on every module that reads them, then merge q/k/v and gate/up where
    `grouped_projections` is on and their implementation can."""
    fast_paths = fast_paths or FastPaths()
    for module in model.modules():
        if hasattr(module, "fused"):
            module.fused = fast_paths.fused_kernels
        if isinstance(module, Linear):
            module.swiglu_gemm, module.qkv_rope_gemm = fast_paths.swiglu_gemm, fast_paths.qkv_rope_gemm
        if isinstance(module, W4A4Linear | W4A4Group):
            module.backend_name = fast_paths.w4a4_backend
    if fast_paths.grouped_projections:
        model.merge_projections()
    return model


def read_quant_meta(ckpt_dir: Path) -> QuantMeta:
    raw = json.loads((Path(ckpt_dir) / "config.json").read_text())
    if "quantization" not in raw:
        raise QuantError(f"{ckpt_dir}/config.json has no 'quantization' entry: it is not a W4A4 checkpoint.")
    return QuantMeta.from_dict(raw["quantization"], where=f"{ckpt_dir}/config.json")


def build_w4a4_model(
    ckpt_dir: str | Path,
    cfg: ModelConfig,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    attention: str = "auto",
    expected_source_hash: str | None = None,
) -> OmniVoiceModel:
    """An OmniVoiceModel on `device` whose quantized Linears are W4A4Linear; other floats in `dtype`.

    expected_source_hash: when given, the checkpoint must have been quantized from that source
    (engine.checkpoint.checkpoint_fingerprint of the FP checkpoint), else QuantError.
    """
    ckpt_dir = Path(ckpt_dir)
    meta = read_quant_meta(ckpt_dir)
    if expected_source_hash is not None and meta.version < FORMAT_VERSION:
        raise QuantError(
            f"{ckpt_dir} has W4A4 format version {meta.version}, whose source hash is not a checkpoint "
            f"fingerprint, so it cannot be checked against {expected_source_hash}: re-quantize the source "
            "(`ovbatch quantize`) to check where it came from (the checkpoint loads without the check)."
        )
    if expected_source_hash is not None and meta.source_hash != expected_source_hash:
        raise QuantError(
            f"{ckpt_dir} was quantized from source {meta.source_hash}, not from the expected "
            f"{expected_source_hash}: re-quantize the checkpoint you compare against (`ovbatch quantize`)."
        )
    state, _ = read_w4a4_safetensors(ckpt_dir / WEIGHTS, expected=meta)
    quantized = set(meta.layers)
    layers = {name: W4A4Tensors.from_state(name, state) for name in quantized}

    def factory(name: str, in_features: int, out_features: int) -> nn.Module:
        if name not in layers:
            return default_linear(name, in_features, out_features)
        t = layers[name]
        if (t.in_features, t.out_features) != (in_features, out_features):
            raise QuantError(
                f"{name}: W4A4 tensors are {t.out_features}x{t.in_features}, the model needs "
                f"{out_features}x{in_features}; the checkpoint does not match its config.json."
            )
        return W4A4Linear(
            in_features, out_features, t.rank, smooth=t.smooth is not None, bias=t.bias is not None
        )

    with torch.device("meta"):
        model = OmniVoiceModel(cfg, linear_factory=factory, attention=attention)
    unknown = quantized - {n for n, m in model.named_modules() if isinstance(m, W4A4Linear)}
    if unknown:
        raise QuantError(
            f"config.json lists quantized layers the model does not have: {sorted(unknown)[:4]}."
        )
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise QuantError(
            f"{ckpt_dir / WEIGHTS} does not match the model: missing {missing[:4]}, unexpected {extra[:4]}; "
            "re-run `ovbatch quantize`."
        )
    loaded = {}
    for name, t in state.items():
        keep = (
            expected[name].dtype
            if not expected[name].is_floating_point() or _is_w4a4(name, quantized)
            else dtype
        )
        loaded[name] = t.to(device=device, dtype=keep)
    model.load_state_dict(loaded, strict=True, assign=True)
    model.requires_grad_(False)
    log.info(
        "loaded W4A4 checkpoint %s (%d quantized Linears, rank %d) on %s",
        ckpt_dir,
        len(quantized),
        meta.rank,
        device,
    )
    return model.eval()


def _is_w4a4(name: str, quantized: set[str]) -> bool:
    return name.rsplit(".", 1)[0] in quantized
