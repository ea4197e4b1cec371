"""The DAC acoustic encoder and decoder, run length-aware over right-padded batches.

Parameter names are those of the official file (`acoustic_encoder.block.0.res_unit1.conv1.weight`, ...).
Its convolutions were weight-normed in training; the file stores the resulting plain weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.codec.config import AcousticConfig
from engine.codec.lengths import conv_output_lengths, masked_conv, padded_limits, zero_past_lengths
from engine.kernels.fused import fused_ops

DILATIONS = (1, 3, 9)  # of the three residual units in every block


class Snake(nn.Module):
    """x + sin^2(alpha x) / alpha, one alpha per channel. fused: on a CUDA float32 input, one kernel
    (csrc/snake.cu: torch's float32 operations in torch's order, to be bit-equal) instead of five passes.

    Two passes of the convolutions around it can come along: bias [channels], added to x first (the conv
    before it run without its own, which torch adds to a cuDNN conv's output as one float32 add), and
    lengths, each item's valid length, past which the output is 0 (zero_past_lengths, as a conv that spans
    the padding needs)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))
        self.fused = False

    def kernel(self, x: torch.Tensor):
        """The extension's ops when this Snake runs on its kernel for x, else None."""
        return fused_ops(x, (torch.float32,)) if self.fused else None

    def forward(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, lengths: list[int] | None = None
    ) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(shape[0], shape[1], -1)
        # 1e-9 keeps a zero alpha finite; the order of operations is the reference's, for equal results
        inv_alpha = (self.alpha + 1e-9).reciprocal()
        ops = self.kernel(x)
        if ops is not None:
            limits = None if lengths is None else padded_limits(x, lengths)
            return ops.snake(x.contiguous(), self.alpha, inv_alpha, bias, limits).reshape(shape)
        if bias is not None:
            x = x + bias[:, None]
        x = x + inv_alpha * torch.sin(self.alpha * x).pow(2)
        if lengths is not None:
            x = zero_past_lengths(x, lengths)
        return x.reshape(shape)


def snake_then_conv(
    snake: Snake, conv: nn.Conv1d | nn.ConvTranspose1d, x: torch.Tensor, lengths: list[int]
) -> tuple[torch.Tensor, list[int]]:
    """masked_conv(conv, snake(x), lengths); where the Snake runs on its kernel, that kernel zeroes the
    padding."""
    if snake.kernel(x) is None or conv.kernel_size[0] == 1:
        return masked_conv(conv, snake(x), lengths)
    return conv(snake(x, lengths=lengths)), conv_output_lengths(conv, lengths)


class ResidualUnit(nn.Module):
    def __init__(self, channels: int, dilation: int):
        super().__init__()
        self.snake1 = Snake(channels)
        self.conv1 = nn.Conv1d(channels, channels, kernel_size=7, dilation=dilation, padding=3 * dilation)
        self.snake2 = Snake(channels)
        self.conv2 = nn.Conv1d(channels, channels, kernel_size=1)

    def forward(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        if self.snake2.kernel(x) is None:
            y, _ = masked_conv(self.conv1, self.snake1(x), lengths)
            return x + self.conv2(self.snake2(y))
        # the Snake kernels zero conv1's padding and add its bias: two passes fewer
        conv = self.conv1
        y = F.conv1d(
            self.snake1(x, lengths=lengths), conv.weight, None, conv.stride, conv.padding, conv.dilation
        )
        return x + self.conv2(self.snake2(y, bias=conv.bias))


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
        return snake_then_conv(self.snake1, self.conv1, x, lengths)


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
        x, lengths = snake_then_conv(self.snake1, self.conv_t1, x, lengths)
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
        return snake_then_conv(self.snake1, self.conv2, x, lengths)


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
        return snake_then_conv(self.snake1, self.conv2, x, lengths)
