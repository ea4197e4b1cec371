"""The greedy decoding step's vocabulary work in one Triton kernel: for each (frame, codebook) row of the
conditional and unconditional logits (bf16/fp16, as the audio heads write them), guidance on
log-probabilities, a second log-softmax, MASK excluded, then the argmax and its log-probability (the
position's confidence). torch's path (engine/generate/decoding.py) makes float32 copies of both logit
tensors and runs about ten passes over them; this reads each logit once.

Imported only where Triton runs (engine/kernels/heads.py decides).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _log_softmax(x, valid):
    x = x - tl.max(x, axis=0)
    return x - tl.log(tl.sum(tl.where(valid, tl.exp(x), 0.0), axis=0))


@triton.jit
def _guided_argmax_kernel(
    cond, uncond, tokens, confidence, vocab, scale, mask_id, BLOCK: tl.constexpr, GUIDED: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    valid = cols < vocab
    c = tl.load(cond + row * vocab + cols, mask=valid, other=float("-inf")).to(tl.float32)
    log_probs = _log_softmax(c, valid)
    if GUIDED:
        u = tl.load(uncond + row * vocab + cols, mask=valid, other=float("-inf")).to(tl.float32)
        guided = log_probs + scale * (log_probs - _log_softmax(u, valid))
        guided = tl.where(valid, guided, float("-inf"))
        log_probs = _log_softmax(guided, valid)
    log_probs = tl.where(valid & (cols != mask_id), log_probs, float("-inf"))
    best = tl.max(log_probs, axis=0)
    tl.store(tokens + row, tl.argmax(log_probs, axis=0, tie_break_left=True).to(tl.int64))
    tl.store(confidence + row, best)


def guided_argmax(
    cond: torch.Tensor, uncond: torch.Tensor, guidance_scale: float, mask_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """cond, uncond [N, C, V] -> (tokens int64 [N, C], confidence float32 [N, C])."""
    cond, uncond = cond.contiguous(), uncond.contiguous()
    *shape, vocab = cond.shape
    tokens = torch.empty(shape, dtype=torch.int64, device=cond.device)
    confidence = torch.empty(shape, dtype=torch.float32, device=cond.device)
    rows = tokens.numel()
    if rows:
        _guided_argmax_kernel[(rows,)](
            cond,
            uncond,
            tokens,
            confidence,
            vocab,
            float(guidance_scale),
            mask_id,
            BLOCK=triton.next_power_of_2(vocab),
            GUIDED=guidance_scale != 0,
            num_warps=4,
        )
    return tokens, confidence
