"""The semantic branch: HuBERT features of the 16 kHz signal, then a small conv encoder.

Parameter names are those of the official file (`encoder_semantic.*`; HuBERT's `semantic_model.*`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.codec.config import CodecConfig
from engine.codec.hubert import Hubert
from engine.codec.lengths import masked_conv, zero_past_lengths
from engine.resample import resample, resampled_length

# HiggsAudioV2 pads the 16 kHz signal by 160 samples (half of HuBERT's 320-sample hop) on both sides.
HUBERT_EDGE_PAD = 160


class SemanticResidualUnit(nn.Module):
    def __init__(self, cfg: CodecConfig, channels: int, dilation: int):
        super().__init__()
        k = cfg.unit_kernel_size
        self.conv1 = nn.Conv1d(
            channels, channels, k, padding=((k - 1) // 2) * dilation, dilation=dilation, bias=False
        )
        self.conv2 = nn.Conv1d(channels, channels, kernel_size=1, bias=False)

    def forward(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        y, _ = masked_conv(self.conv1, F.elu(x), lengths)
        return x + self.conv2(F.elu(y))


class SemanticEncoderBlock(nn.Module):
    def __init__(self, cfg: CodecConfig, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.res_units = nn.ModuleList(SemanticResidualUnit(cfg, c_in, d) for d in cfg.block_dilations)
        kernel = 3 if stride == 1 else 2 * stride
        self.conv = nn.Conv1d(c_in, c_out, kernel, stride=stride, padding=(kernel - 1) // 2)

    def forward(self, x: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, list[int]]:
        for unit in self.res_units:
            x = unit(x, lengths)
        return masked_conv(self.conv, x, lengths)


class SemanticEncoder(nn.Module):
    def __init__(self, cfg: CodecConfig):
        super().__init__()
        hidden, k = cfg.semantic_hidden_size, cfg.kernel_size
        self.conv = nn.Conv1d(hidden, hidden, k, padding=k // 2, bias=False)
        blocks, c_in = [], hidden
        for ratio, stride in zip(cfg.channel_ratios, cfg.strides, strict=True):
            c_out = int(hidden * ratio)
            blocks.append(SemanticEncoderBlock(cfg, c_in, c_out, stride))
            c_in = c_out
        self.conv_blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, list[int]]:
        """x [B, hidden, F] right-padded, lengths in frames."""
        x, lengths = masked_conv(self.conv, x, lengths)
        for block in self.conv_blocks:
            x, lengths = block(x, lengths)
        return x, lengths


def semantic_features(
    hubert: Hubert, signal: torch.Tensor, lengths: list[int], cfg: CodecConfig
) -> tuple[torch.Tensor, list[int]]:
    """Clips at cfg.sample_rate, right-padded with zeros into signal [B, T], lengths in samples -> HuBERT
    features [B, hidden, F] at the codec frame rate (the mean of HuBERT's hidden states, every
    semantic_downsample_factor-th frame) and each clip's F. The batch is resampled as one (each clip's
    samples zeroed past its resampled length, so that every clip is resampled as alone); a clip's features
    are its features alone up to summation order (Hubert), and past its F hold what the padded batch
    computed there (the encoder masks them)."""
    resampled = [resampled_length(n, cfg.sample_rate, cfg.semantic_sample_rate) for n in lengths]
    signal = resample(signal, cfg.sample_rate, cfg.semantic_sample_rate)
    signal = F.pad(zero_past_lengths(signal[:, None], resampled)[:, 0], (HUBERT_EDGE_PAD,) * 2)
    hidden_states, frames = hubert(signal, [n + 2 * HUBERT_EDGE_PAD for n in resampled])
    step = max(cfg.semantic_downsample_factor, 1)
    features = torch.stack(hidden_states, dim=1).mean(dim=1)[:, ::step]  # [B, frames, hidden]
    return features.transpose(1, 2), [-(-f // step) for f in frames]
