"""Load a W4A4 checkpoint directory (written by `ovbatch quantize`) into an OmniVoiceModel.

The backbone Linears named in config.json["quantization"]["layers"] become W4A4Linear (their buffers
are the stored canonical tensors); every other tensor loads as in an official checkpoint, cast to the
requested dtype. engine.checkpoint.load_model calls this when config.json carries "quantization".
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from engine.config import ModelConfig
from engine.errors import QuantError
from engine.model import OmniVoiceModel, default_linear
from engine.quant.format import FORMAT_VERSION, QuantMeta, W4A4Tensors, read_w4a4_safetensors
from engine.quant.linear import W4A4Linear

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"


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
