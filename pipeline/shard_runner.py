"""Run shards: pack a shard's rows into batches, synthesize, write wavs atomically, return per-row results.

The same ShardRunner serves local mode (in this process) and each Ray actor (pipeline.ray_runner).
A batch that raises is split in halves and each half retried, down to single rows, so one bad row
fails alone and a CUDA out-of-memory error retries smaller batches. A row's synth_seconds is its share
of its batch's wall time in proportion to its token work (packed tokens x decoding steps). Each batch that
settles its rows (ok, failed or rejected) is reported to an optional callback, so progress moves per batch.
"""

from __future__ import annotations

import importlib
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from engine.errors import InputError, OVBatchError
from engine.generate.batching import even_batches
from pipeline.atomic import write_wav_atomic
from pipeline.config import JobConfig
from pipeline.manifest import ManifestRow
from pipeline.rows import RequestRow, ResultRow
from pipeline.store import JobDir
from pipeline.tokens import write_tokens

MAX_ERROR_CHARS = 2000


@dataclass(frozen=True)
class BatchDone:
    """Rows of one attempt at shard `shard` that one batch settled, and the seconds of audio it made."""

    shard: int
    attempt: int
    rows: int
    audio_seconds: float


BatchCallback = Callable[[BatchDone], None]


@dataclass
class ShardTask:
    index: int
    variant: str
    bucket: int
    attempt: int
    rows: list[RequestRow]


def load_factory(spec: str) -> Callable[..., Any]:
    """'module:callable' -> the callable (the engine class, or a wrapper of it)."""
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise OVBatchError(
            f"engine_factory {spec!r} cannot be loaded ({e}): write it as 'module:callable' "
            "importable on every worker."
        ) from None


def is_out_of_memory(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def _release_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS]


def synth_request(row: ManifestRow) -> Any:
    """The engine request of a manifest row (planned or not)."""
    from engine.api import SynthRequest

    return SynthRequest(
        text=row.text,
        ref_audio=row.ref_audio,
        ref_text=row.ref_text,
        language=row.language,
        instruct=row.instruct,
        duration=row.duration,
        speed=row.speed,
        seed=row.seed,
    )


def pack_batches(rows: list[RequestRow], max_batch_tokens: int) -> list[list[RequestRow]]:
    """Longest first, cut into the fewest batches that fit, of about equal tokens (even_batches)."""
    longest_first = sorted(rows, key=lambda r: -r.packed_tokens)
    return even_batches(longest_first, lambda r: r.packed_tokens, max_batch_tokens)


