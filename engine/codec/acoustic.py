"""The DAC acoustic encoder and decoder: transformers' modules, run length-aware over padded batches."""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.dac.configuration_dac import DacConfig
from transformers.models.dac.modeling_dac import DacDecoder, DacEncoder, DacResidualUnit

from engine.codec.lengths import masked_conv


def build_decoder(cfg: DacConfig) -> DacDecoder:
    """DacDecoder as HiggsAudioV2 uses it: every transposed conv gets output_padding = stride % 2 so that
    F frames become exactly F * hop samples; the final tanh is not applied (see decode_acoustic)."""
    decoder = DacDecoder(cfg)
    for module in decoder.modules():
        if isinstance(module, nn.ConvTranspose1d):
            module.output_padding = (module.stride[0] % 2,)
    return decoder


def _residual(unit: DacResidualUnit, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    y, _ = masked_conv(unit.conv1, unit.snake1(x), lengths)
    return x + unit.conv2(unit.snake2(y))


def encode_acoustic(
    encoder: DacEncoder, wav: torch.Tensor, lengths: list[int]
) -> tuple[torch.Tensor, list[int]]:
    """wav [B, 1, T] right-padded, lengths in samples -> latents [B, hidden, F] and frames per item."""
    x, lengths = masked_conv(encoder.conv1, wav, lengths)
    for block in encoder.block:
        for unit in (block.res_unit1, block.res_unit2, block.res_unit3):
            x = _residual(unit, x, lengths)
        x, lengths = masked_conv(block.conv1, block.snake1(x), lengths)
    return masked_conv(encoder.conv2, encoder.snake1(x), lengths)


def decode_acoustic(
    decoder: DacDecoder, x: torch.Tensor, lengths: list[int]
) -> tuple[torch.Tensor, list[int]]:
    """latents [B, hidden, F] right-padded, lengths in frames -> audio [B, 1, F * hop], samples per item."""
    x, lengths = masked_conv(decoder.conv1, x, lengths)
    for block in decoder.block:
        x, lengths = masked_conv(block.conv_t1, block.snake1(x), lengths)
        for unit in (block.res_unit1, block.res_unit2, block.res_unit3):
            x = _residual(unit, x, lengths)
    return masked_conv(decoder.conv2, decoder.snake1(x), lengths)
