"""Quantize one Linear: low-rank correction (SVDQuant, arXiv 2411.05007) refit around GPTQ, plus smoothing.

    L = SVD_r(W)                        the branch kept in 16-bit takes the weight's dominant directions
    repeat:  Q = GPTQ(W - L)            int4 only has to represent what is left
             L = SVD_r(W - Q)           refit the branch to what int4 got wrong
    keep the (Q, L) with the lowest output error on calibration rows; stop when it stops improving.

Output error is measured through the real W4A4 forward (engine/w4a4/reference.py, activations quantized
too) as ||Y_w4a4 - Y|| / ||Y|| over the calibration sample. Smoothing strengths are screened cheaply (SVD +
round-to-nearest); the best one is then refit with GPTQ and kept only if it beats the unsmoothed result.

Linears that read one input (q/k/v, gate/up: `quantize_siblings`) take one smoothing decision together:
one vector from the input's statistics and their stacked weights, or none, whichever gives the lower mean
error. Equal smoothing is what lets the engine run them as one grouped GEMM (engine/kernels/w4a4.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.errors import QuantError
from engine.quantizer.gptq import GPTQConfig, gptq_quantize, quantize_rtn
from engine.quantizer.smooth import smoothing_factors
from engine.w4a4.format import STORE_DTYPE, SUPPORTED_RANKS, W4A4Tensors, check_group_multiple, pack_int4
from engine.w4a4.reference import dequantize_weight, w4a4_linear_reference


@dataclass
class LayerStats:
    """What calibration gathers about one Linear's inputs."""

    hessian: torch.Tensor  # [K, K] float32: sum of x^T x over calibration rows
    absmax: torch.Tensor  # [K] max |x| per input channel
    sample: torch.Tensor  # [S, K] calibration rows kept to measure output error
    rows: int  # calibration rows behind the Hessian


@dataclass(frozen=True)
class MethodConfig:
    rank: int = 16
    max_refits: int = 4  # SVD refits after the first GPTQ pass
    min_gain: float = 0.005  # a refit must lower the error by this fraction to continue
    alphas: tuple[float, ...] = (0.25, 0.5, 0.75)  # smoothing strengths screened; () turns smoothing off
    gptq: GPTQConfig = field(default_factory=GPTQConfig)
    stage_report: bool = False  # also measure GPTQ without low-rank (one more GPTQ pass per layer)

    def __post_init__(self) -> None:
        if self.rank not in SUPPORTED_RANKS:
            raise QuantError(f"rank={self.rank}: the W4A4 format supports ranks {SUPPORTED_RANKS}.")


@dataclass
class LayerResult:
    tensors: W4A4Tensors
    errors: dict[str, float]  # stage -> relative output error on the calibration sample
    alpha: float | None  # smoothing strength kept (None: no smoothing)
    refits: int  # SVD refits of the kept result
    screened_alpha: float | None = None  # the strength the cheap screen picked (kept or not)


