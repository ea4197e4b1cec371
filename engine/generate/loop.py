"""The generation loop: pack a batch, run num_step forward passes, unmask target tokens step by step.

On CUDA the backbone of each packed layout is captured once as a CUDA graph (the batch padded up to a
token bucket) and replayed; the audio heads then run on exactly the batch's target rows (a few kernels a
step, so no graph is sized by a target count). Elsewhere, or when the attention backend loops on the host,
the model runs eagerly. Both give the same tokens.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from engine.config import EngineConfig, GenerationConfig
from engine.generate.batching import bucket_for
from engine.generate.decoding import BatchDecoder
from engine.generate.packing import GenItem, PackLayout, check_items, cond_len, pack_items, packed_tokens
from engine.model import OmniVoiceModel, PackedBatch

__all__ = ["GenItem", "HostBatch", "Runner", "choose_layout"]

log = logging.getLogger(__name__)


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def choose_layout(items: list[GenItem], buckets: tuple[int, ...]) -> PackLayout | None:
    """The padded layout (graph key) for a batch: the smallest token bucket that holds it, with sequence
    slots and max sequence length rounded up to powers of two; None if no bucket fits."""
    tokens = sum(packed_tokens(item) for item in items)
    bucket = bucket_for(tokens, sorted(buckets))
    if bucket is None:
        return None
    return PackLayout(
        tokens=bucket,
        sequences=_pow2_at_least(2 * len(items), 8),
        max_seqlen=min(bucket, _pow2_at_least(max(cond_len(item) for item in items), 64)),
    )


class GraphedForward:
    """The model's backbone (hidden_states) captured as a CUDA graph over static input buffers of one
    PackLayout; the heads run outside it, on each batch's own target rows."""

    def __init__(self, model: OmniVoiceModel, batch: PackedBatch, pool) -> None:
        self.batch = batch
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            model.hidden_states(batch)  # warm-up: lazy initialisation and autotuning outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.hidden = model.hidden_states(batch)

    def load(self, batch: PackedBatch) -> PackedBatch:
        """Copy a batch of this layout into the static buffers; returns the static batch to update."""
        for name in ("input_ids", "audio_mask", "position_ids", "cu_seqlens"):
            getattr(self.batch, name).copy_(getattr(batch, name))
        return self.batch

    def __call__(self, batch: PackedBatch) -> Tensor:
        """hidden_states of the loaded batch."""
        self.graph.replay()
        return self.hidden


@dataclass(frozen=True)
class HostBatch:
    """A batch checked and packed on the host (Runner.pack), ready for Runner.generate_packed."""

    items: list[GenItem]
    layout: PackLayout | None  # the padded layout on CUDA (its graph's key); None elsewhere
    packed: PackedBatch  # on the host


class Runner:
    def __init__(self, model: OmniVoiceModel, cfg: EngineConfig, device, dtype: torch.dtype) -> None:
        self.model, self.cfg = model, cfg
        self.device, self.dtype = torch.device(device), dtype
        self.num_codebooks, self.mask_id = model.cfg.num_audio_codebook, model.cfg.audio_mask_id
        self.graphs: dict[PackLayout, GraphedForward] = {}
        self._pool = None
        self.use_graphs = self._graphs_possible()

    def _graphs_possible(self) -> bool:
        if not self.cfg.cuda_graphs:
            return False
        if self.device.type != "cuda":
            log.info("CUDA graphs off: the model runs on %s", self.device)
            return False
        backend = self.model.attention_backend(self.device, self.dtype)
        if backend.name == "sdpa":
            log.info("CUDA graphs off: the sdpa attention backend walks the sequences on the host")
            return False
        return True

    @staticmethod
    def packed_tokens(item: GenItem) -> int:
        return packed_tokens(item)

    def pack(self, items: list[GenItem]) -> HostBatch:
        """Check the items and pack them on the host: the host work of generate() before the device's,
        which a caller may do ahead (on another thread) and pass to generate_packed().

        On CUDA the batch is padded to its bucket layout whether or not graphs are on, so eager and
        graph runs compute on the same shapes and give the same tokens.
        """
        check_items(items, self.num_codebooks, self.mask_id, self.model.cfg.llm.vocab_size)
        layout = choose_layout(items, self.cfg.buckets) if self.device.type == "cuda" else None
        return HostBatch(items, layout, pack_items(items, self.num_codebooks, self.mask_id, layout))

    def _prepare(self, host: HostBatch) -> tuple[PackedBatch, Callable[[PackedBatch], Tensor]]:
        """The device batch the loop updates in place, and the forward pass to run on it (logits at the
        batch's target rows, in the heads' dtype)."""
        layout = host.layout
        batch = host.packed.to(self.device)
        if batch.input_ids is host.packed.input_ids:  # on the host already: the steps must not write into it
            batch = replace(batch, input_ids=batch.input_ids.clone())
        eager = functools.partial(self.model, float32=False)
        if not self.use_graphs:
            return batch, eager
        if layout is None:
            log.info(
                "batch of %d tokens exceeds every bucket: running eagerly",
                sum(map(packed_tokens, host.items)),
            )
            return batch, eager
        graphed = self.graphs.get(layout)
        if graphed is None:
            log.info("capturing a CUDA graph for %s", layout)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graphed = self.graphs[layout] = GraphedForward(self.model, batch, self._pool)
        # The static buffers with this batch's own target rows (which the graph does not read).
        static = replace(graphed.load(batch), target_index=batch.target_index)
        return static, lambda b: self.model.head_logits(graphed(b), b.target_index)

    @torch.inference_mode()
    def capture(self, batches: list[list[tuple[int, int]]]) -> int:
        """Capture now the graphs of batches of these shapes ((cond length, target length) per request),
        so that no batch of theirs captures one; returns how many graphs were captured."""
        if not self.use_graphs:
            return 0
        before = len(self.graphs)
        for shapes in batches:
            items = [GenItem([0] * (cond - target), None, target, 0) for cond, target in shapes]
            layout = choose_layout(items, self.cfg.buckets)
            if layout is not None and layout not in self.graphs:  # None: such a batch runs eagerly
                self._prepare(self.pack(items))
        return len(self.graphs) - before

    def generate(self, items: list[GenItem], gen: GenerationConfig) -> list[Tensor]:
        """Audio tokens [C, target_len] per item, in order."""
        return self.generate_packed(self.pack(items), gen) if items else []

    @torch.inference_mode()
    def generate_packed(
        self, packed: HostBatch, gen: GenerationConfig, on_start: Callable[[], None] | None = None
    ) -> list[Tensor]:
        """generate() of a batch packed ahead (pack()). on_start: called once the batch is set up (its graph
        captured) and before its steps are queued."""
        items = packed.items
        batch, forward = self._prepare(packed)
        n = sum(item.target_len for item in items)
        write_index = batch.target_index[: 2 * n]  # cond targets, then uncond targets
        decoder = BatchDecoder(
            [item.target_len for item in items],
            [item.seed for item in items],
            self.num_codebooks,
            self.mask_id,
            gen,
            self.device,
            fused=self.cfg.fast_paths.fused_kernels,
        )
        if on_start is not None:
            on_start()
        for step in range(gen.num_step):
            logits = forward(batch)
            tokens = decoder.step(step, logits[:n], logits[n : 2 * n])
            batch.input_ids.index_copy_(1, write_index, torch.cat([tokens, tokens]).T)
        return decoder.request_tokens()
