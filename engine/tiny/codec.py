"""The tiny codec of the tiny checkpoint: HiggsAudioV2 architecture at toy width, seeded random weights.

Same layout as the official `audio_tokenizer/` folder (config.json, preprocessor_config.json,
model.safetensors with every tensor name the official file has), 24 kHz, hop 960 (25 frames/s),
8 codebooks of 1024 entries, so its ids fit OmniVoice's audio vocabulary of 1025.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.codec.checkpoint import OMNIVOICE_CODEC_CONFIG, read_codec_config, training_only_shapes
from engine.codec.model import Codec

SEED = 20240611
# WEIGHT_GAIN keeps the latents near 0.2 and the snake inputs O(1): neither fading nor chaotic.
WEIGHT_GAIN = 0.7
CODEBOOK_STD = 0.15
OUTPUT_GAIN = 5.0  # decoded audio peaks around 0.3 to 0.5

_REAL = OMNIVOICE_CODEC_CONFIG
# The real architecture at toy width: same rates, hop, strides and codebook size.
TINY_CODEC_CONFIG = {
    **_REAL,
    "codebook_dim": 8,
    "acoustic_model_config": {
        **_REAL["acoustic_model_config"],
        "encoder_hidden_size": 4,
        "decoder_hidden_size": 64,
        "hidden_size": 16,
        "sampling_rate": 24000,
    },
    "semantic_model_config": {
        **_REAL["semantic_model_config"],
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "conv_dim": [16] * 7,
        "num_conv_pos_embeddings": 16,
        "num_conv_pos_embedding_groups": 4,
        "mask_time_prob": 0.0,
    },
}


def preprocessor_config(hop_length: int, sample_rate: int) -> dict:
    return {
        "feature_extractor_type": "DacFeatureExtractor",
        "feature_size": 1,
        "hop_length": hop_length,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": True,
        "sampling_rate": sample_rate,
    }


def random_codec_weights(codec: Codec, cfg) -> dict[str, torch.Tensor]:
    """Weights under which the output follows the input: PyTorch's default init lets the signal fade
    through the DAC stacks until the biases alone set the audio. Matrices and kernels are drawn with
    std WEIGHT_GAIN / sqrt(fan_in), biases are zero (norm layers and snake alphas keep their init), the
    codebooks spread over the latents' scale and the last conv sets an audio-like level."""
    tensors = {name: t.detach().clone().contiguous() for name, t in codec.state_dict().items()}
    for name in sorted(tensors):
        shape = tensors[name].shape
        if name.endswith(".codebook.embed"):
            tensors[name] = torch.randn(shape) * CODEBOOK_STD
        elif name.endswith(".bias"):
            tensors[name] = torch.zeros(shape)
        elif len(shape) >= 2 and "parametrizations" not in name:
            tensors[name] = torch.randn(shape) * (WEIGHT_GAIN / math.sqrt(math.prod(shape[1:])))
    tensors["acoustic_decoder.conv2.weight"] *= OUTPUT_GAIN
    for name, shape in training_only_shapes(cfg).items():
        if name.endswith(".inited"):
            tensors[name] = torch.ones(shape)
        elif name.endswith((".cluster_size", ".embed_avg")):
            tensors[name] = torch.zeros(shape)
        else:
            tensors[name] = torch.randn(shape) * 0.02
    return tensors


def write_tiny_codec(out_dir: Path) -> Path:
    """Write `<out_dir>/audio_tokenizer/` and return that folder. Same bytes on every call."""
    target = Path(out_dir) / "audio_tokenizer"
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(TINY_CODEC_CONFIG, indent=2, sort_keys=True) + "\n")
    cfg = read_codec_config(target / "config.json")
    preprocessor = preprocessor_config(cfg.hop_length, cfg.sample_rate)
    (target / "preprocessor_config.json").write_text(
        json.dumps(preprocessor, indent=2, sort_keys=True) + "\n"
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        codec = Codec(cfg)
        tensors = random_codec_weights(codec, cfg)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target
