"""Windowed-sinc resampling that reproduces torchaudio.functional.resample (method "sinc_interp_hann").

The codec's semantic path resamples 24 kHz audio to HuBERT's 16 kHz with torchaudio's defaults
(lowpass_filter_width=6, rolloff=0.99). This module evaluates the same polyphase filter with the same
float operations in plain torch, so the project needs no torchaudio.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F

from engine.errors import InputError


@lru_cache(maxsize=32)
def sinc_kernel(
    orig_freq: int,
    new_freq: int,
    lowpass_filter_width: int = 6,
    rolloff: float = 0.99,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, int]:
    """Polyphase filter bank for rates already divided by their gcd.

    Returns (kernel [new_freq, 1, 2 * width + orig_freq], width). Row p holds the taps of output phase p:
    output sample j = m * new_freq + p reads input samples m * orig_freq - width ... m * orig_freq + width
    + orig_freq - 1, weighted by a Hann-windowed sinc of (i / orig_freq - j / new_freq) * cutoff.
    """
    cutoff = min(orig_freq, new_freq) * rolloff
    width = math.ceil(lowpass_filter_width * orig_freq / cutoff)
    taps = torch.arange(-width, width + orig_freq, dtype=dtype, device=device)[None, None] / orig_freq
    phases = torch.arange(0, -new_freq, -1, dtype=dtype, device=device)[:, None, None] / new_freq
    t = (phases + taps) * cutoff
    t = t.clamp(-lowpass_filter_width, lowpass_filter_width)
    window = torch.cos(t * math.pi / lowpass_filter_width / 2) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.ones((), dtype=dtype, device=device), t.sin() / t)
    return sinc * (window * (cutoff / orig_freq)), width


def resampled_length(length: int, orig_freq: int, new_freq: int) -> int:
    """Number of output samples: ceil(length * new_freq / orig_freq), as torchaudio."""
    g = math.gcd(orig_freq, new_freq)
    return -(-length * (new_freq // g) // (orig_freq // g))


def resample(
    wav: torch.Tensor,
    orig_freq: int,
    new_freq: int,
    lowpass_filter_width: int = 6,
    rolloff: float = 0.99,
) -> torch.Tensor:
    """Resample float audio [..., T] from orig_freq to new_freq (integer Hz) along the last axis."""
    for name, value in (("orig_freq", orig_freq), ("new_freq", new_freq)):
        if not isinstance(value, int) or value <= 0:
            raise InputError(f"resample: {name}={value!r}; pass a positive integer sample rate in Hz.")
    if not isinstance(wav, torch.Tensor) or not wav.is_floating_point() or wav.dim() == 0:
        raise InputError(
            f"resample: got {type(wav).__name__} "
            f"{getattr(wav, 'dtype', '')} {tuple(getattr(wav, 'shape', ()))}; pass a float tensor [..., T]."
        )
    if lowpass_filter_width <= 0:
        raise InputError(f"resample: lowpass_filter_width={lowpass_filter_width}; pass a positive integer.")
    if orig_freq == new_freq:
        return wav
    g = math.gcd(orig_freq, new_freq)
    orig, new = orig_freq // g, new_freq // g
    kernel, width = sinc_kernel(orig, new, lowpass_filter_width, rolloff, wav.device, wav.dtype)
    lead, length = wav.shape[:-1], wav.shape[-1]
    x = F.pad(wav.reshape(-1, 1, length), (width, width + orig))
    y = F.conv1d(x, kernel, stride=orig)  # [N, new, frames]: phase-major per input hop
    y = y.transpose(1, 2).reshape(y.shape[0], -1)
    out_len = resampled_length(length, orig_freq, new_freq)
    return y[:, :out_len].reshape(*lead, out_len)
