"""A planning worker process: counts the codec frames of reference clips (engine.frontend.requests
reference_frames), one JSON-quoted clip path per line on stdin, one JSON line per clip on stdout.

    python -m pipeline.clip_worker '{"sample_rate": 24000, "hop_length": 960, "settings": {...}}'

A fresh interpreter rather than a multiprocessing pool: a pool's spawned children import the caller's
main module again, which runs a script that calls `submit` without an `if __name__ == "__main__"` guard a
second time, and forked children would inherit the driver's threads (Ray, torch) mid-lock.
"""

from __future__ import annotations

import json
import sys

from engine.errors import AudioError
from engine.frontend.audio import ReferenceSettings
from engine.frontend.requests import CodecShape, reference_frames


def answer(clip: str, codec: CodecShape, settings: ReferenceSettings) -> dict:
    try:
        return {"frames": reference_frames(clip, codec, settings)}
    except AudioError as e:
        return {"audio_error": str(e)}
    except Exception as e:  # handed back so that one bad clip rejects its rows, not the plan
        return {"error": f"{type(e).__name__}: {e}"}


def main() -> None:
    spec = json.loads(sys.argv[1])
    codec = CodecShape(spec["sample_rate"], spec["hop_length"])
    settings = ReferenceSettings(**spec["settings"])
    for line in sys.stdin:
        clip = json.loads(line)
        sys.stdout.write(json.dumps(answer(clip, codec, settings)) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
