"""A text with nothing to speak is rejected, whatever invisible characters it holds."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.cli import main

DATA = Path(__file__).parent / "data"
CLIP = "en_24k_mono.wav"
TRANSCRIPT = json.loads((DATA / "clips.json").read_text())[CLIP]["transcript"]


def test_a_text_of_invisible_characters_only_is_rejected_naming_it(tmp_path: Path, capsys):
    """Zero-width spaces, a byte-order mark or control characters alone were accepted and spoken as a second
    or more of babble, status ok."""
    texts = {"zw": "\u200b\u200b", "bom": "\ufeff", "ctl": "\x01\x02", "ok": "Hello.", "tag": "[laughter]"}
    n = len(texts)
    m = tmp_path / "m.parquet"
    table = {"id": list(texts), "text": list(texts.values()), "ref_audio": [str(DATA / CLIP)] * n}
    pq.write_table(pa.table({**table, "ref_text": [TRANSCRIPT] * n}), m)
    assert main(["manifest", "check", str(m), "engine.device=cpu"]) == 1
    out = capsys.readouterr().out
    assert f"{n} rows, 2 accepted, 3 rejected" in out, out
    for rid, text in texts.items():
        if rid not in ("ok", "tag"):
            assert f"id={rid!r}: text {text!r} holds no visible character: give the words to speak" in out
