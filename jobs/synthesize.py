"""Ray job entrypoint:

    ray job submit --working-dir . -- python jobs/synthesize.py MANIFEST --out JOB [--config F] [k=v ...]
    ray job submit --working-dir . -- python jobs/synthesize.py --rerun JOB

It runs `ovbatch submit` (or `ovbatch rerun`) inside the job's driver; RAY_ADDRESS, set by `ray job
submit`, makes the job use the cluster's actors.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the working dir root, for `pipeline`

from pipeline.cli import main  # noqa: E402


def entry(argv: list[str]) -> int:
    if argv[:1] == ["--rerun"]:
        return main(["rerun", *argv[1:]])
    return main(["submit", *argv])


if __name__ == "__main__":
    sys.exit(entry(sys.argv[1:]))
