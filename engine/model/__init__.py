"""Pure torch modules of the OmniVoice network (no I/O): layers, attention backends, the model."""

from engine.model.layers import LinearFactory, default_linear
from engine.model.omnivoice import OmniVoiceModel, PackedBatch

__all__ = ["LinearFactory", "OmniVoiceModel", "PackedBatch", "default_linear"]
