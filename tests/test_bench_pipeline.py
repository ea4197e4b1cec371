"""bench/pipeline.py on the CPU: the tiny checkpoint through local mode, end to end, into its JSON."""

from __future__ import annotations

import json
import sys

from bench.pipeline import main


def test_tiny_local_run_writes_its_report(tmp_path, monkeypatch):
    out = tmp_path / "pipeline.json"
    argv = ["pipeline.py", "--size", "tiny", "--rows", "4", "--modes", "local", "--device", "cpu"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(out), "--work", str(tmp_path / "work")])
    main()
    report = json.loads(out.read_text())
    (run,) = report["modes"]
    assert run["mode"] == "local" and run["rows"]["ok"] == 4 and run["rows"]["failed"] == 0
    assert run["audio_seconds"] > 0 and run["x_realtime"] > 0
    assert set(run["gpu_util"]) == {"mean_pct_by_gpu", "mean_pct_used_gpus", "samples"}