class ShardRunner:
    """Holds one engine per variant (loaded on first use) and runs shards with it."""

    def __init__(self, job_path: str | Path, cfg: JobConfig):
        self.job = JobDir(job_path)
        self.cfg = cfg
        self.factory = load_factory(cfg.engine_factory)
        self.engines: dict[str, Any] = {}  # variant -> its engine
        self.host = socket.gethostname()
        self.worker = f"{self.host}:{os.getpid()}"

    def engine(self, variant: str) -> Any:
        if variant not in self.engines:
            self.engines[variant] = self.factory(self.cfg.engine_config(variant))
        return self.engines[variant]

    def run_shard(self, task: ShardTask, on_batch: BatchCallback | None = None) -> list[ResultRow]:
        engine = self.engine(task.variant)
        max_tokens = self.cfg.engine_config(task.variant).max_batch_tokens
        results: list[ResultRow] = []
        for batch in pack_batches(task.rows, max_tokens):
            results.extend(self._run_batch(engine, task, batch, on_batch))
        return results

    def _result(
        self, engine: Any, task: ShardTask, row: RequestRow, status: str, error: str | None = None, **measured
    ) -> ResultRow:
        return ResultRow.of(
            row,
            task.variant,
            status,
            error,
            shard=task,
            precision=str(engine.precision),
            model=str(engine.model_id),
            host=self.host,
            gpu=_gpu_name(engine),
            worker=self.worker,
            **measured,
        )

    def _run_batch(
        self, engine: Any, task: ShardTask, rows: list[RequestRow], on_batch: BatchCallback | None
    ) -> list[ResultRow]:
        """The results of `rows`; the batch that settles them reports them to on_batch (a batch split
        in halves leaves that to each half, so a row is reported once)."""
        started = _now()
        t0 = time.perf_counter()
        try:
            outputs = engine.synthesize([synth_request(r) for r in rows])
        except Exception as e:  # noqa: BLE001 - any engine failure is isolated to the rows that cause it
            if is_out_of_memory(e):
                _release_cuda_cache()
            if len(rows) > 1:
                half = len(rows) // 2
                return self._run_batch(engine, task, rows[:half], on_batch) + self._run_batch(
                    engine, task, rows[half:], on_batch
                )
            # An input the engine refuses will be refused again: that row is rejected, not failed.
            status = "rejected" if isinstance(e, InputError) else "failed"
            error = _error_text(e)
            failed = self._result(
                engine, task, rows[0], status, error, batch_size=1, started_at=started, finished_at=_now()
            )
            return _reported([failed], task, on_batch)
        wall = time.perf_counter() - t0
        return _reported(self._written(engine, task, rows, outputs, wall, started), task, on_batch)

    def _written(
        self, engine: Any, task: ShardTask, rows: list[RequestRow], outputs: list, wall: float, started: str
    ) -> list[ResultRow]:
        """Write a synthesized batch's wavs (and tokens); its rows' results."""
        finished = _now()
        work = [max(int(o.token_work), 0) for o in outputs]
        total = sum(work)
        results = []
        for row, out, w in zip(rows, outputs, work, strict=True):
            written = time.perf_counter()
            path = self.job.wav_path(task.variant, row.id)
            codes = getattr(out, "tokens", None)  # an engine_factory's own results may carry none
            if codes is not None:
                write_tokens(self.job, task.variant, row.id, codes)
            write_wav_atomic(path, out.audio, out.sample_rate)
            audio_seconds = len(out.audio) / float(out.sample_rate)
            fraction = w / total if total else 1.0 / len(rows)
            share = wall * fraction
            phases = _phase_seconds(getattr(out, "timings", None) or {}, fraction)
            results.append(
                self._result(
                    engine,
                    task,
                    row,
                    "ok",
                    batch_size=len(rows),
                    wav_path=self.job.relative(path),
                    audio_seconds=audio_seconds,
                    synth_seconds=share,
                    **phases,
                    write_seconds=time.perf_counter() - written,
                    rtf=share / audio_seconds if audio_seconds > 0 else None,
                    target_frames=int(out.target_frames),
                    token_work=w,
                    started_at=started,
                    finished_at=finished,
                )
            )
        return results


def _phase_seconds(timings: dict[str, float], fraction: float) -> dict[str, float | None]:
    """A row's seconds in each phase of its batch: its share (by token work) of the batch-wide phases,
    its own post-processing; None where the engine did not time a phase."""

    def share(phase: str) -> float | None:
        return timings[phase] * fraction if phase in timings else None

    return {
        "prepare_seconds": share("prepare"),
        "generate_seconds": share("generate"),
        "decode_seconds": share("decode"),
        "postprocess_seconds": timings.get("postprocess"),
    }


def _reported(results: list[ResultRow], task: ShardTask, on_batch: BatchCallback | None) -> list[ResultRow]:
    if on_batch is not None:
        audio_seconds = sum(r.audio_seconds or 0.0 for r in results)
        on_batch(BatchDone(task.index, task.attempt, len(results), audio_seconds))
    return results


def _gpu_name(engine: Any) -> str:
    device = getattr(engine, "device", None)
    if device is None or getattr(device, "type", str(device)) != "cuda":
        return ""
    import torch

    return torch.cuda.get_device_name(device)


def run_local(
    runner: ShardRunner, tasks: list[ShardTask], on_batch: BatchCallback | None = None
) -> Iterator[tuple[ShardTask, list[ResultRow]]]:
    """Local mode: the same shard runner, in this process, one shard after another."""
    for task in tasks:
        yield task, runner.run_shard(task, on_batch)
