"""Per-clip work of the planner in worker processes (pipeline.clip_worker), one per core: a manifest whose
rows each bring their own reference clip spends most of its planning reading those clips, and that work
holds the GIL (threads measured no faster than one). The workers run at a lower CPU priority than the
engines loading meanwhile (clip_worker.NICENESS).

Workers are fresh interpreters rather than a multiprocessing pool: a pool's spawned children import the
caller's main module again, which runs a script that calls `submit` without an `if __name__ == "__main__"`
guard a second time, and forked children would inherit the driver's threads (Ray, torch) mid-lock.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger(__name__)

# Fewer clips than this are handled in the calling process (the workers' start would cost more).
POOL_MIN_CLIPS = 64


def worker_count() -> int:
    return len(os.sched_getaffinity(0))


def map_clips(task: dict, clips: Sequence[str], workers: int) -> dict[str, dict]:
    """Each clip's answer to `task` (pipeline.clip_worker), from `workers` processes. Clips without an
    answer (too few clips or cores to pay for the workers' start, or a worker that died) are missing:
    the caller handles them in its own process."""
    if workers < 2 or len(clips) < POOL_MIN_CLIPS:
        return {}
    spec = json.dumps(task)
    shares = [list(clips[i::workers]) for i in range(workers)]
    answers: dict[str, dict] = {}
    with ThreadPoolExecutor(workers) as pool:
        for share, got in zip(shares, pool.map(lambda share: ask_worker(spec, share), shares)):
            answers.update(zip(share, got))
    return answers


def ask_worker(spec: str, clips: list[str]) -> list[dict]:
    """One worker's answers, in the order of `clips` (fewer when it stopped early)."""
    command = [sys.executable, "-m", "pipeline.clip_worker", spec]
    stdin = "".join(json.dumps(clip) + "\n" for clip in clips)
    # The worker imports this checkout's packages, also where they are on sys.path but not installed.
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, input=stdin, capture_output=True, text=True, env=env)
    if done.returncode:
        log.warning("a clip worker stopped (exit %d): %s", done.returncode, done.stderr.strip()[-500:])
    return [json.loads(line) for line in done.stdout.splitlines()]
