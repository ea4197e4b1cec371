"""The clips' encode beside a batch's generation: how much each slows the other, by where the encode runs.

A distinct-clip job encodes its reference clips on the device while it generates other batches
(pipeline/shard_runner.py). In the committed FP8 Ray job (e2e-h200.json, by_bucket) the shortest rows'
preparations, which encode their clips, took 94.2 s beside 76.9 s of their generation, and the generation
stream idled 17.3 s there, while the codec alone encodes ~1,100 audio seconds a second (codec-h200.json).
This bench times, on one engine (bench/e2e.py's full-size checkpoint and manifest): one
generation batch of the manifest's shortest rows (the runner's packed calls, CUDA graphs, nothing else),
the encode of --clips other clips (Codec.encode as the engine calls it, codes back to the host), each
alone, then both at once from two threads with the encode on
- `high`: a stream of its own at high priority (the engine's choice),
- `normal`: a stream of its own at normal priority,
- `same`: the generation's stream (the two serialised in launch order).
Per variant: the encode's wall (its thread), the generation's (queue to done), both's, and `overlap`:
(encode alone + generation alone) / both; above 1 the device did them at once faster than one after the
other. Medians of --reps.

    python bench/encode_beside.py [--size full|tiny] [--precision fp8] [--rows 4600] [--batch-rows 64]
                                  [--clips 64] [--reps 3] [--work DIR] [--out bench/results/...]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.e2e import SETTINGS, checkpoint_and_manifest  # noqa: E402
from bench.environment import environment, results_path, write_result  # noqa: E402
from engine.api import Engine, SynthRequest  # noqa: E402
from engine.frontend.audio import prepare_reference  # noqa: E402
from pipeline.config import load_job_config  # noqa: E402

PLACES = ("high", "normal", "same")


def encode_stream(place: str, device: torch.device):
    """Where the encode runs: None (no CUDA), a stream of its own, or the current (generation) stream."""
    if device.type != "cuda":
        return None
    if place == "same":
        return torch.cuda.current_stream(device)
    return torch.cuda.Stream(device, priority=-1 if place == "high" else 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=("full", "tiny"), default="full")
    p.add_argument("--device", default="auto")
    p.add_argument("--precision", default="fp8")
    p.add_argument("--rows", type=int, default=4600, help="manifest rows (bench/e2e.py's manifest)")
    p.add_argument("--batch-rows", type=int, default=64, help="the generation batch's rows (shortest texts)")
    p.add_argument("--clips", type=int, default=64, help="clips encoded beside it")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--work", help="scratch folder (bench/e2e.py's --work is reused)")
    p.add_argument("--out", type=Path, default=results_path("encode-beside"))
    args = p.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="ovbatch-encode-beside-")).resolve()
    try:
        report = measure(args, work)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print(report)
    write_result(Path(args.out), report)


def measure(args: argparse.Namespace, work: Path) -> dict:
    ckpt, manifest = checkpoint_and_manifest(work, args.size, args.rows)
    settings = [
        f"engine.device={args.device}",
        f"engine.checkpoint={ckpt}",
        f"engine.precision={args.precision}",
    ]
    job_cfg = load_job_config(None, [*SETTINGS[args.size], *settings])
    engine = Engine(job_cfg.engine_config(job_cfg.variant_names()[0]))
    device = engine.device
    rows = sorted(pq.read_table(manifest).to_pylist(), key=lambda r: len(r["text"]))
    batch, others = rows[: args.batch_rows], rows[args.batch_rows : args.batch_rows + args.clips]
    reqs = [SynthRequest(text=r["text"], ref_audio=r["ref_audio"], ref_text=r["ref_text"]) for r in batch]
    # the batch's runner calls packed on the host, as Engine.prepare_ahead packs them (graphs: at warm-up)
    calls = engine._runner_calls(engine.prepare_many(reqs), 0, [[] for _ in reqs])
    rate, hop = engine.sample_rate, engine.codec.hop_length
    wavs = [
        torch.from_numpy(prepare_reference(r["ref_audio"], rate, hop, engine.reference_settings).audio)
        for r in others
    ]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def generate() -> None:
        for call in calls:
            engine.runner.generate_packed(call, engine.gen)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    def encode(stream) -> None:
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            engine.codec.encode(wavs, device="cpu")

    def timed(fn, *a) -> float:
        start = time.perf_counter()
        fn(*a)
        return time.perf_counter() - start

    def median(fn, *a) -> float:
        sync()
        timed(fn, *a)  # warm-up
        out = []
        for _ in range(args.reps):
            sync()
            out.append(timed(fn, *a))
        return round(statistics.median(out), 4)

    def together(stream) -> dict[str, float]:
        """The encode on a thread of its own while this one generates: each one's seconds, and both's."""
        seconds: dict[str, float] = {}
        sync()
        start = time.perf_counter()
        thread = threading.Thread(target=lambda: seconds.setdefault("encode_s", timed(encode, stream)))
        thread.start()
        seconds["generate_s"] = timed(generate)
        thread.join()
        sync()
        seconds["both_s"] = time.perf_counter() - start
        return seconds

    alone = {"generate_s": median(generate), "encode_s": median(encode, encode_stream("high", device))}
    beside = {}
    for place in PLACES if device.type == "cuda" else ("high",):
        stream = encode_stream(place, device)
        runs = [together(stream) for _ in range(args.reps + 1)][1:]  # the first warms the stream up
        beside[place] = {k: round(statistics.median(r[k] for r in runs), 4) for k in runs[0]}
        both = beside[place]["both_s"]
        beside[place]["overlap"] = round((alone["encode_s"] + alone["generate_s"]) / both, 3)
    audio = sum(w.shape[-1] for w in wavs) / engine.sample_rate
    return {
        "bench": "encode_beside",
        "environment": environment(),
        "size": args.size,
        "precision": engine.precision,
        "generation": {
            "rows": len(reqs),
            "runner_calls": len(calls),
            "packed_tokens": sum(sum(engine.runner.packed_tokens(i) for i in c.items) for c in calls),
            "steps": engine.gen.num_step,
        },
        "encode": {"clips": len(wavs), "audio_seconds": round(audio, 1)},
        "alone": alone,
        "beside": beside,
    }


if __name__ == "__main__":
    main()
