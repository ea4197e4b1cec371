"""The HiggsAudioV2 tokenizer's config.json as our own dataclasses: the fields the codec reads, checked.

Field names are the JSON keys. The architecture fields (every key OmniVoice's config.json sets) are
required. HuBERT's variant switches (feat_extract_norm, conv_bias, feat_proj_layer_norm, ...) may be left
out, as hand-written configs such as the tiny checkpoint's do; they then take transformers' defaults.
Keys the codec never reads (dropouts, training losses, DAC's own quantizer) are ignored.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from engine.errors import CheckpointError

_REQUIRED = object()


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _positive_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < math.inf


class _Reader:
    """Typed access to one JSON object; every error names the file and the key's full path."""

    def __init__(self, raw: dict, where: str, prefix: str = ""):
        self.raw, self.where, self.prefix = raw, where, prefix

    def fail(self, key: str, problem: str) -> CheckpointError:
        return CheckpointError(f"{self.where}: {self.prefix}{key} {problem}")

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        if key in self.raw:
            return self.raw[key]
        if default is _REQUIRED:
            raise self.fail(key, "is missing; the codec needs it to build its layers.")
        return default

    def positive_int(self, key: str) -> int:
        value = self.get(key)
        if not _positive_int(value):
            raise self.fail(key, f"must be a positive integer, got {value!r}.")
        return value

    def positive_float(self, key: str) -> float:
        value = self.get(key)
        if not _positive_number(value):
            raise self.fail(key, f"must be a positive number, got {value!r}.")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, f"must be true or false, got {value!r}.")
        return value

    def positive_ints(self, key: str) -> tuple[int, ...]:
        value = self.get(key)
        if not isinstance(value, list | tuple) or not value or not all(map(_positive_int, value)):
            raise self.fail(key, f"must be a non-empty list of positive integers, got {value!r}.")
        return tuple(value)

    def positive_floats(self, key: str) -> tuple[float, ...]:
        value = self.get(key)
        if not isinstance(value, list | tuple) or not value or not all(map(_positive_number, value)):
            raise self.fail(key, f"must be a non-empty list of positive numbers, got {value!r}.")
        return tuple(value)

    def choice(self, key: str, default: str, allowed: tuple[str, ...]) -> str:
        value = self.get(key, default)
        if value not in allowed:
            wanted = " or ".join(repr(a) for a in allowed)
            raise self.fail(key, f"is {value!r}; this codec implements {wanted} only.")
        return value

    def nested(self, key: str, model_type: str) -> _Reader:
        value = self.get(key)
        if not isinstance(value, dict):
            raise self.fail(key, f"must be a JSON object, got {type(value).__name__}.")
        inner = _Reader(value, self.where, f"{self.prefix}{key}.")
        if value.get("model_type", model_type) != model_type:
            raise inner.fail("model_type", f"is {value['model_type']!r}, expected {model_type!r}.")
        return inner


@dataclass(frozen=True)
class AcousticConfig:
    """The DAC encoder and decoder."""

    encoder_hidden_size: int
    decoder_hidden_size: int
    hidden_size: int  # latent channels between encoder and decoder
    downsampling_ratios: tuple[int, ...]
    upsampling_ratios: tuple[int, ...]

    @classmethod
    def read(cls, r: _Reader) -> AcousticConfig:
        return cls(
            encoder_hidden_size=r.positive_int("encoder_hidden_size"),
            decoder_hidden_size=r.positive_int("decoder_hidden_size"),
            hidden_size=r.positive_int("hidden_size"),
            downsampling_ratios=r.positive_ints("downsampling_ratios"),
            upsampling_ratios=r.positive_ints("upsampling_ratios"),
        )


