"""Lay the sequences of a batch of requests end to end into one PackedBatch.

Every request contributes two sequences: the conditional one [prompt text ids on all C rows, reference
audio tokens, MASK x target_len] and the unconditional one [MASK x target_len] (classifier-free
guidance). Order on the token axis: cond_0 .. cond_{B-1}, uncond_0 .. uncond_{B-1}, then optionally
padding tokens up to a fixed token count (CUDA-graph buckets), in no sequence. `target_index` lists the
cond target positions of all requests (request-major), then the uncond ones, exactly (never padded), so
logits[:N] are conditional and logits[N:2N] unconditional, N = sum of target lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.errors import InputError
from engine.model import PackedBatch


@dataclass
class GenItem:
    prompt_ids: list[int]  # from TextFrontend.prompt_ids
    ref_tokens: Tensor | None  # [C, Tr] reference audio codes (None: no reference)
    target_len: int  # target frames
    seed: int  # per-request RNG: outputs do not depend on batch neighbours


def cond_len(item: GenItem) -> int:
    ref = 0 if item.ref_tokens is None else item.ref_tokens.shape[-1]
    return len(item.prompt_ids) + ref + item.target_len


def packed_tokens(item: GenItem) -> int:
    """Tokens a request occupies in a packed batch: its cond plus its uncond sequence."""
    return cond_len(item) + item.target_len


def check_items(items: list[GenItem], num_codebooks: int, mask_id: int, text_vocab: int) -> None:
    """InputError naming the first item that cannot be generated."""
    for i, item in enumerate(items):
        if item.target_len < 1:
            raise InputError(
                f"item {i}: target_len={item.target_len}; a request needs at least 1 target frame."
            )
        if not item.prompt_ids or min(item.prompt_ids) < 0 or max(item.prompt_ids) >= text_vocab:
            raise InputError(
                f"item {i}: prompt_ids must be a non-empty list of ids in [0, {text_vocab}); "
                "build them with TextFrontend.prompt_ids."
            )
        ref = item.ref_tokens
        if ref is not None and (
            ref.dim() != 2
            or ref.shape[0] != num_codebooks
            or ref.shape[1] == 0
            or ref.min() < 0
            or ref.max() >= mask_id
        ):
            raise InputError(
                f"item {i}: ref_tokens of shape {tuple(ref.shape)} with values in "
                f"[{int(ref.min()) if ref.numel() else 0}, {int(ref.max()) if ref.numel() else 0}]; expected "
                f"[{num_codebooks}, frames > 0] codec codes in [0, {mask_id}) (Codec.encode output), or None."
            )


def _cond_sequence(item: GenItem, num_codebooks: int, mask_id: int) -> tuple[Tensor, Tensor]:
    text = torch.tensor(item.prompt_ids, dtype=torch.long).expand(num_codebooks, -1)
    parts = [text]
    if item.ref_tokens is not None:
        parts.append(item.ref_tokens.to(device="cpu", dtype=torch.long))
    parts.append(torch.full((num_codebooks, item.target_len), mask_id, dtype=torch.long))
    ids = torch.cat(parts, dim=1)
    audio_mask = torch.arange(ids.shape[1]) >= len(item.prompt_ids)
    return ids, audio_mask


@dataclass(frozen=True)
class PackLayout:
    """Fixed sizes a packed batch is padded to (one CUDA graph per layout); None: exact sizes."""

    tokens: int
    sequences: int  # entries of cu_seqlens minus one
    max_seqlen: int


def pack_items(
    items: list[GenItem], num_codebooks: int, mask_id: int, layout: PackLayout | None = None
) -> PackedBatch:
    """The packed cond + uncond sequences of `items` (on CPU), padded to `layout` when given."""
    ids, masks, lengths = [], [], []
    cond_targets, uncond_targets = [], []
    start = 0
    for item in items:
        cond_ids, cond_mask = _cond_sequence(item, num_codebooks, mask_id)
        ids.append(cond_ids)
        masks.append(cond_mask)
        lengths.append(cond_ids.shape[1])
        cond_targets.append(torch.arange(start + lengths[-1] - item.target_len, start + lengths[-1]))
        start += lengths[-1]
    for item in items:
        ids.append(torch.full((num_codebooks, item.target_len), mask_id, dtype=torch.long))
        masks.append(torch.ones(item.target_len, dtype=torch.bool))
        lengths.append(item.target_len)
        uncond_targets.append(torch.arange(start, start + item.target_len))
        start += item.target_len
    target_index = torch.cat(cond_targets + uncond_targets)
    max_seqlen = max(lengths)
    pad = 0
    if layout is not None:
        pad = layout.tokens - start
        if pad < 0 or max_seqlen > layout.max_seqlen or len(lengths) > layout.sequences:
            raise InputError(
                f"batch ({start} tokens, {len(lengths)} sequences) does not fit {layout}: "
                "take the layout from engine.generate.loop.choose_layout(items, buckets)."
            )
        # Padding tokens belong to no sequence: attention never reads or writes them, and nothing reads
        # what the other layers compute on them. Unused sequence slots are empty sequences.
        ids.append(torch.zeros((num_codebooks, pad), dtype=torch.long))
        masks.append(torch.zeros(pad, dtype=torch.bool))
        lengths += [0] * (layout.sequences - len(lengths))
        max_seqlen = layout.max_seqlen
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    return PackedBatch(
        input_ids=torch.cat(ids, dim=1),
        audio_mask=torch.cat(masks),
        position_ids=torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(pad, dtype=torch.long)]),
        cu_seqlens=torch.nn.functional.pad(seq_lens.cumsum(0, dtype=torch.int32), (1, 0)),
        max_seqlen=max_seqlen,
        target_index=target_index,
    )
