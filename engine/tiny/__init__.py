"""The deterministic tiny checkpoint in the official layout (model, codec, tokenizer): the demo's default
and the tests' fixture, generated on CPU in seconds."""

from engine.tiny.checkpoint import (
    TINY_VERSION,
    ensure_tiny_checkpoint,
    tiny_model_config,
    tiny_state_dict,
    write_tiny_checkpoint,
)

__all__ = [
    "TINY_VERSION",
    "ensure_tiny_checkpoint",
    "tiny_model_config",
    "tiny_state_dict",
    "write_tiny_checkpoint",
]
