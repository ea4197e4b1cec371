"""`ovbatch`: submit, status, rerun, report, demo, manifest check, synth, quantize.

Errors the project raises on purpose (OVBatchError) print one line and exit with code 2; a job that
finishes with failed rows (or a manifest check that finds rejected ones) exits with code 1 and says what
to do; any other error prints its traceback and one line, and exits 3; Ctrl-C exits 130, and a reader
that stops reading 141 (docs/pipeline.md lists them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

from engine.errors import InputError, OVBatchError
from pipeline import ray_head
from pipeline.messages import first_line, first_line_of

EXIT_FAILED_ROWS = 1
EXIT_ERROR = 2
EXIT_UNEXPECTED = 3
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a command whose reader went away
ERROR_CHARS = 300  # of a row's error shown on the terminal (the results files hold all of it)
OVERRIDE_FORM = "write overrides as key=value, e.g. engine.precision=fp16"
CHECKPOINT_HELP = (
    "checkpoint directory, Hugging Face repo id, or tiny-w4a4 (the tiny checkpoint quantized, made on "
    "first use); default: the embedded tiny checkpoint"
)


def _flag_settings(args: argparse.Namespace, **given: Any) -> dict[str, Any]:
    """Config keys set by flags and positional arguments (`given`), taken literally: a path holding `${`
    or `#` stays that path. The free key=value overrides win over them."""
    out = dict(given)
    if getattr(args, "checkpoint", None):
        out["engine.checkpoint"] = args.checkpoint
    if getattr(args, "local", False):
        out["local"] = True
    if getattr(args, "address", None):
        out["ray.address"] = args.address
    return out


def _tiny_checkpoint_dir() -> Path:
    from engine.config import cache_root
    from engine.tiny import TINY_VERSION

    return cache_root() / f"tiny-v{TINY_VERSION}"


def _print_checkpoints(job: Any) -> None:
    """Where each variant's checkpoint is: a user comparing or reusing them needs the paths."""
    for variant, settings in job.read_plan().engine_settings.items():
        checkpoint = settings.get("checkpoint") or f"the embedded tiny checkpoint, {_tiny_checkpoint_dir()}"
        print(f"  checkpoint ({variant}): {checkpoint}")


def _print_problems(s: dict[str, Any]) -> None:
    """The first failed and rejected rows with their reasons, and the files that list them all."""
    advice = {
        "rejected": "not run: fix their inputs and submit them to a new --out",
        "failed": f"`ovbatch rerun {s['job']}` runs them again",
    }
    for status in ("rejected", "failed"):
        p = s["problems"][status]
        if not p["count"]:
            continue
        print(f"{p['count']} row(s) {status} ({advice[status]}):")
        for r in p["examples"]:
            variant = f" [{r['variant']}]" if status == "failed" and len(s["variants"]) > 1 else ""
            error = first_line_of(r["error"] or "", ERROR_CHARS)
            print(f"  row {r['row_index']} id={r['id']!r}{variant}: {error}")
        if p["distinct"] > len(p["examples"]):
            print(f"  ... and {p['distinct'] - len(p['examples'])} more")
        shown = ", ".join(p["files"][:3]) + (
            f" and {len(p['files']) - 3} more" if len(p["files"]) > 3 else ""
        )
        print(f"  listed with status={status!r} and the reason in `error` in: {shown}")


def _print_outcome(outcome: Any) -> int:
    from pipeline.summary import realtime_text

    s = outcome.summary
    rows = s["rows"]
    variants = f" over {len(s['variants'])} variants" if len(s["variants"]) > 1 else ""  # a row in each
    print(
        f"job {s['job']}: {rows['ok']} ok, {rows['failed']} failed, {rows['rejected']} rejected, "
        f"{rows['pending']} pending{variants}; {len(outcome.shards_run)} shard(s) run; "
        f"wall {s['wall_seconds']:.1f} s; {realtime_text(s['x_realtime'])}"
    )
    print(f"  wavs:    {outcome.job.path / 'wavs'}")
    print(f"  results: {outcome.job.results_dir}")
    print(f"  summary: {outcome.job.summary_path}")
    if (outcome.job.report_dir / "index.html").exists():
        print(f"  report:  {outcome.job.report_dir / 'index.html'}")
    _print_checkpoints(outcome.job)
    _print_problems(s)
    return EXIT_FAILED_ROWS if rows["failed"] else 0


def cmd_submit(args: argparse.Namespace) -> int:
    from pipeline.config import load_job_config
    from pipeline.job import may_run, submit

    cfg = load_job_config(args.config, args.overrides, _flag_settings(args, manifest=args.manifest))
    # Ray comes up while the job's modules import and it reads its input
    with ray_head.own_ray(cfg, needed=may_run(args.out)) as head:
        from pipeline.sizing import frontend_sizer

        return _print_outcome(submit(cfg, args.out, frontend_sizer, head))


