"""Convolutions over right-padded batches that give each item exactly its unpadded result.

A conv run on one item alone sees zeros past the item's end (its own zero padding). In a padded batch
the positions past an item's end hold whatever the previous layer wrote there (biases, activations),
so before every conv whose kernel spans more than one position those positions are zeroed again.
Each item's valid length is carried through the stack with the conv's own length formula.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.devices import to_device


def conv_output_lengths(conv: nn.Conv1d | nn.ConvTranspose1d, lengths: list[int]) -> list[int]:
    (k,), (s,), (p,), (d,) = conv.kernel_size, conv.stride, conv.padding, conv.dilation
    if isinstance(conv, nn.ConvTranspose1d):
        (op,) = conv.output_padding
        return [(n - 1) * s - 2 * p + d * (k - 1) + op + 1 for n in lengths]
    return [(n + 2 * p - d * (k - 1) - 1) // s + 1 for n in lengths]


def padded_limits(x: torch.Tensor, lengths: list[int]) -> torch.Tensor | None:
    """The items' valid lengths on x's device (int64 [B]), or None when x [B, C, T] holds no padding."""
    if all(n >= x.shape[-1] for n in lengths):
        return None
    return to_device(torch.tensor(lengths), x.device)  # the host does not wait for the stream


def zero_past_lengths(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """x [B, C, T]: zero every position t >= lengths[b]. No-op when nothing is padded."""
    limits = padded_limits(x, lengths)
    if limits is None:
        return x
    past = torch.arange(x.shape[-1], device=x.device) >= limits[:, None]
    return x.masked_fill(past[:, None, :], 0)


def masked_conv(
    conv: nn.Conv1d | nn.ConvTranspose1d, x: torch.Tensor, lengths: list[int]
) -> tuple[torch.Tensor, list[int]]:
    """Apply conv to a padded batch; returns the output and each item's new valid length."""
    if conv.kernel_size[0] > 1:
        x = zero_past_lengths(x, lengths)
    return conv(x), conv_output_lengths(conv, lengths)


def pad_stack(items: list[torch.Tensor]) -> torch.Tensor:
    """Stack [..., T_i] tensors into [B, ..., max T], right-padded with zeros."""
    size = max(t.shape[-1] for t in items)
    return torch.stack([nn.functional.pad(t, (0, size - t.shape[-1])) for t in items])
