"""Row sizes for the planner, computed on the driver's CPU without the model or the codec.

`RequestFrontend` (engine.frontend.requests) is the engine's own request preparation without the codes:
every distinct reference clip is prepared as the engine prepares it and counted in codec frames (in a
pool of processes: a manifest whose rows each bring their own clip spends its planning here), then each
row is checked (an InputError rejects it at planning time, as the actors would) and sized by its text
chunks: the row by its largest chunk (prompt text ids + reference frames + 2 x target frames), its work
by all of them. The actors encode the clips on their GPUs, through the shared prompt cache, when they
run the rows.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from multiprocessing import get_context

from engine.checkpoint import locate_checkpoint
from engine.frontend.audio import ClipSource, ReferenceSettings
from engine.frontend.requests import CodecShape, PreparedRequest, RequestFrontend, reference_frames
from pipeline import manifest as manifest_mod
from pipeline.config import JobConfig
from pipeline.plan import RowSize, Sizer
from pipeline.shard_runner import synth_request

# Fewer distinct clips than this are prepared in this process (a pool's start-up would cost more).
POOL_MIN_CLIPS = 64


def prepared_size(frontend: RequestFrontend, prepared: PreparedRequest) -> RowSize:
    """Packed tokens of a prepared request, laid out as the engine packs them (chunk_sizes)."""
    sizes = [RowSize(*size) for size in frontend.chunk_sizes(prepared)]
    largest = max(sizes, key=lambda s: s.packed_tokens)
    if len(sizes) == 1:
        return largest
    return replace(largest, chunked_tokens=sum(s.packed_tokens for s in sizes))


def clip_frames(clip: str, codec: CodecShape, settings: ReferenceSettings) -> int | Exception:
    """reference_frames of a clip, or what stops the clip (so that it rejects its rows, not the plan)."""
    try:
        return reference_frames(clip, codec, settings)
    except Exception as e:
        return e


def clip_frames_all(
    frontend: RequestFrontend, clips: Sequence[str], workers: int
) -> dict[str, int | Exception]:
    """clip_frames of every clip, over `workers` processes when there are many clips."""
    settings = frontend.reference_settings
    if workers < 2 or len(clips) < POOL_MIN_CLIPS:
        return {clip: clip_frames(clip, frontend.codec, settings) for clip in clips}
    n = len(clips)
    # spawn: the driver may hold threads (Ray, torch) that a forked child would inherit mid-lock.
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        frames = pool.map(clip_frames, clips, [frontend.codec] * n, [settings] * n, chunksize=16)
        return dict(zip(clips, frames))


class FrontendSizer:
    """Sizes rows with the first variant's request frontend; every reference clip is prepared once."""

    def __init__(self, frontend: RequestFrontend, rows: Sequence[manifest_mod.ManifestRow], workers: int):
        self.frontend = frontend
        clips = sorted({str(r.ref_audio) for r in rows if r.ref_audio is not None})
        self.frames = clip_frames_all(frontend, clips, workers)

    def _frames_of(self, clip: ClipSource) -> int:
        frames = self.frames.get(str(clip))
        if frames is None:
            frames = self.frames[str(clip)] = self.frontend.reference_frames(clip)
        if isinstance(frames, Exception):
            raise frames
        return frames

    def __call__(self, row: manifest_mod.ManifestRow) -> RowSize:
        return prepared_size(self.frontend, self.frontend.size(synth_request(row), self._frames_of))


def planning_frontend(cfg: JobConfig) -> RequestFrontend:
    """The first variant's request frontend: its checkpoint's tokenizer and codec config, nothing more."""
    engine_cfg = cfg.engine_config(cfg.variant_names()[0])
    return RequestFrontend.from_checkpoint(engine_cfg, locate_checkpoint(engine_cfg.checkpoint)[0])


def frontend_sizer(cfg: JobConfig, rows: Sequence[manifest_mod.ManifestRow]) -> Sizer:
    return FrontendSizer(planning_frontend(cfg), rows, workers=len(os.sched_getaffinity(0)))