def cmd_rerun(args: argparse.Namespace) -> int:
    from pipeline.config import load_job_config
    from pipeline.job import rerun, shards_to_rerun
    from pipeline.store import JobDir

    job = JobDir(args.job)
    job.require()
    job.refuse_if_running()
    cfg = load_job_config(job.config_path, args.overrides, _flag_settings(args))  # as rerun() reads it
    with ray_head.own_ray(cfg, needed=bool(shards_to_rerun(job))) as head:
        return _print_outcome(rerun(args.job, args.overrides, _flag_settings(args), head))


def _run_note(run: dict[str, Any]) -> str | None:
    """What status says about a run that did not finish normally."""
    if run["state"] == "stopped":
        return f"stopped by {run['stopped_by']} after {run['wall_seconds']:.1f} s"
    if run["state"] == "unfinished":
        return (
            f"no end recorded (killed, or still running); counted up to its last finished shard: "
            f"{run['wall_seconds']:.1f} s, {run['shards_finished']} of {run['shards']} shard(s)"
        )
    return None


def _time_line(split: dict[str, float]) -> str:
    """The summary's time split in words: what filled the wall, what ran beside the engines' calls, and the
    generation stream's measured idle (CUDA only: none on the CPU)."""
    from pipeline.summary import BESIDE_ENGINE, WITHIN_WALL

    def words(keys) -> str:
        return ", ".join(f"{k.replace('_', ' ')} {split[k]:.1f}" for k in keys if k in split)

    line = f"time (s): {words(k for k in split if k not in BESIDE_ENGINE + WITHIN_WALL)}"
    line += f" | beside the engine: {words(BESIDE_ENGINE)}"
    if split.get("generation_idle"):
        line += f" | {words(WITHIN_WALL)} (within the wall)"
    return line


def cmd_status(args: argparse.Namespace) -> int:
    from pipeline.job import status
    from pipeline.store import JobDir
    from pipeline.summary import counts_time, realtime_text

    s = status(args.job)
    if args.json:
        print(json.dumps(s, indent=1))
        return 0
    rows, shards = s["rows"], s["shards"]
    print(f"job {s['job']} ({'complete' if s['complete'] else 'incomplete'})")
    print(
        f"  rows: {rows['ok']} ok, {rows['failed']} failed, {rows['rejected']} rejected, "
        f"{rows['pending']} pending of {rows['total']}"
    )
    print(f"  shards: {shards['finished']} of {shards['planned']} finished")
    timed = [r for r in s["runs"] if counts_time(r)]
    idle = len(s["runs"]) - len(timed)
    idle_note = f" (+{idle} that had nothing to run)" if idle else ""
    print(
        f"  wall {s['wall_seconds']:.1f} s over {len(timed)} run(s){idle_note}; "
        f"audio {s['audio_seconds']:.1f} s; {realtime_text(s['x_realtime'])} "
        f"(the engine's time alone: {realtime_text(s['engine_x_realtime'])})"
    )
    if timed:
        print(f"  {_time_line(s['time'])}")
    for run in timed:
        note = _run_note(run)
        if note:
            print(f"  run {run.get('kind', '?')} started {run.get('started_at', '?')}: {note}")
    for b in s["per_bucket"]:
        print(
            f"  {b['variant']} bucket {b['bucket']}: {b['rows']} rows, {b['rows_per_s'] or 0:.2f} rows/s, "
            f"{realtime_text(b['x_realtime'])}"
        )
    _print_checkpoints(JobDir(args.job))
    _print_problems(s)
    left = shards["planned"] - shards["finished"]
    running = JobDir(args.job).running_by()
    if left and running:
        print(f"running now ({running}): {left} shard(s) not finished yet.")
    elif left:
        print(
            f"{left} shard(s) not run yet: `ovbatch rerun {s['job']}` runs them (so does submitting the "
            "same manifest and config to this --out again)."
        )
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from pipeline.config import load_job_config
    from pipeline.report import write_report
    from pipeline.store import JobDir

    job = JobDir(args.job)
    job.require()
    cfg = load_job_config(job.config_path if job.config_path.is_file() else None, args.overrides)
    print(write_report(job, cfg.compare))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from pipeline.demo import DEMO_AB_OUT, DEMO_OUT, run_demo

    out = args.out or (DEMO_AB_OUT if args.ab else DEMO_OUT)
    return _print_outcome(run_demo(out, local=args.local, overrides=list(args.overrides), ab=args.ab))


