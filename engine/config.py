"""Configuration dataclasses: the model (read from config.json), generation and engine settings."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from engine.errors import CheckpointError, InputError


def cache_root() -> Path:
    """Where the engine keeps what it builds (tiny checkpoint, compiled kernels): $OVBATCH_CACHE or
    ~/.cache/ovbatch."""
    return Path(os.environ.get("OVBATCH_CACHE") or Path.home() / ".cache" / "ovbatch")


@dataclass(frozen=True)
class LLMConfig:
    """The Qwen3 backbone (`llm_config` in the official config.json)."""

    hidden_size: int = 1024
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 3072
    vocab_size: int = 151676
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960
    attention_bias: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LLMConfig:
        model_type = d.get("model_type", "qwen3")
        if model_type != "qwen3":
            raise CheckpointError(
                f"llm_config.model_type is {model_type!r}; OmniVoice's backbone is 'qwen3'. "
                "Pass an official OmniVoice checkpoint directory."
            )
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        if "rope_theta" not in d and isinstance(d.get("rope_parameters"), dict):
            kwargs["rope_theta"] = d["rope_parameters"].get("rope_theta", cls.rope_theta)
        if "head_dim" not in d and "hidden_size" in d and "num_attention_heads" in d:
            kwargs["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        return cls(**kwargs)


@dataclass(frozen=True)
class ModelConfig:
    """The whole OmniVoice model (`config.json`, model_type 'omnivoice')."""

    llm: LLMConfig = field(default_factory=LLMConfig)
    audio_vocab_size: int = 1025
    audio_mask_id: int = 1024
    num_audio_codebook: int = 8

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        model_type = d.get("model_type")
        if model_type != "omnivoice":
            raise CheckpointError(
                f"config.json has model_type {model_type!r}, expected 'omnivoice'. "
                "Point --checkpoint at an OmniVoice checkpoint directory (k2-fsa/OmniVoice layout)."
            )
        if not isinstance(d.get("llm_config"), dict):
            raise CheckpointError("config.json lacks an 'llm_config' object (the qwen3 backbone settings).")
        return cls(
            llm=LLMConfig.from_dict(d["llm_config"]),
            audio_vocab_size=int(d.get("audio_vocab_size", 1025)),
            audio_mask_id=int(d.get("audio_mask_id", 1024)),
            num_audio_codebook=int(d.get("num_audio_codebook", 8)),
        )

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{path} not found: a checkpoint directory needs config.json.") from None
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path} is not valid JSON ({e}).") from None
        return cls.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        """The official config.json layout."""
        llm = asdict(self.llm)
        llm["model_type"] = "qwen3"
        return {
            "model_type": "omnivoice",
            "architectures": ["OmniVoice"],
            "audio_vocab_size": self.audio_vocab_size,
            "audio_mask_id": self.audio_mask_id,
            "num_audio_codebook": self.num_audio_codebook,
            "audio_codebook_weights": [8, 8, 6, 6, 4, 4, 2, 2][: self.num_audio_codebook],
            "llm_config": llm,
        }


@dataclass
class GenerationConfig:
    """Decoding settings; defaults are upstream's (OmniVoiceGenerationConfig)."""

    num_step: int = 32
    guidance_scale: float = 2.0
    t_shift: float = 0.1
    layer_penalty_factor: float = 5.0
    position_temperature: float = 5.0
    class_temperature: float = 0.0
    denoise: bool = True
    preprocess_prompt: bool = True
    postprocess_output: bool = True
    audio_chunk_duration: float = 15.0
    audio_chunk_threshold: float = 30.0
    pad_duration: float = 0.1
    fade_duration: float = 0.1

    def __post_init__(self) -> None:
        if self.num_step < 1:
            raise InputError(f"num_step={self.num_step}: needs at least 1 decoding step.")
        finite = ("guidance_scale", "layer_penalty_factor", "audio_chunk_threshold")
        self._check(finite, lambda v: True, "a finite number")
        # t_shift bends the unmasking schedule t -> s t / (1 + (s - 1) t): 0 leaves every position to the
        # last step, a negative one breaks it
        self._check(("t_shift",), lambda v: v > 0, "a positive number (upstream's is 0.1)")
        temperatures = ("position_temperature", "class_temperature")
        self._check(temperatures, lambda v: v >= 0, "a number >= 0 (0 is greedy)")
        durations = ("audio_chunk_duration", "pad_duration", "fade_duration")
        self._check(durations, lambda v: v >= 0, "seconds >= 0")

    def _check(self, names: tuple[str, ...], ok, want: str) -> None:
        for name in names:
            value = getattr(self, name)
            if not (math.isfinite(value) and ok(value)):
                raise InputError(f"generation.{name}={value}: give {want}.")


PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "w4a4")


@dataclass
class FastPaths:
    """Switches for the engine's fast paths, fixed when a model is loaded (engine/loading.py). All on by
    default; benchmarks turn one off to measure what it saves. Each falls back to plain torch where its
    kernels cannot run (CPU, fp32, other GPUs)."""

    fused_kernels: bool = True  # RMSNorm, SiLU * up, q/k norm + RoPE, RMSNorm inside W4A4 quantization
    grouped_projections: bool = True  # q/k/v and gate/up merged into one Linear (one GEMM) each
    swiglu_gemm: bool = True  # the gate/up GEMM writes silu(gate) * up itself (bf16/fp16 and W4A4, Hopper)
    qkv_rope_gemm: bool = True  # the q/k/v GEMM norms and rotates q and k itself (bf16/fp16, Hopper)
    w4a4_backend: str = "auto"  # auto | cuda-sm90 | reference

    def __post_init__(self) -> None:
        if self.w4a4_backend not in ("auto", "cuda-sm90", "reference"):
            raise InputError(f"w4a4_backend={self.w4a4_backend!r}: choose auto, cuda-sm90 or reference.")


@dataclass
class EngineConfig:
    """How to run: which checkpoint, where, in what precision, with which fast paths."""

    checkpoint: str | None = None  # None: the embedded tiny checkpoint
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    precision: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16 | fp16 | fp8 | w4a4
    attention: str = "auto"  # auto | flash | varlen | sdpa
    cuda_graphs: bool = True
    # Packed-token buckets a CUDA graph is captured for (cond + uncond tokens of a whole batch): a batch
    # runs padded to the smallest that holds it, so they step by 512 (under 5% padding from 10,240 tokens
    # on). Only the layouts a job uses are captured, each once, their activations in one shared pool.
    buckets: tuple[int, ...] = tuple(range(512, 16385, 512))
    max_batch_tokens: int = 16384
    prompt_cache_dir: str | None = None
    max_text_chars: int = 5000  # longer request texts are rejected (long ones are chunked, not truncated)
    max_ref_seconds: float = 60.0  # longer reference clips are rejected before decoding
    fast_paths: FastPaths = field(default_factory=FastPaths)
    generation: GenerationConfig = field(default_factory=GenerationConfig)

    @property
    def token_budget(self) -> int:
        """Packed tokens one generation may take: max_batch_tokens, and the largest graph bucket."""
        return min(self.max_batch_tokens, max(self.buckets))

    def __post_init__(self) -> None:
        if self.precision != "auto" and self.precision not in PRECISIONS:
            raise InputError(f"precision={self.precision!r}: choose one of auto, {', '.join(PRECISIONS)}.")
        if self.attention not in ("auto", "flash", "flash4", "varlen", "sdpa"):
            raise InputError(f"attention={self.attention!r}: choose auto, flash, flash4, varlen or sdpa.")
        if not self.buckets or min(self.buckets) < 1 or self.max_batch_tokens < 1:
            raise InputError(
                f"buckets={list(self.buckets)}, max_batch_tokens={self.max_batch_tokens}: give at least one "
                "bucket, every bucket and the batch limit a positive number of packed tokens."
            )
        if self.max_text_chars < 1:
            raise InputError(
                f"max_text_chars={self.max_text_chars}: give the longest text a request may have, in "
                f"characters (default {EngineConfig.max_text_chars})."
            )
        if not self.max_ref_seconds > 0:  # NaN too: it would turn the limit off
            raise InputError(
                f"max_ref_seconds={self.max_ref_seconds:g}: give the longest reference clip a request may "
                f"have, in seconds > 0 (default {EngineConfig.max_ref_seconds:g})."
            )
