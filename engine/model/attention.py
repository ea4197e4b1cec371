"""Bidirectional attention over packed variable-length sequences.

Every backend takes q [T, Hq, D], k and v [T, Hkv, D] (GQA: Hq a multiple of Hkv), the int32
sequence boundaries `cu_seqlens` [S+1] and the longest sequence length, and returns [T, Hq, D].
Tokens attend to every token of their own sequence and to nothing else.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.errors import BackendUnavailable
from engine.kernels.flash4 import import_flash4_forward

log = logging.getLogger(__name__)

_HALF = (torch.float16, torch.bfloat16)


def _needs_cuda_half(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, f"needs a CUDA device, the model is on {device.type}"
    if dtype not in _HALF:
        return False, f"needs fp16 or bf16, the model runs in {dtype}"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 8:
        return False, f"needs compute capability >= 8.0, this GPU has {major}.x"
    return True, ""


class Backend:
    """A backend's calls need no state across a forward pass's layers unless it says otherwise."""

    def for_forward(self):
        """The attention to call for every layer of one forward pass over one batch."""
        return self


class FlashAttnBackend(Backend):
    """flash_attn.flash_attn_varlen_func (the flash-attn package)."""

    name = "flash"

    def __init__(self) -> None:
        self._fn = None

    def can_use(self, device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
        if importlib.util.find_spec("flash_attn") is None:
            return False, "the flash_attn package is not installed (pip install flash-attn)"
        try:
            from flash_attn import flash_attn_varlen_func
        except Exception as e:  # an installed build that does not match this torch or CUDA
            return False, f"flash_attn is installed but does not import ({e})"
        self._fn = flash_attn_varlen_func
        return _needs_cuda_half(device, dtype)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        scale = q.shape[-1] ** -0.5
        return self._fn(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale=scale, causal=False
        )


class FlashAttn4Backend(Backend):
    """flash-attn-4's varlen forward (CuTe DSL kernels for sm_90 and sm_100, compiled on the first call of
    each configuration: a layout is run once before graph capture, as the runner's warm-up does)."""

    name = "flash4"
    # sm_90, head_dim 128, on the engine's layouts (~64 sequences of 200-500 tokens): chosen by a tile
    # sweep on the H200 over the library's default 128 x 128 with the register-sourced P@V (ad hoc runs,
    # in the messages of commits 1d924aa and 27bd22d; bench/attention.py times this choice only).
    SM90_HEAD_DIM_128 = {"tile_mn": (192, 96), "mma_pv_is_rs": False}
    # Rows past a sequence's end that its last K/V tile can reach: under its tile's rows (96 here, 128 by
    # the library's defaults), doubled for margin.
    REACH = 256

    def __init__(self) -> None:
        self._fn = None
        self._tuned = False
        self._rows: Tensor | None = None  # arange(REACH) on the device, made by the warm-up before capture

    def can_use(self, device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
        ok, reason = _needs_cuda_half(device, dtype)  # first: the package takes seconds to import
        if not ok:
            return ok, reason
        major, _ = torch.cuda.get_device_capability(device)
        if major not in (9, 10):
            return False, "flash-attn-4 runs on Hopper (sm_90) and Blackwell (sm_100) only"
        try:
            self._fn = import_flash4_forward()
        except Exception as e:  # not installed, or installed without a working nvidia-cutlass-dsl
            return False, (
                f"flash_attn.cute does not import ({e}); pip install -e '.[flash4-cu13]' (CUDA 13 torch) "
                "or '.[flash4]' (CUDA 12)"
            )
        self._tuned = major == 9
        return True, ""

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        return self.for_forward()(q, k, v, cu_seqlens, max_seqlen)

    def for_forward(self) -> _Flash4Forward:
        """The calls of one forward pass: its layers write one output buffer, zeroed past the last
        sequence once."""
        return _Flash4Forward(self)

    def output_buffer(self, q: Tensor, v: Tensor, cu_seqlens: Tensor) -> Tensor:
        """[tokens + REACH, Hq, D] with the REACH rows after the last sequence zeroed.

        Its kernel loads whole K/V tiles past a sequence's end and masks their scores, and P = 0 times a
        NaN V row is NaN. The rows after the last sequence (a graph layout's padding: no kernel writes
        them) become the next layer's K/V there, so the REACH rows its last tile can read start at zero
        (the buffer has REACH spare rows, so the window fits where there is no padding)."""
        out = q.new_empty(q.shape[0] + self.REACH, q.shape[1], v.shape[-1])
        return out.index_fill_(0, cu_seqlens[-1:] + self._reach_rows(q.device), 0)

    def attend_into(
        self, out: Tensor, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int
    ) -> None:
        tuning = self.SM90_HEAD_DIM_128 if self._tuned and q.shape[-1] == 128 else {}
        self._fn(
            q,
            k,
            v,
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_k=cu_seqlens,
            max_seqlen_q=max_seqlen,
            max_seqlen_k=max_seqlen,
            causal=False,
            out=out,
            **tuning,
        )

    def _reach_rows(self, device: torch.device) -> Tensor:
        if self._rows is None or self._rows.device != device:
            self._rows = torch.arange(self.REACH, device=device)
        return self._rows


class _Flash4Forward:
    """flash4 over one forward pass's layers (the same tokens, heads and cu_seqlens each call). Its kernel
    writes only rows inside sequences, so the rows the first layer's buffer has zeroed stay zero for the
    layers after it; each layer's output is consumed by its o_proj before the next layer's attention
    overwrites it."""

    def __init__(self, backend: FlashAttn4Backend) -> None:
        self._backend = backend
        self._out: Tensor | None = None

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        tokens = q.shape[0]
        if self._out is None:
            self._out = self._backend.output_buffer(q, v, cu_seqlens)
        self._backend.attend_into(self._out[:tokens], q, k, v, cu_seqlens, max_seqlen)
        return self._out[:tokens]


class TorchVarlenBackend(Backend):
    """torch.nn.attention.varlen.varlen_attn (PyTorch's built-in flash varlen kernel)."""

    name = "varlen"

    def __init__(self) -> None:
        self._fn = None
        self._native_gqa = False

    def can_use(self, device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
        ok, reason = _needs_cuda_half(device, dtype)  # first: the module imports torch._dynamo (seconds)
        if not ok:
            return ok, reason
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            return False, f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn"
        self._fn = varlen_attn
        self._native_gqa = "enable_gqa" in inspect.signature(varlen_attn).parameters
        return True, ""

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        if q.shape[1] == k.shape[1]:
            return self._fn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
        if self._native_gqa:
            return self._fn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, enable_gqa=True)
        # varlen_attn without enable_gqa (torch 2.11) would need k and v repeated per query head, two copies
        # a layer; the flash kernel under it takes fewer k/v heads as they are.
        out = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, False, False
        )
        return out[0]


