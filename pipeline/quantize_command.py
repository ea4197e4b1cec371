"""`ovbatch quantize CHECKPOINT --out DIR`: the command line of engine.quantizer.quantize_checkpoint, with
calibration rows read from a Parquet manifest as `ovbatch submit` reads them."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pipeline.manifest
from engine.devices import DTYPES
from engine.errors import QuantError
from engine.quantizer.calibrate import CalibRequest
from engine.quantizer.quantize import QuantizeOptions, format_report, quantize_checkpoint
from engine.w4a4.format import SUPPORTED_RANKS
from pipeline.config import TINY_CHECKPOINT

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ovbatch quantize", description="an official OmniVoice checkpoint -> a W4A4 checkpoint directory"
    )
    p.add_argument(
        "checkpoint",
        help="official OmniVoice checkpoint directory, Hugging Face repo id, or `tiny` (the embedded one)",
    )
    p.add_argument("--out", required=True, help="new directory for the W4A4 checkpoint")
    p.add_argument(
        "--rank", type=int, default=16, choices=SUPPORTED_RANKS, help="low-rank branch rank (default 16)"
    )
    p.add_argument("--calib", help="Parquet manifest whose rows calibrate (default: generated prompts)")
    p.add_argument("--samples", type=int, default=128, help="calibration requests (default 128)")
    p.add_argument(
        "--eval-requests", type=int, default=8, help="held-out requests for the W4A4-vs-FP check (default 8)"
    )
    p.add_argument(
        "--sample-rows",
        type=int,
        default=512,
        help="rows per Linear used to measure output error (default 512)",
    )
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="activation dtype (default auto: bf16 on CUDA, fp32 on CPU)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the calibration and evaluation prompts (default 0)"
    )
    p.add_argument("--stage-report", action="store_true", help="also measure GPTQ alone per layer (slower)")
    return p


def _manifest_requests(location: str, load_manifest: Callable | None, clip_dir: Path) -> list[CalibRequest]:
    """The calibration requests of a manifest, read as `ovbatch submit` reads it: remote clips (s3://, gs://
    ...) are copied into clip_dir, since the engine reads local files. Rows left out are logged."""
    manifest = (load_manifest or pipeline.manifest.load)(location, clip_dir=clip_dir)
    requests = [
        CalibRequest(
            text=r.text,
            ref_audio=r.ref_audio,
            ref_text=r.ref_text,
            language=r.language,
            instruct=r.instruct,
            seed=r.seed,
        )
        for r in manifest.rows
        if r.ref_audio and r.ref_text
    ]
    unreferenced = len(manifest.rows) - len(requests)
    reasons = [f"row {r.row_index}: {r.reason}" for r in manifest.rejected[:3]]
    if unreferenced:  # a valid row for submit (no voice to clone), but calibration clones voices
        reasons.insert(0, f"{unreferenced} without a reference clip and its transcript")
    if not requests:
        why = "; ".join(reasons) or "no rows"
        raise QuantError(
            f"calibration manifest {location} has no usable rows ({why}). Fix the rows or leave --calib out "
            "to calibrate on generated prompts."
        )
    if manifest.rejected or unreferenced:
        log.warning(
            "calibration manifest %s: %d row(s) left out (%s%s)",
            location,
            len(manifest.rejected) + unreferenced,
            "; ".join(reasons),
            "; ..." if len(manifest.rejected) > 3 else "",
        )
    return requests


def _source(checkpoint: str) -> str:
    """The checkpoint argument as a location: `tiny` is the embedded tiny checkpoint, made on first use."""
    if checkpoint != TINY_CHECKPOINT:
        return checkpoint
    from engine.tiny import ensure_tiny_checkpoint

    return str(ensure_tiny_checkpoint())


@contextlib.contextmanager
def _sigterm_ends_like_an_error() -> Iterator[None]:
    """SIGTERM (`kill`, a scheduler's stop) raises SystemExit(143) here, so that the hidden folder the
    checkpoint is built in and the copied calibration clips are removed on the way out: its default action
    ends the process at once and left them behind (the folder holds a whole checkpoint)."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)  # what a shell reports for a process SIGTERM ended

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None, load_manifest: Callable | None = None) -> int:
    """Entry of `ovbatch quantize`; load_manifest(location, clip_dir=...) -> manifest with .rows/.rejected
    (default: pipeline.manifest.load)."""
    args = build_parser().parse_args(argv)
    for flag in ("samples", "eval_requests", "sample_rows"):
        if getattr(args, flag) < 1:
            raise QuantError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: it must be at least 1.")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    options = QuantizeOptions(
        rank=args.rank,
        samples=args.samples,
        eval_requests=args.eval_requests,
        sample_rows=args.sample_rows,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        stage_report=args.stage_report,
    )
    with (
        _sigterm_ends_like_an_error(),
        tempfile.TemporaryDirectory(prefix="ovbatch-calib-clips-") as clip_dir,
    ):
        requests = _manifest_requests(args.calib, load_manifest, Path(clip_dir)) if args.calib else None
        report = quantize_checkpoint(_source(args.checkpoint), args.out, options, requests, args.calib)
    print(format_report(report))
    return 0