def cmd_manifest_check(args: argparse.Namespace) -> int:
    from pipeline.config import load_job_config
    from pipeline.job import check_manifest
    from pipeline.sizing import frontend_sizer

    cfg = load_job_config(args.config, args.overrides, _flag_settings(args, manifest=args.file))
    report = check_manifest(cfg, frontend_sizer)
    print(
        f"manifest {report['source']}: {report['rows']} rows, {report['accepted']} accepted, "
        f"{len(report['rejected'])} rejected; buckets {report['buckets']}"
    )
    for r in report["rejected"][: args.limit]:
        print(f"  row {r.row_index} id={r.id!r}: {r.reason}")
    if len(report["rejected"]) > args.limit:
        print(f"  ... and {len(report['rejected']) - args.limit} more")
    return 1 if report["rejected"] else 0


def cmd_synth(args: argparse.Namespace) -> int:
    from engine.api import Engine, SynthRequest
    from pipeline.atomic import write_wav_atomic
    from pipeline.config import load_job_config, resolve_checkpoint_names

    cfg = resolve_checkpoint_names(load_job_config(None, args.overrides, _flag_settings(args)))
    _check_wav_out(Path(args.out))
    engine = Engine(cfg.engine)
    req = SynthRequest(
        text=args.text,
        ref_audio=args.ref_audio,
        ref_text=args.ref_text,
        language=args.language,
        instruct=args.instruct,
        duration=args.duration,
        speed=args.speed,
        seed=args.seed,
    )
    (result,) = engine.synthesize([req])
    write_wav_atomic(Path(args.out), result.audio, result.sample_rate)
    seconds = len(result.audio) / result.sample_rate
    print(f"{args.out}: {seconds:.2f} s at {result.sample_rate} Hz ({engine.precision} on {engine.device})")
    return 0


def _check_wav_out(out: Path) -> None:
    """Before any work: a path synth can write its WAV to."""
    if out.suffix.lower() != ".wav":
        raise InputError(f"--out {out}: synth writes a WAV file; give a name ending in .wav.")
    if out.is_dir():
        raise InputError(f"--out {out} is a folder: give a file name ending in .wav.")
    folder = next(p for p in out.absolute().parents if p.exists())  # the folders below it are made
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise InputError(
            f"--out {out}: {folder} cannot be written to ({e.strerror}): give a path in a writable folder."
        ) from None


def cmd_quantize(argv: list[str]) -> int:
    from pipeline import quantize_command

    return int(quantize_command.main(argv) or 0)


