"""`ovbatch quantize` on the tiny checkpoint: the written checkpoint loads, tracks FP, refuses bad input."""

import contextlib
import dataclasses
import io
import json
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from engine.checkpoint import checkpoint_fingerprint
from engine.config import FastPaths
from engine.errors import QuantError
from engine.loading import build_w4a4_model, load_model
from engine.quantizer import quantize as quantize_mod
from engine.quantizer.calibrate import CalibRequest, manifest_items
from engine.tiny import ensure_tiny_checkpoint
from engine.w4a4.format import FORMAT_VERSION, read_w4a4_safetensors, write_w4a4_safetensors
from engine.w4a4.linear import W4A4Group, W4A4Linear
from pipeline import quantize_command

REPO = Path(__file__).resolve().parents[1]

# Stated thresholds for the tiny model (random weights, so its decoding is fragile: near-flat logits
# flip under small perturbations; chance agreement is 1/1024). Measured: cosine ~0.998, agreement ~0.45.
MIN_LOGITS_COSINE = 0.99
MIN_TOKEN_AGREEMENT = 0.25


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Many small ops: on a shared 2-core machine a second thread only contends (5x slower here).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny():
    return ensure_tiny_checkpoint()


@pytest.fixture(scope="module")
def quantized(tiny, tmp_path_factory, one_thread):
    """The tiny checkpoint quantized, named as the README names it (`tiny`: the source hash test below holds
    it to be that checkpoint)."""
    out = tmp_path_factory.mktemp("q") / "tiny-w4a4"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = quantize_command.main(
            ["tiny", "--out", str(out), "--samples", "6", "--eval-requests", "3", "--device", "cpu"]
        )
    assert code == 0
    return out, printed.getvalue()


def test_report_and_end_to_end_thresholds(tiny, quantized):
    out, printed = quantized
    report = json.loads((out / "quant_report.json").read_text())
    assert len(report["layers"]) == 14  # 2 layers x 7 Linears
    for layer in report["layers"]:
        assert layer["errors"]["final"] <= layer["errors"]["rtn"]
    mean = report["summary"]["mean_error"]
    assert mean["final"] < 0.7 * mean["rtn"]
    e2e = report["end_to_end"]
    print(
        f"\ntiny W4A4 vs FP: cosine {e2e['logits_cosine_mean']:.4f}, agreement {e2e['token_agreement']:.3f}"
    )
    assert e2e["logits_cosine_mean"] >= MIN_LOGITS_COSINE
    assert e2e["token_agreement"] >= MIN_TOKEN_AGREEMENT
    assert "llm.layers.1.mlp.down_proj" in printed and "token agreement" in printed
    assert report["source_hash"] == checkpoint_fingerprint(tiny)


def test_written_checkpoint_loads_as_w4a4(tiny, quantized):
    out, _ = quantized
    assert {p.name for p in tiny.iterdir()} <= {p.name for p in out.iterdir()}
    assert not list(out.parent.glob(".tiny-w4a4.*"))  # no temp dir left behind
    _, merged = load_model(out)
    assert isinstance(merged.llm.layers[0].mlp.gate_up_proj, W4A4Group)  # siblings merged at load
    cfg, model = load_model(out, fast_paths=FastPaths(grouped_projections=False))
    w4a4 = [m for m in model.modules() if isinstance(m, W4A4Linear)]
    assert len(w4a4) == 14
    assert model.llm.embed_tokens.weight.dtype == torch.float32
    _, fp = load_model(tiny)
    assert torch.equal(model.audio_heads.weight, fp.audio_heads.weight)  # copied, not quantized
    assert torch.equal(model.llm.norm.weight, fp.llm.norm.weight)
    raw = json.loads((out / "config.json").read_text())
    assert raw["quantization"]["rank"] == 16 and len(raw["quantization"]["layers"]) == 14
    for layer in model.llm.layers:  # siblings share their smoothing (engine/quantizer/lowrank.py)
        attn, mlp = layer.self_attn, layer.mlp
        for siblings in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
            smooths = [lin.smooth for lin in siblings]
            assert all(s is None for s in smooths) or all(torch.equal(s, smooths[0]) for s in smooths)


