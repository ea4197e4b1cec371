"""bench/encode_beside.py end to end on the tiny checkpoint (CPU): its report's shape and arithmetic."""

import json
import sys

from bench import encode_beside


def test_the_report_times_each_alone_and_both_at_once(tmp_path, monkeypatch):
    out = tmp_path / "encode-beside.json"
    argv = ["encode_beside.py", "--size", "tiny", "--device", "cpu", "--precision", "fp32", "--rows", "12"]
    argv += ["--batch-rows", "4", "--clips", "4", "--reps", "1", "--work", str(tmp_path), "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    encode_beside.main()
    report = json.loads(out.read_text())
    assert report["generation"]["rows"] == 4 and report["encode"]["clips"] == 4
    assert list(report["beside"]) == ["high"]  # no streams on a CPU: one placement
    alone, both = report["alone"], report["beside"]["high"]
    assert all(alone[k] > 0 and both[k] > 0 for k in ("encode_s", "generate_s"))
    assert both["both_s"] >= max(both["encode_s"], both["generate_s"])
    assert both["overlap"] == round((alone["encode_s"] + alone["generate_s"]) / both["both_s"], 3)
