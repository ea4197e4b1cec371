"""The deterministic tiny checkpoint: the exact official layout at toy size, made on CPU in seconds.

It is the embedded default of every command (until a user passes --checkpoint) and the checkpoint of
the CPU tests. Its dimensions keep every backbone Linear's in_features a multiple of 64 so the W4A4
path runs on it too. Built once into a cache directory, atomically (temp dir + rename). Finding it built
imports no torch (only making its weights does), so that a job's driver resolves the default checkpoint
without torch.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import LLMConfig, ModelConfig, cache_root
from engine.fsmodes import chmod_tree_as_created

if TYPE_CHECKING:
    import torch

TINY_VERSION = 3
SEED = 20260
HEAD_LOGIT_STD = 2.5  # spread of the audio-head logits: peaked enough that decoding is not a coin toss


def tiny_model_config(vocab_size: int) -> ModelConfig:
    llm = LLMConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=192,
        vocab_size=vocab_size,
        rope_theta=10_000.0,
        max_position_embeddings=4096,
    )
    return ModelConfig(llm=llm)


def tiny_state_dict(cfg: ModelConfig, seed: int = SEED) -> dict[str, torch.Tensor]:
    """Seeded random weights for every tensor of the model, in state-dict order, float32 on CPU."""
    import torch

    from engine.model import OmniVoiceModel

    gen = torch.Generator().manual_seed(seed)
    hidden = cfg.llm.hidden_size
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in OmniVoiceModel(cfg).state_dict().items()}
    weights = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=gen)
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.1 * noise
        elif name == "audio_heads.weight":
            weights[name] = noise * (HEAD_LOGIT_STD / math.sqrt(hidden))
        elif name.endswith("embeddings.weight") or name.endswith("embed_tokens.weight"):
            weights[name] = noise
        else:  # a Linear [out, in]: unit gain keeps activations O(1) through the layers
            weights[name] = noise / math.sqrt(shape[1])
    return {k: v.contiguous() for k, v in weights.items()}


def write_tiny_checkpoint(out_dir: Path) -> None:
    """Write the complete tiny checkpoint into out_dir (which must exist)."""
    from safetensors.torch import save_file

    from engine.tiny.codec import write_tiny_codec
    from engine.tiny.tokenizer import write_tiny_tokenizer

    vocab_size = write_tiny_tokenizer(out_dir)
    cfg = tiny_model_config(vocab_size)
    (out_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    save_file(tiny_state_dict(cfg), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    write_tiny_codec(out_dir)  # writes out_dir/audio_tokenizer/


def _complete(ckpt_dir: Path) -> bool:
    needed = (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "audio_tokenizer/config.json",
        "audio_tokenizer/model.safetensors",
    )
    return all((ckpt_dir / name).exists() for name in needed)


def ensure_tiny_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """The tiny checkpoint directory (<cache root>/tiny-v<version>), built on first use."""
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    target = root / f"tiny-v{TINY_VERSION}"
    if _complete(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-", dir=root))
    try:
        write_tiny_checkpoint(staging)
        chmod_tree_as_created(staging)  # mkdtemp and safetensors make owner-only folders and files
        # Replace a damaged copy (files deleted), never one a concurrent builder has just published.
        if target.exists() and not _complete(target):
            shutil.rmtree(target, ignore_errors=True)
        try:
            staging.rename(target)
        except OSError:
            if not _complete(target):  # a concurrent builder did not win the race either
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