def test_source_hash_and_version_mismatch(quantized, tmp_path):
    out, _ = quantized
    cfg, _ = load_model(out)
    with pytest.raises(QuantError, match="quantized from source"):
        build_w4a4_model(out, cfg, expected_source_hash="0" * 64)
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    raw = json.loads((bad / "config.json").read_text())
    raw["quantization"]["version"] = 99
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(QuantError, match="version 99"):
        load_model(bad)


def test_the_source_hash_is_the_checkpoint_fingerprint(tiny, quantized):
    out, _ = quantized
    cfg, _ = load_model(out)
    assert json.loads((out / "config.json").read_text())["quantization"]["version"] == FORMAT_VERSION == 2
    model = build_w4a4_model(out, cfg, expected_source_hash=checkpoint_fingerprint(tiny))
    assert sum(isinstance(m, W4A4Linear) for m in model.modules()) == 14


def test_a_version_1_checkpoint_loads_but_its_source_cannot_be_checked(tiny, quantized, tmp_path):
    """Version 1 recorded a blake2b source hash; the tensors are the same, so it still loads."""
    out, _ = quantized
    old = tmp_path / "v1"
    shutil.copytree(out, old)
    tensors, meta = read_w4a4_safetensors(old / "model.safetensors")
    v1 = dataclasses.replace(meta, version=1, source_hash="3f" * 16)
    write_w4a4_safetensors(old / "model.safetensors", tensors, v1)
    raw = json.loads((old / "config.json").read_text())
    (old / "config.json").write_text(json.dumps({**raw, "quantization": v1.to_dict()}))
    cfg, model = load_model(old)
    assert sum(isinstance(m, W4A4Linear) for m in model.modules()) == 14
    with pytest.raises(QuantError, match=r"format version 1.*re-quantize"):
        build_w4a4_model(old, cfg, expected_source_hash=checkpoint_fingerprint(tiny))


