"""Pure torch modules of the OmniVoice network (no I/O): layers, attention backends, the model."""

from engine.model.layers import LinearFactory
from engine.model.linear import DenseLinear, Linear, default_linear, merge_linears
from engine.model.omnivoice import OmniVoiceModel, PackedBatch

__all__ = [
    "DenseLinear",
    "Linear",
    "LinearFactory",
    "OmniVoiceModel",
    "PackedBatch",
    "default_linear",
    "merge_linears",
]
