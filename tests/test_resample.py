import math

import pytest
import torch

from engine.errors import InputError
from engine.resample import resample, resampled_length, sinc_kernel

RATE_PAIRS = [(24000, 16000), (16000, 24000), (44100, 24000), (8000, 24000), (48000, 16000), (22050, 24000)]


def direct_resample(x: torch.Tensor, orig: int, new: int, width: int = 6, rolloff: float = 0.99):
    """float64 evaluation of the band-limited interpolation sum, one output sample at a time:
    y[j] = sum_i x[i] * h((i / orig - j / new) * cutoff) with
    h(t) = sinc(t) * cos^2(pi t / (2 width)) * cutoff / orig for |t| < width, else 0
    (rates reduced by their gcd, cutoff = rolloff * min(orig, new))."""
    g = math.gcd(orig, new)
    orig, new = orig // g, new // g
    cutoff = rolloff * min(orig, new)
    n = x.shape[-1]
    i = torch.arange(n, dtype=torch.float64)
    j = torch.arange(resampled_length(n, orig, new), dtype=torch.float64)
    t = (i[None, :] / orig - j[:, None] / new) * cutoff
    h = torch.special.sinc(t) * torch.cos(math.pi * t / (2 * width)) ** 2 * (cutoff / orig)
    h = torch.where(t.abs() < width, h, torch.zeros((), dtype=torch.float64))
    return h @ x.double()


@pytest.mark.parametrize("orig,new", RATE_PAIRS)
def test_matches_direct_float64_evaluation(orig, new):
    g = torch.Generator().manual_seed(orig + new)
    x = torch.rand(1501, generator=g, dtype=torch.float64) * 2 - 1
    want = direct_resample(x, orig, new)
    exact = resample(x, orig, new)  # float64 input: the filter is built in float64 too
    assert exact.shape == want.shape == (resampled_length(1501, orig, new),)
    assert (exact - want).abs().max().item() < 1e-12
    # float32 builds the filter in float32 (as torchaudio does); its rounding bounds the difference.
    single = resample(x.float(), orig, new)
    assert (single.double() - want).abs().max().item() < 5e-5


def test_tone_survives_downsampling():
    # Independent of the formula: a 1 kHz tone at 24 kHz is a 1 kHz tone at 16 kHz (away from the edges).
    t24 = torch.arange(24000, dtype=torch.float64) / 24000
    t16 = torch.arange(16000, dtype=torch.float64) / 16000
    got = resample(torch.sin(2 * math.pi * 1000 * t24).float(), 24000, 16000)
    err = (got.double() - torch.sin(2 * math.pi * 1000 * t16))[200:-200].abs().max().item()
    assert err < 1e-3


def test_batch_axes_and_lengths():
    x = torch.randn(2, 3, 1000)
    y = resample(x, 24000, 16000)
    assert y.shape == (2, 3, 667)  # ceil(1000 * 2 / 3)
    # Batched and per-row calls may run different conv1d algorithms (the CPU backend picks by shape), which
    # sum each output's taps in another order. Any float32 order is within n_taps * eps * sum|h_i * x_i| of
    # the exact sum, so two orders differ by at most twice that.
    kernel, _ = sinc_kernel(3, 2)
    n_taps = kernel.shape[-1]
    bound = 2 * n_taps * torch.finfo(torch.float32).eps * kernel.abs().sum(-1).max() * x.abs().max()
    for a in range(2):
        for b in range(3):
            assert (y[a, b] - resample(x[a, b], 24000, 16000)).abs().max() <= bound
    assert resample(x, 16000, 16000) is x


def test_bad_arguments():
    with pytest.raises(InputError, match="orig_freq=0"):
        resample(torch.randn(10), 0, 16000)
    with pytest.raises(InputError, match="new_freq=16000.5"):
        resample(torch.randn(10), 24000, 16000.5)
    with pytest.raises(InputError, match="float tensor"):
        resample(torch.arange(10), 24000, 16000)


@pytest.mark.parametrize("orig,new", RATE_PAIRS)
def test_matches_torchaudio(orig, new):
    torchaudio = pytest.importorskip("torchaudio")
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 24011, generator=g) * 0.3
    want = torchaudio.functional.resample(x, orig, new)
    got = resample(x, orig, new)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-6


@pytest.mark.gpu
def test_matches_torchaudio_on_cuda():
    torchaudio = pytest.importorskip("torchaudio")
    x = torch.randn(3, 48000, device="cuda") * 0.3
    for orig, new in RATE_PAIRS:
        want = torchaudio.functional.resample(x, orig, new)
        assert (resample(x, orig, new) - want).abs().max().item() <= 1e-6
