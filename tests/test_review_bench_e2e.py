"""bench/e2e.py's merge: entries measured by earlier calls (other sessions, other machines) keep the machine
and versions that measured them; the top level's environment is the last call's only."""

import json

from bench.e2e import merge


def test_merged_entries_keep_the_environment_that_measured_them(tmp_path):
    out = tmp_path / "e2e.json"
    first = {"torch": "2.10.0", "driver": "570.1", "gpu": "NVIDIA H100 80GB HBM3"}
    second = {"torch": "2.11.0", "driver": "580.159.04", "gpu": "NVIDIA H100 80GB HBM3"}
    earlier = merge(out, [{"variant": "engine_bf16"}, {"variant": "job_local_bf16"}], {"environment": first})
    out.write_text(json.dumps(earlier))
    report = merge(out, [{"variant": "job_local_bf16", "x_realtime": 2.0}], {"environment": second})
    by_variant = {e["variant"]: e for e in report["entries"]}
    assert by_variant["engine_bf16"]["environment"] == first  # measured by the first call
    assert by_variant["job_local_bf16"]["environment"] == second  # replaced by the second call's
    assert report["environment"] == second
