"""The DAC acoustic encoder and decoder, run length-aware over right-padded batches.

Parameter names are those of the official file (`acoustic_encoder.block.0.res_unit1.conv1.weight`, ...).
Its convolutions were weight-normed in training; the file stores the resulting plain weights.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.codec.config import AcousticConfig
from engine.codec.lengths import masked_conv
from engine.kernels.fused import fused_ops

DILATIONS = (1, 3, 9)  # of the three residual units in every block


class Snake(nn.Module):
    """x + sin^2(alpha x) / alpha, one alpha per channel. fused: on a CUDA float32 input, one kernel
    (csrc/snake.cu: torch's float32 operations in torch's order, to be bit-equal) instead of five passes."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(shape[0], shape[1], -1)
        # 1e-9 keeps a zero alpha finite; the order of operations is the reference's, for equal results
        inv_alpha = (self.alpha + 1e-9).reciprocal()
        ops = fused_ops(x, (torch.float32,)) if self.fused else None
        if ops is not None:
            return ops.snake(x.contiguous(), self.alpha, inv_alpha).reshape(shape)
        x = x + inv_alpha * torch.sin(self.alpha * x).pow(2)
        return x.reshape(shape)


class ResidualUnit(nn.Module):
    def __init__(self, channels: int, dilation: int):
        super().__init__()
        self.snake1 = Snake(channels)
        self.conv1 = nn.Conv1d(channels, channels, kernel_size=7, dilation=dilation, padding=3 * dilation)
        self.snake2 = Snake(channels)
        self.conv2 = nn.Conv1d(channels, channels, kernel_size=1)

    def forward(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        y, _ = masked_conv(self.conv1, self.snake1(x), lengths)
        return x + self.conv2(self.snake2(y))


class EncoderBlock(nn.Module):
    """Three residual units, then a strided conv that doubles the channels."""

    def __init__(self, channels: int, stride: int):
        super().__init__()
        self.res_unit1, self.res_unit2, self.res_unit3 = (ResidualUnit(channels, d) for d in DILATIONS)
        self.snake1 = Snake(channels)
        self.conv1 = nn.Conv1d(
            channels, 2 * channels, kernel_size=2 * stride, stride=stride, padding=math.ceil(stride / 2)
        )

    def forward(self, x: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, list[int]]:
        for unit in (self.res_unit1, self.res_unit2, self.res_unit3):
            x = unit(x, lengths)
        return masked_conv(self.conv1, self.snake1(x), lengths)


class DecoderBlock(nn.Module):
    """A transposed conv that halves the channels and upsamples by `stride`, then three residual units.
    output_padding = stride % 2 makes F frames exactly F * stride samples for odd strides too."""

    def __init__(self, channels: int, stride: int):
        super().__init__()
        self.snake1 = Snake(channels)
        self.conv_t1 = nn.ConvTranspose1d(
            channels,
            channels // 2,
            kernel_size=2 * stride,
            stride=stride,
            padding=math.ceil(stride / 2),
            output_padding=stride % 2,
        )
        self.res_unit1, self.res_unit2, self.res_unit3 = (ResidualUnit(channels // 2, d) for d in DILATIONS)

    def forward(self, x: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, list[int]]:
        x, lengths = masked_conv(self.conv_t1, self.snake1(x), lengths)
        for unit in (self.res_unit1, self.res_unit2, self.res_unit3):
            x = unit(x, lengths)
        return x, lengths


class AcousticEncoder(nn.Module):
    def __init__(self, cfg: AcousticConfig):
        super().__init__()
        width = cfg.encoder_hidden_size
        self.conv1 = nn.Conv1d(1, width, kernel_size=7, padding=3)
        blocks = []
        for stride in cfg.downsampling_ratios:
            blocks.append(EncoderBlock(width, stride))
            width *= 2
        self.block = nn.ModuleList(blocks)
        self.snake1 = Snake(width)
        self.conv2 = nn.Conv1d(width, cfg.hidden_size, kernel_size=3, padding=1)

    def forward(self, wav: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, list[int]]:
        """wav [B, 1, T] right-padded, lengths in samples -> latents [B, hidden, F] and frames per item."""
        x, lengths = masked_conv(self.conv1, wav, lengths)
        for block in self.block:
            x, lengths = block(x, lengths)
        return masked_conv(self.conv2, self.snake1(x), lengths)


class AcousticDecoder(nn.Module):
    """Ends with the last conv: HiggsAudioV2 applies no tanh to the decoded audio."""

    def __init__(self, cfg: AcousticConfig):
        super().__init__()
        width = cfg.decoder_hidden_size
        self.conv1 = nn.Conv1d(cfg.hidden_size, width, kernel_size=7, padding=3)
        blocks = []
        for stride in cfg.upsampling_ratios:
            blocks.append(DecoderBlock(width, stride))
            width //= 2
        self.block = nn.ModuleList(blocks)
        self.snake1 = Snake(width)
        self.conv2 = nn.Conv1d(width, 1, kernel_size=7, padding=3)

    def forward(self, x: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, list[int]]:
        """latents [B, hidden, F] right-padded, lengths in frames -> audio [B, 1, F * hop], samples each."""
        x, lengths = masked_conv(self.conv1, x, lengths)
        for block in self.block:
            x, lengths = block(x, lengths)
        return masked_conv(self.conv2, self.snake1(x), lengths)
