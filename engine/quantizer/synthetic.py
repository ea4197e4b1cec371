"""Seeded weights and activations with the statistics of trained LLM layers, for tests and benchmarks.

Trained transformer Linears have a few dominant directions (a decaying low-rank part), heavy-tailed
entries, and inputs with a handful of outlier channels tens of times larger than the rest (the
quantization literature's motivating case: LLM.int8, SmoothQuant, SVDQuant). Random Gaussian weights have
none of this, so quantizer quality measured on them says little; these generators put it back.
"""

from __future__ import annotations

import torch


def structured_weight(n: int, k: int, generator: torch.Generator, std: float = 0.02) -> torch.Tensor:
    """W [N, K]: a low-rank part with decaying spectrum + Student-t (df 3) noise, overall std ~ `std`."""
    r = 32
    decay = torch.exp(-torch.arange(r, dtype=torch.float32) / 6.0)
    dev = generator.device
    u = torch.randn(n, r, generator=generator, device=dev)
    v = torch.randn(r, k, generator=generator, device=dev)
    lowrank = (u * decay.to(dev)) @ v / r**0.5
    noise = _student_t(n, k, 3.0, generator)
    w = 2.0 * lowrank / lowrank.std() + noise / noise.std()
    return w * (std / w.std())


def _student_t(n: int, k: int, df: float, generator: torch.Generator) -> torch.Tensor:
    z = torch.randn(n, k, generator=generator, device=generator.device)
    chi2 = torch.randn(n, k, int(df), generator=generator, device=generator.device).pow(2).sum(-1)
    return z / (chi2 / df).sqrt()


def outlier_channel_scales(k: int, generator: torch.Generator, n_outliers: int = 6, factor: float = 30.0):
    """Per-channel magnitudes [K]: log-normal spread plus `n_outliers` channels `factor` times larger."""
    scales = torch.exp(0.5 * torch.randn(k, generator=generator, device=generator.device))
    idx = torch.randperm(k, generator=generator, device=generator.device)[:n_outliers]
    scales[idx] *= factor
    return scales


def structured_activations(
    rows: int, channel_scales: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """x [rows, K]: correlated Gaussian rows (a shared low-rank component) times per-channel magnitudes."""
    k = channel_scales.shape[0]
    dev = generator.device
    shared = torch.randn(rows, 8, generator=generator, device=dev) @ torch.randn(
        8, k, generator=generator, device=dev
    )
    x = 0.6 * torch.randn(rows, k, generator=generator, device=dev) + 0.8 * shared / 8**0.5
    return x * channel_scales
