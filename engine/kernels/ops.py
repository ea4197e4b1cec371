"""The custom ops (torch.ops.ovbatch_w4a4.*: W4A4, the fused norms, FP8 quantization) with fake
implementations.

The CUDA implementations are registered by the extension (csrc/binding.cpp) when `load()` succeeds; the
fake (meta) implementations here give shapes and dtypes without running anything, which is what CUDA-graph
capture and torch.compile need. Shapes follow csrc/w4a4_launch.h: activation rows are padded to a multiple
of M_PAD, packed weights to a multiple of BLOCK_N rows.
"""

from __future__ import annotations

import functools

import torch

from engine.errors import BackendUnavailable
from engine.kernels.build import load_extension

GROUP = 64
M_PAD = 256
BLOCK_N = 128
ACT_BLOCK_ROWS = 128  # rows of one quantized activation tile (engine/kernels/w4a4.py pack_activations)


def padded_rows(m: int, multiple: int = M_PAD) -> int:
    return (m + multiple - 1) // multiple * multiple


def _fake_quantize(x, smooth, pd_t):
    m, k = x.shape
    m_pad = padded_rows(m)
    return (
        x.new_empty((m_pad // ACT_BLOCK_ROWS, k // GROUP, ACT_BLOCK_ROWS * GROUP), dtype=torch.int8),
        x.new_empty((k // GROUP, m_pad), dtype=torch.float16),
        x.new_empty((m_pad,), dtype=torch.float32),
        x.new_empty((m_pad, pd_t.shape[0]), dtype=torch.float32),
    )


def _fake_rmsnorm_quantize(x, norm_weight, eps, smooth, pd_t):
    return _fake_quantize(x, smooth, pd_t)


def _fake_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps):
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _fake_gemm(
    qact,
    aratios,
    amax,
    lora,
    qweight,
    wscales,
    proj_up,
    bias,
    m,
    n,
    out_dtype,
    segment_starts=(),
    swiglu=False,
    residual=None,
):
    return qact.new_empty((m, n // 2 if swiglu else n), dtype=out_dtype)


def _fake_linear(x, smooth, pd_t, qweight, wscales, proj_up, bias, n):
    return x.new_empty((x.shape[0], n))


def _fake_fp8_rows(x):
    """e4m3 codes shaped like x and one float32 scale per row (csrc/binding.cpp fp8_quantize_rows)."""
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty((x.shape[0], 1), dtype=torch.float32)


@functools.lru_cache(maxsize=1)
def load() -> object:
    """Load the extension and register the fakes once; returns torch.ops.ovbatch_w4a4."""
    ok, reason = load_extension()
    if not ok:
        raise BackendUnavailable(f"W4A4 CUDA ops unavailable: {reason}")
    torch.library.register_fake("ovbatch_w4a4::quantize_act_lora_down")(_fake_quantize)
    torch.library.register_fake("ovbatch_w4a4::rmsnorm_quantize_act_lora_down")(_fake_rmsnorm_quantize)
    torch.library.register_fake("ovbatch_w4a4::qk_norm_rope")(_fake_qk_norm_rope)
    torch.library.register_fake("ovbatch_w4a4::rms_norm")(lambda x, weight, eps: x.new_empty(x.shape))
    torch.library.register_fake("ovbatch_w4a4::add_rms_norm")(
        lambda x, delta, weight, eps: x.new_empty(x.shape)
    )
    torch.library.register_fake("ovbatch_w4a4::silu_mul")(lambda gate, up: gate.new_empty(gate.shape))
    torch.library.register_fake("ovbatch_w4a4::snake")(
        lambda x, alpha, inv_alpha, bias=None, limits=None: x.new_empty(x.shape)
    )
    torch.library.register_fake("ovbatch_w4a4::gemm_lora_up")(_fake_gemm)
    torch.library.register_fake("ovbatch_w4a4::w4a4_linear")(_fake_linear)
    torch.library.register_fake("ovbatch_w4a4::fp8_quantize")(_fake_fp8_rows)
    torch.library.register_fake("ovbatch_w4a4::rms_norm_fp8")(lambda x, weight, eps: _fake_fp8_rows(x))
    torch.library.register_fake("ovbatch_w4a4::add_rms_norm_fp8")(lambda x, delta, w, eps: _fake_fp8_rows(x))
    torch.library.register_fake("ovbatch_w4a4::silu_mul_fp8")(lambda gate, up: _fake_fp8_rows(gate))
    return torch.ops.ovbatch_w4a4