def test_truncated_w4a4_file_is_refused(quantized, tmp_path):
    out, _ = quantized
    bad = tmp_path / "trunc"
    shutil.copytree(out, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(QuantError, match="truncated or corrupt"):
        load_model(bad)


def test_already_quantized_and_existing_output_are_refused(tiny, quantized, tmp_path):
    out, _ = quantized
    with pytest.raises(QuantError, match="already a W4A4 checkpoint"):
        quantize_command.main([str(out), "--out", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()
    with pytest.raises(QuantError, match="already exists"):
        quantize_command.main([str(tiny), "--out", str(out)])


def test_an_out_inside_the_source_or_under_a_file_and_bad_counts_are_refused_before_any_work(tiny, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny, src)
    with pytest.raises(QuantError, match=r"--out .*src/w4 lies inside the source checkpoint"):
        quantize_command.main([str(src), "--out", str(src / "w4")])
    assert sorted(p.name for p in src.iterdir()) == sorted(p.name for p in tiny.iterdir())
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(QuantError, match=r"--out .*file/x: its folder cannot be made"):
        quantize_command.main([str(src), "--out", str(tmp_path / "file" / "x")])
    for flag in ("--samples", "--eval-requests", "--sample-rows"):
        with pytest.raises(QuantError, match=f"{flag} 0: it must be at least 1"):
            quantize_command.main([str(src), "--out", str(tmp_path / "q"), flag, "0"])
    assert not (tmp_path / "q").exists()
    with pytest.raises(QuantError, match="--device tpu"):
        quantize_command.main([str(src), "--out", str(tmp_path / "new" / "q"), "--device", "tpu"])
    assert not (tmp_path / "new").exists()  # refused before --out's folders were made


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine without CUDA")
def test_cuda_without_gpu_is_refused(tiny, tmp_path):
    with pytest.raises(QuantError, match="no CUDA GPU"):
        quantize_command.main([str(tiny), "--out", str(tmp_path / "c"), "--device", "cuda"])
    assert not (tmp_path / "c").exists()


def test_unknown_device_is_refused_by_name(tiny, tmp_path):
    with pytest.raises(QuantError, match="--device gpu0"):
        quantize_command.main([str(tiny), "--out", str(tmp_path / "d"), "--device", "gpu0"])
    assert not (tmp_path / "d").exists()


def test_shapes_not_multiple_of_group_are_refused(tiny, tmp_path):
    src = tmp_path / "odd"
    shutil.copytree(tiny, src)
    raw = json.loads((src / "config.json").read_text())
    raw["llm_config"]["intermediate_size"] = 100
    (src / "config.json").write_text(json.dumps(raw))
    with pytest.raises(QuantError, match=r"down_proj: in_features=100 is not a multiple"):
        quantize_command.main([str(src), "--out", str(tmp_path / "y")])
    assert not (tmp_path / "y").exists()


def test_manifest_without_usable_rows(tiny, tmp_path):
    class Rejected:
        row_index, reason = 0, "reference clip missing.wav not found"

    class EmptyManifest:
        rows, rejected = [], [Rejected()]

    with pytest.raises(QuantError, match="no usable rows.*missing.wav"):
        quantize_command.main(
            [str(tiny), "--out", str(tmp_path / "z"), "--calib", "m.parquet"],
            load_manifest=lambda location, clip_dir: EmptyManifest(),
        )
    from engine.codec import Codec
    from engine.frontend.text import TextFrontend

    requests = [
        CalibRequest(text="Hello there.", ref_audio=str(tmp_path / "nope.wav"), ref_text="Hi."),
        CalibRequest(text="Hello there.", ref_audio="s3://bucket/anna.wav", ref_text="Hi."),
    ]
    codec = Codec.from_dir(tiny / "audio_tokenizer")
    with pytest.raises(
        QuantError, match="no usable rows.*row 0.*row 1: reference clip s3://bucket/anna.wav is a URI"
    ):
        manifest_items(TextFrontend(tiny / "tokenizer.json"), codec, requests, "m.parquet")
    assert not (tmp_path / "z").exists()


def test_failure_midway_leaves_nothing(tiny, tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("injected failure after the checkpoint was written")

    monkeypatch.setattr(quantize_mod, "compare_models", boom)
    out = tmp_path / "w"
    opts = quantize_mod.QuantizeOptions(samples=1, eval_requests=1, device="cpu")
    with pytest.raises(RuntimeError, match="injected"):
        quantize_mod.quantize_checkpoint(tiny, out, opts, show_progress=False)
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")
def test_sigterm_midway_leaves_nothing(tiny, tmp_path):
    """`kill` while the checkpoint is being written: the command exits 143 and removes its hidden folder
    (SIGTERM's default action left a whole checkpoint's worth beside --out)."""
    out, inside = tmp_path / "w", tmp_path / "inside-the-temp-phase"
    child = textwrap.dedent(f"""
        import sys, time
        import engine.quantizer.quantize as q
        def wait_for_the_signal(*args, **kwargs):
            open({str(inside)!r}, "w").close()
            time.sleep(120)
        q.compare_models = wait_for_the_signal
        from pipeline.cli import main
        sys.exit(main(["quantize", {str(tiny)!r}, "--out", {str(out)!r}, "--samples", "1",
                       "--eval-requests", "1", "--device", "cpu"]))
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not inside.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert inside.exists(), proc.stderr.read() if proc.poll() is not None else "no temp phase in 240 s"
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".w.")], "the hidden folder exists"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
    finally:
        proc.kill()
    assert sorted(p.name for p in tmp_path.iterdir()) == [inside.name]


@pytest.mark.gpu
def test_quantize_on_cuda_bf16(tiny, tmp_path):
    opts = quantize_mod.QuantizeOptions(samples=16, eval_requests=8, device="cuda", dtype="bf16")
    report = quantize_mod.quantize_checkpoint(tiny, tmp_path / "q", opts, show_progress=False)
    e2e = report["end_to_end"]
    print(f"\ncuda bf16 ({report['w4a4_backend']}): {e2e}")
    assert e2e["logits_cosine_mean"] >= MIN_LOGITS_COSINE
    assert e2e["token_agreement"] >= MIN_TOKEN_AGREEMENT
    _, model = load_model(tmp_path / "q", device="cuda", dtype=torch.bfloat16)
    assert sum(isinstance(m, W4A4Linear) for m in model.modules()) == 14


def _remote_clips(monkeypatch, served: dict[str, bytes]) -> list[str]:
    """pipeline.manifest reads s3:// clips from `served` (stands in for pyarrow's S3FileSystem); any other
    s3:// key is missing. Returns the locations read."""
    from pipeline import manifest as manifest_mod

    real, reads = manifest_mod.read_bytes, []

    def read(location: str) -> bytes:
        reads.append(location)
        if not location.startswith("s3://"):
            return real(location)
        if location not in served:
            raise OSError(
                f"Path does not exist '{location[5:]}'. Detail: [errno 2] No such file or directory"
            )
        return served[location]

    monkeypatch.setattr(manifest_mod, "read_bytes", read)
    return reads


def test_calibration_from_a_manifest(tiny, tmp_path, monkeypatch, caplog):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = Path(__file__).parent / "data"
    clips = json.loads((data / "clips.json").read_text())
    names = ["en_24k_mono.wav", "en_16k_mono.wav", "en_8k_mono.wav"]
    remote = "s3://bucket/voices/en_8k_mono.wav"
    reads = _remote_clips(monkeypatch, {remote: (data / names[2]).read_bytes()})
    rows = {
        "id": ["a", "b", "c", "gone", "unreachable", "no-voice"],
        "text": [
            "Good morning to all of you.",
            "The river runs past the old mill.",
            "We walked home in the rain.",
            "Hello.",
            "Hi there.",
            "A voice of its own.",
        ],
        "ref_audio": [str(data / n) for n in names[:2]]
        + [remote, str(data / "missing.wav"), "s3://bucket/gone.wav", None],
        "ref_text": [clips[n]["transcript"] for n in names] + ["Hi.", "Hello.", None],
    }
    manifest = tmp_path / "calib.parquet"
    pq.write_table(pa.table(rows), manifest)
    out = tmp_path / "q"
    with contextlib.redirect_stdout(io.StringIO()), caplog.at_level("WARNING"):
        quantize_command.main(
            [str(tiny), "--out", str(out), "--calib", str(manifest), "--eval-requests", "1"]
        )
    report = json.loads((out / "quant_report.json").read_text())
    assert report["settings"]["calibration"] == str(manifest)
    assert report["settings"]["calib_requests"] == 3  # the remote clip is fetched as submit fetches it
    assert reads.count(remote) == 1
    assert report["summary"]["mean_error"]["final"] < report["summary"]["mean_error"]["rtn"]
    warned = caplog.text
    assert "3 row(s)" in warned and "s3://bucket/gone.wav" in warned and "missing.wav" in warned
    assert "1 without a reference clip" in warned


def test_calibration_manifest_whose_clips_cannot_be_fetched(tiny, tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    _remote_clips(monkeypatch, {})
    manifest = tmp_path / "calib.parquet"
    table = {"id": ["a"], "text": ["Hello."], "ref_audio": ["s3://bucket/gone.wav"], "ref_text": ["Hi."]}
    pq.write_table(pa.table(table), manifest)
    with pytest.raises(QuantError, match=r"no usable rows \(row 0: ref_audio 's3://bucket/gone.wav' .*fix"):
        quantize_command.main([str(tiny), "--out", str(tmp_path / "q"), "--calib", str(manifest)])
    assert not (tmp_path / "q").exists()
