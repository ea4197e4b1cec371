"""A planning worker process (pipeline.clip_pool): one JSON-quoted clip location per line on stdin, one
JSON line per clip on stdout, for one of two tasks:

- probe: what the manifest records of a clip (pipeline.manifest's probe: content hash, seconds, local
  path, or why the clip cannot be used);
- frames: the codec frames of the clip's prompt (engine.frontend.requests reference_frames), or its error.

    python -m pipeline.clip_worker '{"task": "probe", "clip_dir": null, "max_seconds": 30.0}'
    python -m pipeline.clip_worker '{"task": "frames", "sample_rate": 24000, "hop_length": 960,
                                     "settings": {...}}'
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path


def prober(spec: dict) -> Callable[[str], dict]:
    from pipeline.manifest import probe_clip

    clip_dir = Path(spec["clip_dir"]) if spec["clip_dir"] is not None else None
    return lambda location: asdict(probe_clip(location, clip_dir, spec["max_seconds"]))


def frame_counter(spec: dict) -> Callable[[str], dict]:
    from engine.errors import AudioError
    from engine.frontend.audio import ReferenceSettings
    from engine.frontend.requests import CodecShape, reference_frames

    codec = CodecShape(spec["sample_rate"], spec["hop_length"])
    settings = ReferenceSettings(**spec["settings"])

    def answer(clip: str) -> dict:
        try:
            return {"frames": reference_frames(clip, codec, settings)}
        except AudioError as e:
            return {"audio_error": str(e)}
        except Exception as e:  # handed back so that one bad clip rejects its rows, not the plan
            return {"error": f"{type(e).__name__}: {e}"}

    return answer


TASKS = {"probe": prober, "frames": frame_counter}

# The engines load while the job is planned (in Ray's actors, or on a thread of the driver), and their start,
# not the planning, is what the first batch waits for: the workers, one per core, yield the CPU to them.
NICENESS = 10


def main() -> None:
    if hasattr(os, "nice"):  # POSIX
        os.nice(NICENESS)
    spec = json.loads(sys.argv[1])
    answer = TASKS[spec["task"]](spec)
    for line in sys.stdin:
        sys.stdout.write(json.dumps(answer(json.loads(line))) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
