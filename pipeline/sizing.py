"""Row sizes for the planner, computed on the driver's CPU without the model or the codec.

`RequestFrontend` (engine.frontend.requests) is the engine's own request preparation without the codes:
every distinct reference clip is prepared as the engine prepares it and counted in codec frames (in
worker processes, one per core: a manifest whose rows each bring their own clip spends its planning
here), then each row is checked (an InputError rejects it at planning time, as the actors would) and
sized by its text chunks: the row by its largest chunk (prompt text ids + reference frames + 2 x target
frames), its work by all of them. The actors encode the clips on their GPUs, through the shared prompt
cache, when they run the rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, replace

from engine.checkpoint import locate_checkpoint
from engine.errors import AudioError
from engine.frontend.audio import ClipSource
from engine.frontend.requests import PreparedRequest, RequestFrontend
from pipeline import clip_pool
from pipeline import manifest as manifest_mod
from pipeline.config import JobConfig
from pipeline.plan import RowSize, Sizer
from pipeline.shard_runner import synth_request


def prepared_size(frontend: RequestFrontend, prepared: PreparedRequest) -> RowSize:
    """Packed tokens of a prepared request, laid out as the engine packs them (chunk_sizes)."""
    sizes = [RowSize(*size) for size in frontend.chunk_sizes(prepared)]
    largest = replace(max(sizes, key=lambda s: s.packed_tokens), cut_to_budget=prepared.cut_to_budget)
    if len(sizes) == 1:
        return largest
    return replace(largest, chunked_tokens=sum(s.packed_tokens for s in sizes))


def clip_frames_all(
    frontend: RequestFrontend, clips: Sequence[str], workers: int
) -> dict[str, int | Exception]:
    """Codec frames of every clip's prompt, or what stops the clip (so that it rejects its rows, not the
    plan), over `workers` worker processes (pipeline.clip_pool) when there are many clips."""
    task = {
        "task": "frames",
        "sample_rate": frontend.codec.sample_rate,
        "hop_length": frontend.codec.hop_length,
        "settings": asdict(frontend.reference_settings),
    }
    answers = clip_pool.map_clips(task, clips, workers)
    frames: dict[str, int | Exception] = {}
    for clip in clips:
        if clip in answers:
            frames[clip] = _answer(answers[clip])
            continue
        try:
            frames[clip] = frontend.reference_frames(clip)
        except Exception as e:
            frames[clip] = e
    return frames


def _answer(answer: dict) -> int | Exception:
    if "frames" in answer:
        return answer["frames"]
    if "audio_error" in answer:
        return AudioError(answer["audio_error"])
    return RuntimeError(answer["error"])


class FrontendSizer:
    """Sizes rows with the first variant's request frontend; every reference clip is prepared once."""

    def __init__(self, frontend: RequestFrontend, rows: Sequence[manifest_mod.ManifestRow], workers: int):
        self.frontend = frontend
        clips = sorted({str(r.ref_audio) for r in rows if r.ref_audio is not None})
        self.frames = clip_frames_all(frontend, clips, workers)

    def _frames_of(self, clip: ClipSource) -> int:
        frames = self.frames[str(clip)]  # every clip of the rows the sizer was made for
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
    return FrontendSizer(planning_frontend(cfg), rows, workers=clip_pool.worker_count())