@dataclass(frozen=True)
class SemanticConfig:
    """The HuBERT model (post-norm encoder layers, GELU, weight-normed positional convolution)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    conv_dim: tuple[int, ...]
    conv_kernel: tuple[int, ...]
    conv_stride: tuple[int, ...]
    num_conv_pos_embeddings: int
    num_conv_pos_embedding_groups: int
    layer_norm_eps: float
    feat_extract_norm: str  # "group": the first conv layer only, over time; "layer": every conv layer
    conv_bias: bool
    feat_proj_layer_norm: bool

    @classmethod
    def read(cls, r: _Reader) -> SemanticConfig:
        # Variants with other parameters or another layer order than HuBERT-base are refused by name.
        r.choice("hidden_act", "gelu", ("gelu",))
        r.choice("feat_extract_activation", "gelu", ("gelu",))
        if r.flag("do_stable_layer_norm", False):
            raise r.fail("do_stable_layer_norm", "is true; this codec implements post-norm HuBERT only.")
        if r.flag("conv_pos_batch_norm", False):
            raise r.fail("conv_pos_batch_norm", "is true; this codec implements the weight-normed form only.")
        cfg = cls(
            hidden_size=r.positive_int("hidden_size"),
            intermediate_size=r.positive_int("intermediate_size"),
            num_hidden_layers=r.positive_int("num_hidden_layers"),
            num_attention_heads=r.positive_int("num_attention_heads"),
            conv_dim=r.positive_ints("conv_dim"),
            conv_kernel=r.positive_ints("conv_kernel"),
            conv_stride=r.positive_ints("conv_stride"),
            num_conv_pos_embeddings=r.positive_int("num_conv_pos_embeddings"),
            num_conv_pos_embedding_groups=r.positive_int("num_conv_pos_embedding_groups"),
            layer_norm_eps=r.positive_float("layer_norm_eps"),
            feat_extract_norm=r.choice("feat_extract_norm", "group", ("group", "layer")),
            conv_bias=r.flag("conv_bias", False),
            feat_proj_layer_norm=r.flag("feat_proj_layer_norm", True),
        )
        if not len(cfg.conv_dim) == len(cfg.conv_kernel) == len(cfg.conv_stride):
            raise r.fail(
                "conv_dim",
                f"{list(cfg.conv_dim)}, conv_kernel {list(cfg.conv_kernel)} and conv_stride "
                f"{list(cfg.conv_stride)} must have one entry per feature-extractor layer (equal lengths).",
            )
        if cfg.hidden_size % cfg.num_attention_heads:
            raise r.fail(
                "hidden_size",
                f"{cfg.hidden_size} is not a multiple of num_attention_heads {cfg.num_attention_heads}.",
            )
        if cfg.hidden_size % cfg.num_conv_pos_embedding_groups:
            raise r.fail(
                "hidden_size",
                f"{cfg.hidden_size} is not a multiple of num_conv_pos_embedding_groups "
                f"{cfg.num_conv_pos_embedding_groups}.",
            )
        return cfg


@dataclass(frozen=True)
class CodecConfig:
    """The HiggsAudioV2 tokenizer: DAC acoustic branch, HuBERT semantic branch, residual VQ."""

    sample_rate: int
    semantic_sample_rate: int
    downsample_factor: int
    codebook_size: int
    codebook_dim: int
    target_bandwidths: tuple[float, ...]  # kbps; the last one sets the number of codebooks
    kernel_size: int
    unit_kernel_size: int
    strides: tuple[int, ...]
    channel_ratios: tuple[float, ...]
    block_dilations: tuple[int, ...]
    acoustic_model_config: AcousticConfig
    semantic_model_config: SemanticConfig

    @classmethod
    def from_dict(cls, raw: dict, where: str = "codec config") -> CodecConfig:
        """Parse a config.json object; `where` (the file) starts every error message."""
        if not isinstance(raw, dict):
            raise CheckpointError(f"{where}: expected a JSON object, got {type(raw).__name__}.")
        r = _Reader(raw, where)
        return cls(
            sample_rate=r.positive_int("sample_rate"),
            semantic_sample_rate=r.positive_int("semantic_sample_rate"),
            downsample_factor=r.positive_int("downsample_factor"),
            codebook_size=r.positive_int("codebook_size"),
            codebook_dim=r.positive_int("codebook_dim"),
            target_bandwidths=r.positive_floats("target_bandwidths"),
            kernel_size=r.positive_int("kernel_size"),
            unit_kernel_size=r.positive_int("unit_kernel_size"),
            strides=r.positive_ints("strides"),
            channel_ratios=r.positive_floats("channel_ratios"),
            block_dilations=r.positive_ints("block_dilations"),
            acoustic_model_config=AcousticConfig.read(r.nested("acoustic_model_config", "dac")),
            semantic_model_config=SemanticConfig.read(r.nested("semantic_model_config", "hubert")),
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def hop_length(self) -> int:
        return math.prod(self.acoustic_model_config.downsampling_ratios)

    @property
    def frame_rate(self) -> int:
        return math.ceil(self.sample_rate / self.hop_length)

    @property
    def hidden_size(self) -> int:
        return self.acoustic_model_config.hidden_size + self.semantic_model_config.hidden_size

    @property
    def semantic_hidden_size(self) -> int:
        return self.semantic_model_config.hidden_size

    @property
    def num_quantizers(self) -> int:
        bits_per_code = math.ceil(math.log2(self.codebook_size))
        return int(1000 * self.target_bandwidths[-1] // (self.frame_rate * bits_per_code))

    @property
    def semantic_downsample_factor(self) -> int:
        """HuBERT frames per codec frame (0 where HuBERT runs slower than the codec; read as 1)."""
        return int(self.hop_length / (self.sample_rate / self.semantic_sample_rate) / self.downsample_factor)
