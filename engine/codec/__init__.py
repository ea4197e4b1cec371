"""Our HiggsAudioV2 audio codec (see engine/codec/model.py)."""

from engine.codec.model import Codec

__all__ = ["Codec"]