def _count(value: str) -> int:
    if not value.isdecimal():
        raise argparse.ArgumentTypeError(f"{value!r} is not a count: give 0 or more rows to print")
    return int(value)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ovbatch", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, func: Any, help: str, parent: Any = sub) -> argparse.ArgumentParser:
        sp = parent.add_parser(name, help=help, description=help)
        sp.set_defaults(func=func, parser=sp)  # main() reports stray arguments with this command's usage
        return sp

    def overrides(sp: argparse.ArgumentParser, example: str = "engine.precision=fp16") -> None:
        sp.add_argument(
            "overrides",
            nargs="*",
            metavar="key=value",
            help=f"config overrides (docs/pipeline.md), e.g. {example}",
        )

    def job_flags(sp: argparse.ArgumentParser, checkpoint_help: str = CHECKPOINT_HELP) -> None:
        sp.add_argument("--local", action="store_true", help="run shards in this process (no Ray)")
        sp.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a local Ray)")
        sp.add_argument("--checkpoint", help=checkpoint_help)

    job_help = "job directory (the --out given to submit)"
    sp = command("submit", cmd_submit, "plan a manifest into a job dir and run it (or resume it)")
    sp.add_argument("manifest", help="Parquet manifest: local path or pyarrow.fs URI (s3://, gs://, file://)")
    sp.add_argument("--out", required=True, help="job directory (new, or this job's to resume it)")
    job_flags(sp)
    sp.add_argument("--config", help="job config YAML (see jobs/*.yaml)")
    overrides(sp)

    sp = command("rerun", cmd_rerun, "run the shards that are missing or hold failed rows")
    sp.add_argument("job", help=job_help)
    job_flags(
        sp,
        "checkpoint directory (default: the job's own checkpoint; a different one is refused, since it "
        "would change what the rows sound like)",
    )
    overrides(sp, "engine.max_batch_tokens=8192")

    sp = command(
        "status", cmd_status, "rows by status, shards, throughput, rows that failed or were rejected"
    )
    sp.add_argument("job", help=job_help)
    sp.add_argument("--json", action="store_true", help="print the summary as JSON")

    sp = command("report", cmd_report, "write JOB/report/index.html (A/B metrics when there are variants)")
    sp.add_argument("job", help=job_help)
    overrides(sp, "compare.asr_model=openai/whisper-small")

    sp = command("demo", cmd_demo, "run a small job on the tiny checkpoint through local Ray")
    sp.add_argument("--out", help="job directory (default: out/demo, or out/demo-ab with --ab)")
    sp.add_argument("--local", action="store_true", help="run in this process instead of on Ray actors")
    sp.add_argument("--ab", action="store_true", help="float32 vs W4A4 tiny model, with the A/B report")
    overrides(sp, "engine.generation.num_step=8")

    sp = sub.add_parser("manifest", help="manifest tools", description="manifest tools")
    msub = sp.add_subparsers(dest="manifest_command", required=True)
    mc = command("check", cmd_manifest_check, "validate a manifest without running anything", msub)
    mc.add_argument("file", help="Parquet manifest: local path or pyarrow.fs URI (s3://, gs://, file://)")
    mc.add_argument("--checkpoint", help="checkpoint whose tokenizer sizes the rows (default: tiny)")
    mc.add_argument("--config", help="job config YAML (engine buckets and limits)")
    mc.add_argument("--limit", type=_count, default=50, help="rejected rows to print (default 50)")
    overrides(mc, "engine.max_batch_tokens=8192")

    sp = command("synth", cmd_synth, "synthesize one utterance")
    sp.add_argument("--text", required=True, help="the words to speak")
    sp.add_argument(
        "--ref-audio",
        help="reference clip of the voice to clone (wav, flac, ogg, mp3; default: no reference)",
    )
    sp.add_argument("--ref-text", help="transcript of --ref-audio (required with it)")
    sp.add_argument("--out", required=True, help="output wav (16-bit PCM at the codec's 24 kHz)")
    sp.add_argument("--checkpoint", help=CHECKPOINT_HELP)
    sp.add_argument("--language", help="language id or name, e.g. en or English (default: language-agnostic)")
    sp.add_argument(
        "--instruct", help="voice-design items, e.g. 'female, low pitch' (an error lists the valid ones)"
    )
    sp.add_argument("--duration", type=float, help="seconds of audio to produce (overrides --speed)")
    sp.add_argument("--speed", type=float, help="speaking-rate factor, e.g. 1.2 is faster (default 1.0)")
    sp.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    overrides(sp, "engine.precision=fp32")

    sub.add_parser(
        "quantize", help="quantize a checkpoint to W4A4 (options: ovbatch quantize --help)", add_help=False
    )
    return p


def _stray_arguments(args: argparse.Namespace, extra: list[str]) -> None:
    """Overrides may follow options (argparse cannot interleave them with subcommands): take the extra
    key=value words as overrides; anything else is an error naming it."""
    options = [x for x in extra if x.startswith("-")]
    if options or (extra and not hasattr(args, "overrides")):
        args.parser.error(f"unrecognized arguments: {' '.join(options or extra)}")
    words = [x for x in [*getattr(args, "overrides", []), *extra] if "=" not in x]
    if words:
        raise InputError(
            f"{words[0]!r} is not a key=value override ({OVERRIDE_FORM}; `{args.parser.prog} --help` lists "
            "the arguments)."
        )
    if extra:
        args.overrides = [*args.overrides, *extra]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = None
    try:
        if argv and argv[0] == "quantize":
            return cmd_quantize(argv[1:])
        args, extra = build_parser().parse_known_args(argv)
        _stray_arguments(args, extra)
        return args.func(args)
    except OVBatchError as e:
        print(f"ovbatch: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"ovbatch: interrupted.{_what_is_kept(args)}", file=sys.stderr)
        return 130
    except BrokenPipeError:  # its reader stopped reading (`ovbatch status JOB | head`): as a shell would
        with contextlib.suppress(OSError, ValueError):  # no second error at exit's flush
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except Exception as e:  # a bug, or the machine's (a full disk): the traceback to report, then one line
        traceback.print_exc()
        kept = _what_is_kept(args)
        print(f"ovbatch: unexpected {type(e).__name__}: {first_line(e)}.{kept}", file=sys.stderr)
        return EXIT_UNEXPECTED


def _what_is_kept(args: argparse.Namespace | None) -> str:
    """For a job's run stopped midway: what it kept and how to go on."""
    if getattr(args, "func", None) not in (cmd_submit, cmd_rerun, cmd_demo):
        return ""
    from pipeline.store import JobDir

    job = getattr(args, "out", None) or getattr(args, "job", None)
    if job is None or not JobDir(job).exists():
        return " The job was not planned yet: nothing was kept."
    return f" Finished shards are kept: `ovbatch rerun {job}` (or the same submit again) runs the rest."


if __name__ == "__main__":
    sys.exit(main())