def lowrank_factors(m: torch.Tensor, rank: int, power_iters: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-r approximation of m [N, K] as (proj_up [N, r], proj_down [K, r]) in the stored dtype.

    Randomized SVD (range finder with 2r columns and `power_iters` power iterations, seeded, so results
    are reproducible): within 0.1% of the exact truncated SVD's error on residual-like matrices
    (tests/test_quant_method.py), without a full SVD of the weight. The singular values are split evenly
    (sqrt on each side) so both factors have moderate magnitudes.
    """
    m = m.float()
    q = min(2 * rank, *m.shape)
    gen = torch.Generator(device=m.device).manual_seed(0)
    basis = torch.linalg.qr(m @ torch.randn(m.shape[1], q, generator=gen, device=m.device)).Q
    for _ in range(power_iters):
        basis = torch.linalg.qr(m @ (m.T @ basis)).Q
    u, s, vh = torch.linalg.svd(basis.T @ m, full_matrices=False)
    root = s[:rank].sqrt()
    return ((basis @ u[:, :rank]) * root).to(STORE_DTYPE), (vh[:rank].T * root).to(STORE_DTYPE)


def _lowrank_product(up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return up.float() @ down.float().T


def _pack(q, scales, up, down, smooth, bias) -> W4A4Tensors:
    return W4A4Tensors(
        qweight=pack_int4(q),
        wscales=scales.to(STORE_DTYPE),
        proj_down=down,
        proj_up=up,
        smooth=smooth.to(STORE_DTYPE) if smooth is not None else None,
        bias=bias,
    )


class _Problem:
    """One layer under one smoothing: W' = W * s, H' = H / (s s^T), rows' = rows / s."""

    def __init__(self, w, bias, stats: LayerStats, smooth: torch.Tensor | None, cfg: MethodConfig):
        self.cfg, self.smooth, self.bias = cfg, smooth, bias
        self.w = w.float() * smooth if smooth is not None else w.float()
        self.h = stats.hessian / (smooth[:, None] * smooth[None, :]) if smooth is not None else stats.hessian
        self.sample = stats.sample.float()
        self.y_ref = self.sample @ w.float().T + (bias.float() if bias is not None else 0.0)
        self.zero_up = torch.zeros(w.shape[0], cfg.rank, dtype=STORE_DTYPE, device=w.device)
        self.zero_down = torch.zeros(w.shape[1], cfg.rank, dtype=STORE_DTYPE, device=w.device)

    def error(self, t: W4A4Tensors) -> float:
        y = w4a4_linear_reference(self.sample, t)
        return float((y - self.y_ref).norm() / self.y_ref.norm().clamp_min(1e-30))

    def measure(self, q, scales, up, down) -> tuple[W4A4Tensors, float]:
        t = _pack(q, scales, up, down, self.smooth, self.bias)
        return t, self.error(t)

    def rtn(self, lowrank: bool) -> tuple[W4A4Tensors, float]:
        up, down = lowrank_factors(self.w, self.cfg.rank) if lowrank else (self.zero_up, self.zero_down)
        q, scales = quantize_rtn(self.w - _lowrank_product(up, down))
        return self.measure(q, scales, up, down)

    def gptq_plain(self) -> tuple[W4A4Tensors, float]:
        q, scales = gptq_quantize(self.w, self.h, self.cfg.gptq)
        return self.measure(q, scales, self.zero_up, self.zero_down)

    def gptq_lowrank(self) -> tuple[W4A4Tensors, float, float, int]:
        """Iterate GPTQ(W - L) / L = SVD_r(W - Q); returns (best, its error, first-pass error, refits)."""
        up, down = lowrank_factors(self.w, self.cfg.rank)
        best, best_err, first_err, refits = None, float("inf"), None, 0
        for it in range(self.cfg.max_refits + 1):
            q, scales = gptq_quantize(self.w - _lowrank_product(up, down), self.h, self.cfg.gptq)
            t, err = self.measure(q, scales, up, down)
            first_err = err if first_err is None else first_err
            improved = err < best_err * (1 - self.cfg.min_gain)
            if err < best_err:
                best, best_err, refits = t, err, it
            if not improved:
                break
            up, down = lowrank_factors(self.w - dequantize_weight(t.qweight, t.wscales), self.cfg.rank)
        return best, best_err, first_err, refits


def quantize_linear(
    w: torch.Tensor,
    stats: LayerStats,
    cfg: MethodConfig,
    bias: torch.Tensor | None = None,
    name: str = "layer",
) -> LayerResult:
    """Quantize weight w [N, K] (on stats' device) given its calibration statistics."""
    return quantize_siblings([w], stats, cfg, [bias], [name])[0]


def quantize_siblings(
    ws: list[torch.Tensor],
    stats: LayerStats,
    cfg: MethodConfig,
    biases: list[torch.Tensor | None],
    names: list[str],
) -> list[LayerResult]:
    """Quantize weights [N_i, K] that read one input (its calibration statistics), one smoothing for all."""
    k = stats.sample.shape[1]
    if stats.rows == 0 or stats.sample.shape[0] == 0:
        raise QuantError(
            f"{', '.join(names)}: no calibration rows reached the input; give calibration requests."
        )
    for w, name in zip(ws, names):
        check_group_multiple(name, w.shape[1])
        if w.shape[1] != k or stats.hessian.shape != (k, k):
            raise QuantError(f"{name}: calibration statistics are for {k} inputs, weight has {w.shape[1]}.")
    results = [_unsmoothed(w, bias, stats, cfg) for w, bias in zip(ws, biases)]
    if cfg.alphas:
        _smooth_together(results, ws, stats, cfg, biases)
    for res in results:
        res.errors["final"] = res.errors[
            "gptq+svd iterated" if res.alpha is None else "gptq+svd iterated smooth"
        ]
    return results


def _smooth_together(results: list[LayerResult], ws, stats: LayerStats, cfg: MethodConfig, biases) -> None:
    """Screen the smoothing strengths on all the weights at once; switch every result to the best one when
    that lowers the mean error after GPTQ."""

    def problems(smooth):
        return [_Problem(w, bias, stats, smooth, cfg) for w, bias in zip(ws, biases)]

    screened = {}
    for a in cfg.alphas:
        smooth = smoothing_factors(stats.absmax, torch.cat(ws), a)
        screened[a] = ([p.rtn(lowrank=True)[1] for p in problems(smooth)], smooth)
    a_best = min(screened, key=lambda a: _mean(screened[a][0]))
    screen_errors, smooth = screened[a_best]
    for res, err in zip(results, screen_errors):
        res.screened_alpha = a_best
        res.errors["rtn+svd smooth"] = err
    if _mean(screen_errors) >= _mean([r.errors["rtn+svd"] for r in results]):
        return
    smoothed = [p.gptq_lowrank() for p in problems(smooth)]
    for res, (_, err, _, _) in zip(results, smoothed):
        res.errors["gptq+svd iterated smooth"] = err
    if _mean([err for _, err, _, _ in smoothed]) < _mean([r.errors["gptq+svd iterated"] for r in results]):
        for res, (t, _, _, refits) in zip(results, smoothed):
            res.tensors, res.refits, res.alpha = t, refits, a_best


def _unsmoothed(w, bias, stats: LayerStats, cfg: MethodConfig) -> LayerResult:
    plain = _Problem(w, bias, stats, None, cfg)
    errors = {"rtn": plain.rtn(lowrank=False)[1]}
    if cfg.stage_report:
        errors["gptq"] = plain.gptq_plain()[1]
    errors["rtn+svd"] = plain.rtn(lowrank=True)[1]
    best, best_err, first_err, refits = plain.gptq_lowrank()
    errors["gptq+svd"] = first_err
    errors["gptq+svd iterated"] = best_err
    return LayerResult(tensors=best, errors=errors, alpha=None, refits=refits)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
