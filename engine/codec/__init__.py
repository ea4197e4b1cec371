"""Our HiggsAudioV2 audio codec (see engine/codec/model.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.codec.model import Codec

__all__ = ["Codec"]


def __getattr__(name: str):
    # Codec (and torch) on first use: a job's planner reads the codec's config (engine.codec.checkpoint)
    # without loading torch.
    if name == "Codec":
        from engine.codec.model import Codec

        return Codec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
