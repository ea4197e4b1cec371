"""Reading `<checkpoint>/audio_tokenizer/`: config.json and model.safetensors (transformers' names)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import HiggsAudioV2TokenizerConfig

from engine.errors import CheckpointError

MODEL_TYPE = "higgs_audio_v2_tokenizer"


def read_codec_config(path: Path) -> HiggsAudioV2TokenizerConfig:
    """Parse `config.json` of a HiggsAudioV2 tokenizer (transformers' config class, so defaults match)."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} not found: the codec directory needs config.json (official layout: "
            "<checkpoint>/audio_tokenizer/config.json)."
        ) from None
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{path} is not valid JSON ({e}); re-download the audio_tokenizer folder."
        ) from None
    if not isinstance(raw, dict) or raw.get("model_type") != MODEL_TYPE:
        got = raw.get("model_type") if isinstance(raw, dict) else type(raw).__name__
        raise CheckpointError(
            f"{path} has model_type {got!r}, expected {MODEL_TYPE!r}; point the codec at the "
            "audio_tokenizer folder of an OmniVoice checkpoint."
        )
    try:
        cfg = HiggsAudioV2TokenizerConfig.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path} is not a usable HiggsAudioV2 tokenizer config: {e}") from None
    if cfg.sample_rate % cfg.hop_length or cfg.hop_length % 2:
        raise CheckpointError(
            f"{path}: sample_rate {cfg.sample_rate} with hop {cfg.hop_length} (product of "
            "downsampling_ratios) gives no whole, even frame; fix acoustic_model_config.downsampling_ratios."
        )
    return cfg


def training_only_shapes(cfg: HiggsAudioV2TokenizerConfig) -> dict[str, tuple[int, ...]]:
    """Tensors the official file carries that encode/decode never read: the semantic decoder and fc1
    (reconstruction losses), the codebooks' EMA statistics and HuBERT's SpecAugment mask embedding.
    The loader accepts and skips exactly these; the tiny checkpoint writes them to keep the layout."""
    hidden = cfg.semantic_hidden_size
    ratios, k, uk = cfg.channel_ratios, cfg.kernel_size, cfg.unit_kernel_size
    shapes: dict[str, tuple[int, ...]] = {
        "fc1.weight": (hidden, cfg.hidden_size),
        "fc1.bias": (hidden,),
        "semantic_model.masked_spec_embed": (hidden,),
        "decoder_semantic.conv1.weight": (int(hidden * ratios[0]), hidden, k),
        "decoder_semantic.conv2.weight": (hidden, hidden, k),
    }
    for i, stride in enumerate(cfg.strides):
        c_in = int(hidden * ratios[i])
        c_out = int(hidden * ratios[i + 1]) if i < len(ratios) - 1 else hidden
        block = f"decoder_semantic.conv_blocks.{i}"
        if stride == 1:
            shapes[f"{block}.conv.weight"] = (c_out, c_in, 3)
            shapes[f"{block}.conv.bias"] = (c_out,)
        else:
            shapes[f"{block}.conv.weight"] = (c_in, c_out, 2 * stride)
        for j in range(len(cfg.block_dilations)):
            shapes[f"{block}.res_units.{j}.conv1.weight"] = (c_out, c_out, uk)
            shapes[f"{block}.res_units.{j}.conv2.weight"] = (c_out, c_out, 1)
    for i in range(cfg.num_quantizers):
        book = f"quantizer.quantizers.{i}.codebook"
        shapes[f"{book}.inited"] = (1,)
        shapes[f"{book}.cluster_size"] = (cfg.codebook_size,)
        shapes[f"{book}.embed_avg"] = (cfg.codebook_size, cfg.codebook_dim)
    return shapes


def _listing(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" ... ({len(names)} in all)" if len(names) > limit else "")


def read_codec_weights(
    path: Path, expected: dict[str, torch.Size], cfg: HiggsAudioV2TokenizerConfig
) -> dict[str, torch.Tensor]:
    """Load the tensors named in `expected` (name -> shape) from model.safetensors, on CPU.

    Every name must be present with its shape; any other name must be one of training_only_shapes().
    Pickled .bin/.pt files are never read.
    """
    if not path.is_file():
        raise CheckpointError(
            f"{path} not found: the codec needs model.safetensors next to its config.json "
            "(pickled .bin weights are not loaded)."
        )
    optional = training_only_shapes(cfg)
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
            missing = sorted(set(expected) - set(shapes))
            unknown = sorted(set(shapes) - set(expected) - set(optional))
            wrong = sorted(
                f"{name} (file {list(shape)}, config {list(want)})"
                for name, shape in shapes.items()
                for want in [tuple(expected[name]) if name in expected else optional.get(name)]
                if want is not None and shape != want
            )
            if missing:
                raise CheckpointError(
                    f"{path} lacks {len(missing)} weight(s) the codec needs: {_listing(missing)}. "
                    "Use the audio_tokenizer folder that belongs to this config.json."
                )
            if unknown:
                raise CheckpointError(
                    f"{path} has {len(unknown)} weight(s) this HiggsAudioV2 codec does not know: "
                    f"{_listing(unknown)}. It is not a HiggsAudioV2 tokenizer file in transformers' naming."
                )
            if wrong:
                raise CheckpointError(
                    f"{path}: {len(wrong)} weight shape(s) disagree with config.json: {_listing(wrong, 4)}. "
                    "config.json and model.safetensors come from different models."
                )
            return {name: f.get_tensor(name) for name in expected}
    except CheckpointError:
        raise
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise CheckpointError(f"{path} cannot be read as safetensors ({e}); re-download it.") from None