class SdpaBackend(Backend):
    """F.scaled_dot_product_attention one sequence at a time: any device, any dtype (the reference)."""

    name = "sdpa"

    def can_use(self, device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
        return True, ""

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        out = torch.empty_like(q)
        group = q.shape[1] // k.shape[1]
        bounds = cu_seqlens.tolist()
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end == start:
                continue
            qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
            if group > 1:
                ks, vs = ks.repeat_interleave(group, dim=0), vs.repeat_interleave(group, dim=0)
            out[start:end] = F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1)
        return out


BACKENDS = {
    "flash": FlashAttnBackend,
    "flash4": FlashAttn4Backend,
    "varlen": TorchVarlenBackend,
    "sdpa": SdpaBackend,
}
# Fastest first: flash4 ran 1.3-1.4x torch's varlen kernel on the H200 (bench/attention.py); torch vendors
# FlashAttention-2's kernels, which the flash-attn 2 package ("flash") calls too (not measured here).
PRIORITY = ("flash4", "flash", "varlen", "sdpa")


def choose_attention(choice: str, device: torch.device, dtype: torch.dtype):
    """The backend for `choice` ("auto" or a name); logs the pick and why faster ones were skipped."""
    device = torch.device(device)
    if choice != "auto":
        if choice not in BACKENDS:
            raise BackendUnavailable(f"attention={choice!r} is unknown: choose auto, {', '.join(PRIORITY)}.")
        backend = BACKENDS[choice]()
        ok, reason = backend.can_use(device, dtype)
        if not ok:
            raise BackendUnavailable(
                f"attention backend {choice!r} cannot run here: {reason}. Use attention=auto to fall back."
            )
        log.info("attention backend: %s (requested)", choice)
        return backend
    skipped = []
    for name in PRIORITY[:-1]:
        backend = BACKENDS[name]()
        ok, reason = backend.can_use(device, dtype)
        if ok:
            break
        skipped.append(f"; skipped {name}: {reason}")
    else:
        backend = SdpaBackend()  # runs on any device and dtype
    log.info("attention backend: %s%s", backend.name, "".join(skipped))
    return backend
