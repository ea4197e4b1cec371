"""The semantic branch: HuBERT features of the 16 kHz signal, then a small conv encoder.

Parameter names follow transformers' HiggsAudioV2 tokenizer (`encoder_semantic.*`, `semantic_model.*`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import HiggsAudioV2TokenizerConfig, HubertModel

from engine.codec.lengths import conv_output_lengths, masked_conv, pad_stack
from engine.resample import resample

# transformers pads the 16 kHz signal by 160 samples (half of HuBERT's 320-sample hop) on both sides.
HUBERT_EDGE_PAD = 160


class SemanticResidualUnit(nn.Module):
    def __init__(self, cfg: HiggsAudioV2TokenizerConfig, channels: int, dilation: int):
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
    def __init__(self, cfg: HiggsAudioV2TokenizerConfig, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.res_units = nn.ModuleList(SemanticResidualUnit(cfg, c_in, d) for d in cfg.block_dilations)
        kernel = 3 if stride == 1 else 2 * stride
        self.conv = nn.Conv1d(c_in, c_out, kernel, stride=stride, padding=(kernel - 1) // 2)

    def forward(self, x: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, list[int]]:
        for unit in self.res_units:
            x = unit(x, lengths)
        return masked_conv(self.conv, x, lengths)


class SemanticEncoder(nn.Module):
    def __init__(self, cfg: HiggsAudioV2TokenizerConfig):
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


class LengthAwareGroupNorm(nn.GroupNorm):
    """HuBERT's first-layer GroupNorm (statistics over time) taking each item's statistics over its own
    frames while `lengths` is set, so that a right-padded batch normalises each clip as it would alone.
    Frames past an item's length keep whatever they held: the valid (unpadded) convolutions after it never
    read them into a valid frame."""

    lengths: list[int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lengths is None:
            return super().forward(x)
        out = x.clone()
        for i, n in enumerate(self.lengths):
            out[i, :, :n] = super().forward(x[i : i + 1, :, :n])[0]
        return out


def length_aware_hubert(hubert: HubertModel) -> HubertModel:
    """Swap the first conv layer's GroupNorm for a LengthAwareGroupNorm (same parameters and names)."""
    first = hubert.feature_extractor.conv_layers[0]
    norm = getattr(first, "layer_norm", None)
    if type(norm) is nn.GroupNorm:  # feat_extract_norm "group"; "layer" normalises each frame alone
        aware = LengthAwareGroupNorm(norm.num_groups, norm.num_channels, norm.eps, norm.affine)
        aware.weight, aware.bias = norm.weight, norm.bias
        first.layer_norm = aware
    return hubert


def semantic_features(
    hubert: HubertModel, wavs: list[torch.Tensor], cfg: HiggsAudioV2TokenizerConfig
) -> list[torch.Tensor]:
    """Clips [T] at cfg.sample_rate -> each one's HuBERT features [F, hidden] at the codec frame rate.

    One right-padded batch: attention masks the padding, HuBERT zeroes padded frames before its
    positional convolution, and the first GroupNorm (length_aware_hubert) takes each clip's statistics
    over its own frames, so each clip's features are its features alone up to summation order.
    """
    signals = [
        F.pad(resample(w, cfg.sample_rate, cfg.semantic_sample_rate), (HUBERT_EDGE_PAD,) * 2) for w in wavs
    ]
    samples = [x.shape[-1] for x in signals]
    batch = pad_stack(signals)
    padded = min(samples) < batch.shape[-1]  # clips of one length need no mask (nor its slower attention)
    first = hubert.feature_extractor.conv_layers[0]
    aware = padded and isinstance(getattr(first, "layer_norm", None), LengthAwareGroupNorm)
    if aware:
        first.layer_norm.lengths = conv_output_lengths(first.conv, samples)
    try:
        attention_mask = None
        if padded:
            limits = torch.tensor(samples, device=batch.device)[:, None]
            attention_mask = (torch.arange(batch.shape[-1], device=batch.device) < limits).long()
        hidden_states = hubert(batch, attention_mask=attention_mask, output_hidden_states=True).hidden_states
    finally:
        if aware:
            first.layer_norm.lengths = None
    features = torch.stack(hidden_states, dim=1).mean(dim=1)  # [B, frames, hidden]
    frames = samples
    for layer in hubert.feature_extractor.conv_layers:  # each clip's frames through the valid convolutions
        frames = conv_output_lengths(layer.conv, frames)
    step = max(cfg.semantic_downsample_factor, 1)
    return [features[i, :f][::step] for i, f in enumerate(frames)]
