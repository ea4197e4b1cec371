"""Reading `<checkpoint>/audio_tokenizer/`: config.json and model.safetensors (the official names)."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

from engine.codec.config import CodecConfig
from engine.errors import CheckpointError

if TYPE_CHECKING:  # a job's planner reads the config alone, without torch
    import torch

MODEL_TYPE = "higgs_audio_v2_tokenizer"

# Older conversions carry HuBERT's SpecAugment embedding, which inference never reads: skipped on load.
SKIPPED_IF_PRESENT = ("semantic_model.masked_spec_embed",)

# The architecture of OmniVoice's audio_tokenizer/config.json (24 kHz, hop 960 = 25 frames/s, 8 codebooks
# of 1024 x 64, HuBERT-base semantic model): for codecs of the real size with random weights.
OMNIVOICE_CODEC_CONFIG = {
    "model_type": MODEL_TYPE,
    "sample_rate": 24000,
    "semantic_sample_rate": 16000,
    "downsample_factor": 320,
    "codebook_size": 1024,
    "codebook_dim": 64,
    "target_bandwidths": [0.5, 1, 1.5, 2],
    "kernel_size": 3,
    "unit_kernel_size": 3,
    "strides": [1, 1],
    "channel_ratios": [1, 1],
    "block_dilations": [1, 1],
    "acoustic_model_config": {
        "model_type": "dac",
        "encoder_hidden_size": 64,
        "decoder_hidden_size": 1024,
        "hidden_size": 256,
        "downsampling_ratios": [8, 5, 4, 2, 3],
        "upsampling_ratios": [8, 5, 4, 2, 3],
    },
    "semantic_model_config": {
        "model_type": "hubert",
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "conv_dim": [512] * 7,
        "conv_kernel": [10, 3, 3, 3, 3, 2, 2],
        "conv_stride": [5, 2, 2, 2, 2, 2, 2],
        "num_conv_pos_embeddings": 128,
        "num_conv_pos_embedding_groups": 16,
        "layer_norm_eps": 1e-5,
    },
}


def read_codec_config(path: Path) -> CodecConfig:
    """Parse `config.json` of a HiggsAudioV2 tokenizer; errors name the file and the field."""
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
    cfg = CodecConfig.from_dict(raw, str(path))
    check_codec_config(cfg, str(path))
    return cfg


def check_codec_config(cfg: CodecConfig, where: str) -> None:
    """What no single field shows: the acoustic and semantic branches must produce frames at the same
    rate (or nothing encodes), the decoder must upsample by the hop, and at least one codebook."""
    if len(cfg.strides) != len(cfg.channel_ratios):
        raise CheckpointError(
            f"{where}: strides {list(cfg.strides)} and channel_ratios {list(cfg.channel_ratios)} differ in "
            "length; the semantic encoder needs one ratio per stride."
        )
    hubert_hop = (
        math.prod(cfg.semantic_model_config.conv_stride)
        * max(cfg.semantic_downsample_factor, 1)
        * math.prod(cfg.strides)
    )
    acoustic_rate = Fraction(cfg.sample_rate, cfg.hop_length)
    semantic_rate = Fraction(cfg.semantic_sample_rate, hubert_hop)
    if acoustic_rate != semantic_rate or cfg.hop_length % 2:
        raise CheckpointError(
            f"{where}: the acoustic branch runs at {float(acoustic_rate):g} frames/s (sample_rate "
            f"{cfg.sample_rate} / hop {cfg.hop_length}) but the semantic branch at {float(semantic_rate):g} "
            f"frames/s (semantic_sample_rate {cfg.semantic_sample_rate} / semantic hop {hubert_hop}); "
            "fix downsampling_ratios or downsample_factor so both rates agree and the hop is even."
        )
    upsampling = cfg.acoustic_model_config.upsampling_ratios
    if math.prod(upsampling) != cfg.hop_length:
        raise CheckpointError(
            f"{where}: acoustic_model_config.upsampling_ratios {list(upsampling)} upsample by "
            f"{math.prod(upsampling)}, but downsampling_ratios make a hop of {cfg.hop_length}; decoding must "
            "give back one hop of audio per frame."
        )
    if cfg.num_quantizers < 1:
        raise CheckpointError(
            f"{where}: target_bandwidths {list(cfg.target_bandwidths)} leave no codebook at "
            f"{cfg.frame_rate} frames/s; the last bandwidth sets the number of codebooks."
        )


def training_only_shapes(cfg: CodecConfig) -> dict[str, tuple[int, ...]]:
    """Tensors the official file carries that encode/decode never read: the semantic decoder and fc1
    (reconstruction losses) and the codebooks' EMA statistics. The loader accepts and skips exactly
    these; the tiny checkpoint writes them to keep the official layout."""
    hidden = cfg.semantic_hidden_size
    ratios, k, uk = cfg.channel_ratios, cfg.kernel_size, cfg.unit_kernel_size
    shapes: dict[str, tuple[int, ...]] = {
        "fc1.weight": (hidden, cfg.hidden_size),
        "fc1.bias": (hidden,),
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
    path: Path, expected: dict[str, torch.Size], cfg: CodecConfig
) -> dict[str, torch.Tensor]:
    """Load the tensors named in `expected` (name -> shape) from model.safetensors, on CPU.

    Every name must be present with its shape; any other name must be one of training_only_shapes()
    or SKIPPED_IF_PRESENT. Pickled .bin/.pt files are never read.
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
            unknown = sorted(set(shapes) - set(expected) - set(optional) - set(SKIPPED_IF_PRESENT))
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
                    f"{_listing(unknown)}. It is not a HiggsAudioV2 tokenizer file in the official naming."
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
