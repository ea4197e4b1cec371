"""The `ovbatch` command line: exit codes, one-line errors, overrides after options, synth, check."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile as sf

from pipeline.cli import EXIT_ERROR, EXIT_UNEXPECTED, main
from pipeline.config import load_job_config
from pipeline.demo import DEMO_ROWS, write_demo_manifest
from pipeline.manifest import engine_settings, load
from pipeline.plan import Plan
from pipeline.store import JobDir

DATA = Path(__file__).parent / "data"
CLIPS = json.loads((DATA / "clips.json").read_text())
CLIP = "en_24k_mono.wav"


@pytest.fixture
def fast(tmp_path_factory) -> list[str]:
    """CPU, 4 decoding steps, and the voice-prompt cache the pipeline test modules share."""
    return [
        "engine.device=cpu",
        "engine.generation.num_step=4",
        f"engine.prompt_cache_dir={tmp_path_factory.getbasetemp() / 'ovbatch-prompts'}",
    ]


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_an_unusable_manifest_is_one_line_and_exit_2(tmp_path: Path, capsys):
    pq.write_table(pa.table({"id": ["a"], "text": ["t"]}), tmp_path / "m.parquet")
    assert main(["manifest", "check", str(tmp_path / "m.parquet")]) == EXIT_ERROR
    line = _error_line(capsys)
    assert line.startswith("ovbatch: error: manifest")
    assert "lacks required column(s) ['ref_audio', 'ref_text']" in line


def test_submit_refuses_a_missing_manifest_before_loading_an_engine(tmp_path: Path, capsys):
    code = main(
        [
            "submit",
            str(tmp_path / "none.parquet"),
            "--out",
            str(tmp_path / "job"),
            "--local",
            "progress=false",
        ]
    )
    assert code == EXIT_ERROR
    assert "not found" in _error_line(capsys)
    assert not (tmp_path / "job").exists()


def test_bad_config_keys_and_values_are_one_line(tmp_path: Path, capsys):
    m = str(tmp_path / "m.parquet")
    assert main(["submit", m, "--out", str(tmp_path / "j"), "engine.nope=1"]) == EXIT_ERROR
    assert "job config: Key 'nope' not in 'EngineConfig'" in _error_line(capsys)
    assert main(["submit", m, "--out", str(tmp_path / "j"), "engine.precision=int3"]) == EXIT_ERROR
    assert "precision='int3'" in _error_line(capsys)
    assert main(["manifest", "check", m, "--config", str(tmp_path / "none.yaml")]) == EXIT_ERROR
    assert "config file" in _error_line(capsys)
    for bad, message in (
        ("ray.cpu_actors=0", "ray.cpu_actors=0: it must be at least 1"),
        ("ray.max_shard_attempts=0", "ray.max_shard_attempts=0: it must be at least 1"),
        (
            "ray.gpus_per_actor=0",
            "ray.gpus_per_actor=0, ray.cpus_per_actor=1: GPUs per actor must be positive",
        ),
        ("ray.num_cpus=0", "ray.num_cpus=0: give the local Ray at least 1 CPU"),
        ("engine.buckets=[]", "buckets=[], max_batch_tokens=16384: give at least one bucket"),
        ("engine.max_batch_tokens=0", "max_batch_tokens=0: give at least one bucket"),
    ):
        assert main(["submit", m, "--out", str(tmp_path / "j"), bad]) == EXIT_ERROR
        assert message in _error_line(capsys)


def test_an_engine_setting_given_at_the_top_level_is_named_with_its_engine_key(tmp_path: Path, capsys):
    m = str(tmp_path / "m.parquet")
    assert main(["synth", "--text", "Hi.", "--out", str(tmp_path / "h.wav"), "precision=fp16"]) == EXIT_ERROR
    assert "'precision' is an engine setting: write it as engine.precision." in _error_line(capsys)
    config = tmp_path / "job.yaml"
    config.write_text("buckets: [256, 512]\n")
    assert main(["submit", m, "--out", str(tmp_path / "j"), "--config", str(config)]) == EXIT_ERROR
    assert "'buckets' is an engine setting: write it as engine.buckets." in _error_line(capsys)
    assert not (tmp_path / "j").exists()


def test_an_override_without_equals_is_named_with_the_key_value_form(tmp_path: Path, capsys):
    for argv in (
        ["submit", "m.parquet", "--out", str(tmp_path), "notakeyvalue"],
        ["submit", "m.parquet", "notakeyvalue", "--out", str(tmp_path)],
        ["demo", "--local", "notakeyvalue"],
    ):
        assert main(argv) == EXIT_ERROR
        line = _error_line(capsys)
        assert line.startswith("ovbatch: error: 'notakeyvalue' is not a key=value override")
        assert "e.g. engine.precision=fp16" in line and f"`ovbatch {argv[0]} --help`" in line


def test_an_unexpected_error_exits_3_with_its_traceback_and_a_line_saying_what_is_kept(
    tmp_path: Path, capsys, monkeypatch
):
    def broken(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("pipeline.job.submit", broken)
    assert main(["submit", "m.parquet", "--out", str(tmp_path / "j"), "--local"]) == EXIT_UNEXPECTED
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert err.strip().splitlines()[-1] == (
        "ovbatch: unexpected OSError: [Errno 28] No space left on device. The job was not planned yet: "
        "nothing was kept."
    )
    JobDir(tmp_path / "j").write_plan(Plan(["default"], [128], 1000))  # a job planned before the error
    assert main(["submit", "m.parquet", "--out", str(tmp_path / "j"), "--local"]) == EXIT_UNEXPECTED
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            f"Finished shards are kept: `ovbatch rerun {tmp_path / 'j'}` (or the same submit again) runs the "
            "rest."
        )
    )


def test_a_reader_that_stops_reading_ends_the_command_quietly(monkeypatch, capsys):
    def status(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("pipeline.cli.cmd_status", status)
    assert main(["status", "somejob"]) == 141
    assert capsys.readouterr().err == ""


def test_a_command_with_no_shard_to_run_starts_no_ray(tmp_path: Path, capsys, monkeypatch):
    def no_head(*a, **k):
        raise AssertionError("a Ray head was started")

    monkeypatch.setattr("pipeline.ray_head.RayHead", no_head)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    (tmp_path / "file").write_text("mine")
    done = JobDir(tmp_path / "done")
    settings = {"default": engine_settings(load_job_config(None).engine_config("default"))}
    done.write_plan(Plan(["default"], [128], 1000, engine_settings=settings))  # no shards: complete
    done.config_path.write_text("{}\n")
    done.write_rows([])
    assert main(["submit", "m.parquet", "--out", str(tmp_path / "file")]) == EXIT_ERROR
    assert "is a file" in _error_line(capsys)
    assert main(["rerun", str(done.path)]) == 0
    assert "0 shard(s) run" in capsys.readouterr().out


def test_an_out_that_is_a_file_is_refused_before_planning(tmp_path: Path, capsys):
    (tmp_path / "j").write_text("mine")
    assert main(["submit", "m.parquet", "--out", str(tmp_path / "j"), "--local"]) == EXIT_ERROR
    assert f"--out {tmp_path / 'j'} is a file" in _error_line(capsys)
    assert (tmp_path / "j").read_text() == "mine"


def test_an_unknown_option_shows_its_commands_usage(tmp_path: Path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["submit", "m.parquet", "--out", str(tmp_path), "--nope"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ovbatch submit") and "unrecognized arguments: --nope" in err
    with pytest.raises(SystemExit):
        main(["status", str(tmp_path), "extra"])
    assert capsys.readouterr().err.startswith("usage: ovbatch status")


def _subcommands(parser) -> dict[str, object]:
    """Every (sub)command's parser by its prog, e.g. 'ovbatch manifest check'."""
    import argparse

    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found[sub.prog] = sub
                found.update(_subcommands(sub))
    return found


def test_every_argument_of_every_command_is_described():
    from pipeline.cli import build_parser

    commands = _subcommands(build_parser())
    assert {"ovbatch synth", "ovbatch manifest check", "ovbatch report", "ovbatch rerun"} <= set(commands)
    from pipeline.quantize_command import build_parser as quantize_parser

    commands["ovbatch quantize"] = quantize_parser()  # `ovbatch quantize` hands its arguments to this one
    for prog, parser in commands.items():
        for action in parser._actions:
            if action.dest in ("help", "func", "parser") or action.help == "==SUPPRESS==":
                continue
            if hasattr(action, "choices") and action.dest.endswith("command"):
                continue
            assert action.help, f"{prog}: {action.option_strings or action.dest} has no description"
            if action.default not in (None, False) and action.option_strings:
                assert "default" in action.help, f"{prog} {action.option_strings}: its default is not shown"


def test_rerun_says_its_checkpoint_is_the_jobs_own(capsys):
    with pytest.raises(SystemExit):
        main(["rerun", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "default: the job's own checkpoint" in help_text
    assert "the embedded tiny checkpoint" not in help_text


def test_the_ab_demo_has_its_own_job_directory(monkeypatch, capsys):
    from engine.errors import OVBatchError
    from pipeline import demo

    outs = []

    def record(out, **kw):
        outs.append(out)
        raise OVBatchError("recorded")

    monkeypatch.setattr(demo, "run_demo", record)
    main(["demo"])
    main(["demo", "--ab"])
    main(["demo", "--ab", "--out", "elsewhere"])
    capsys.readouterr()
    assert outs == ["out/demo", "out/demo-ab", "elsewhere"]


def test_status_of_a_directory_that_is_not_a_job(tmp_path: Path, capsys):
    assert main(["status", str(tmp_path)]) == EXIT_ERROR
    assert "not a job directory" in _error_line(capsys)


def test_quantize_forwards_its_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        main(["quantize", "--help"])
    assert e.value.code == 0
    assert "ovbatch quantize" in capsys.readouterr().out


def test_manifest_check_reports_rejected_rows_and_buckets(tmp_path: Path, capsys, fast):
    pq.write_table(
        pa.table(
            {
                "id": ["good", "bad/id", "good2"],
                "text": ["Hello there.", "Hello.", "A somewhat longer sentence to speak here."],
                "ref_audio": [str(DATA / CLIP)] * 3,
                "ref_text": [CLIPS[CLIP]["transcript"]] * 3,
            }
        ),
        tmp_path / "m.parquet",
    )
    assert main(["manifest", "check", str(tmp_path / "m.parquet"), *fast]) == 1
    out = capsys.readouterr().out
    assert "3 rows, 2 accepted, 1 rejected" in out
    assert "row 1 id='bad/id': id 'bad/id' holds a path separator" in out
    assert "buckets {" in out


def test_manifest_check_reads_remote_clips_as_submit_does(tmp_path: Path, capsys, fast, monkeypatch):
    from pipeline import manifest as manifest_mod

    data = (DATA / CLIP).read_bytes()
    monkeypatch.setattr(manifest_mod, "read_bytes", lambda location: data)  # stands in for S3
    pq.write_table(
        pa.table(
            {
                "id": ["a"],
                "text": ["Hello."],
                "ref_audio": ["s3://b/anna.wav"],
                "ref_text": [CLIPS[CLIP]["transcript"]],
            }
        ),
        tmp_path / "m.parquet",
    )
    assert main(["manifest", "check", str(tmp_path / "m.parquet"), *fast]) == 0
    assert "1 rows, 1 accepted, 0 rejected" in capsys.readouterr().out


def test_synth_refuses_an_output_it_cannot_write_before_any_work(tmp_path: Path, capsys, monkeypatch):
    def no_engine(*a, **k):
        raise AssertionError("the engine was loaded")

    monkeypatch.setattr("engine.api.Engine", no_engine)
    (tmp_path / "folder.wav").mkdir()
    (tmp_path / "file").write_text("a file, not a folder")
    for out, message in (
        (tmp_path / "h.mp3", "synth writes a WAV file; give a name ending in .wav"),
        (tmp_path / "folder.wav", "is a folder: give a file name ending in .wav"),
        (tmp_path / "file" / "h.wav", "cannot be written to"),
    ):
        assert main(["synth", "--text", "Hi.", "--out", str(out)]) == EXIT_ERROR
        assert message in _error_line(capsys)


def test_synth_writes_a_wav(tmp_path: Path, capsys, fast):
    out = tmp_path / "o" / "x.wav"
    assert (
        main(
            [
                "synth",
                "--text",
                "Hello there.",
                "--ref-audio",
                str(DATA / CLIP),
                "--ref-text",
                CLIPS[CLIP]["transcript"],
                "--out",
                str(out),
                "--seed",
                "3",
                *fast,
            ]
        )
        == 0
    )
    info = sf.info(out)
    assert info.samplerate == 24000 and info.frames > 0
    assert "s at 24000 Hz (fp32 on cpu)" in capsys.readouterr().out


def test_the_demo_manifest_is_valid_real_speech(tmp_path: Path):
    m = load(write_demo_manifest(tmp_path / "demo.parquet"))
    assert m.rejected == [] and len(m.rows) == DEMO_ROWS
    assert {Path(r.ref_audio).name for r in m.rows} == set(CLIPS)
    assert all(r.ref_text == CLIPS[Path(r.ref_audio).name]["transcript"] for r in m.rows)


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["local.yaml", "cluster.yaml", "ab.yaml"])
def test_job_configs_load(name: str):
    from pipeline.config import load_job_config

    cfg = load_job_config(ROOT / "jobs" / name)
    if name == "ab.yaml":
        assert cfg.variant_names() == ["fp16", "fp8", "w4a4"]
        assert [cfg.engine_config(v).precision for v in cfg.variant_names()] == ["fp16", "fp8", "w4a4"]
        # the embedded tiny checkpoint (fp8 made from it at load) and its W4A4 sibling unless overridden
        assert [cfg.engine_config(v).checkpoint for v in cfg.variant_names()] == [None, None, "tiny-w4a4"]
    if name == "cluster.yaml":
        assert cfg.engine.prompt_cache_dir == "/data/cache/prompts" and cfg.engine.device == "cuda"


def test_ray_job_entrypoint_runs_from_any_folder(tmp_path: Path):
    import subprocess
    import sys

    entry = str(ROOT / "jobs" / "synthesize.py")
    argv = [sys.executable, entry, str(tmp_path / "none.parquet"), "--out", str(tmp_path / "job"), "--local"]
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == EXIT_ERROR, proc.stderr
    assert proc.stderr.startswith("ovbatch: error: manifest") and "not found" in proc.stderr


# A folder name OmegaConf's key=value parsing would mangle: an interpolation, a YAML comment, a mapping and a
# flow list if it were read as YAML.
ODD = "odd ${x} #1: [dir]"


def test_paths_on_the_command_line_are_taken_literally(tmp_path: Path, capsys, fast):
    import shutil

    from engine.tiny import ensure_tiny_checkpoint
    from pipeline.config import load_job_config

    root = tmp_path / ODD
    checkpoint = root / "ckpt ${y"
    shutil.copytree(ensure_tiny_checkpoint(), checkpoint)
    manifest = root / "m ${z}.parquet"
    pq.write_table(
        pa.table(
            {
                "id": ["a", "b"],
                "text": ["Hello.", "Thank you."],
                "ref_audio": [str(DATA / CLIP)] * 2,
                "ref_text": [CLIPS[CLIP]["transcript"]] * 2,
            }
        ),
        manifest,
    )
    assert main(["manifest", "check", str(manifest), "--checkpoint", str(checkpoint), *fast]) == 0
    assert "2 rows, 2 accepted" in capsys.readouterr().out
    job = root / "job ${w}"
    flags = ["--local", "--checkpoint", str(checkpoint)]
    assert main(["submit", str(manifest), "--out", str(job), *flags, "progress=false", *fast]) == 0
    assert "2 ok, 0 failed" in capsys.readouterr().out
    stored = load_job_config(job / "config.yaml")  # what rerun reads back
    assert stored.manifest == str(manifest) and stored.engine.checkpoint == str(checkpoint)
    assert stored.engine_config("default").checkpoint == str(checkpoint)
    assert main(["rerun", str(job), "--local", "--checkpoint", str(checkpoint), "progress=false"]) == 0
    assert main(["status", str(job)]) == 0
    out = capsys.readouterr().out
    assert "2 ok, 0 failed" in out
    assert "time (s): planning " in out and "| beside the engine: prepare ahead " in out  # the time split


def test_literal_settings_sit_between_the_config_file_and_the_overrides(tmp_path: Path):
    from pipeline.config import load_job_config, to_yaml

    literal = {"manifest": f"/m/{ODD}.parquet", "engine.checkpoint": "/c/${x}", "local": True}
    cfg = load_job_config(None, ["variants.b.checkpoint=/v/\\${y}", "variants.a.precision=fp32"], literal)
    assert cfg.manifest == f"/m/{ODD}.parquet" and cfg.local is True
    assert cfg.engine_config("a").checkpoint == "/c/${x}" and cfg.engine_config("b").checkpoint == "/v/${y}"
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    assert load_job_config(tmp_path / "config.yaml") == cfg
    # key=value overrides still win over the flags, and keep their interpolation
    cfg = load_job_config(
        None, ["engine.checkpoint=${manifest}.d"], {"manifest": "/m", "engine.checkpoint": "/c"}
    )
    assert cfg.engine.checkpoint == "/m.d"


def test_the_ab_config_runs_as_it_is_on_the_tiny_checkpoints(tmp_path: Path, capsys, fast):
    """jobs/ab.yaml without overrides: the tiny checkpoint in fp16 and fp8 against its W4A4 sibling (made on
    first use), and the output says where they are."""
    from engine.tiny import ensure_tiny_checkpoint

    tiny = ensure_tiny_checkpoint()
    manifest = tmp_path / "m.parquet"
    pq.write_table(
        pa.table(
            {
                "id": ["a"],
                "text": ["Hello."],
                "ref_audio": [str(DATA / CLIP)],
                "ref_text": [CLIPS[CLIP]["transcript"]],
            }
        ),
        manifest,
    )
    small = ["engine.buckets=[128,256,512,1024]", "engine.max_batch_tokens=1024", "progress=false"]
    argv = [
        "submit",
        str(manifest),
        "--out",
        str(tmp_path / "ab"),
        "--config",
        str(ROOT / "jobs" / "ab.yaml"),
    ]
    assert main([*argv, "--local", *fast, *small, "report=never"]) == 0
    out = capsys.readouterr().out
    assert "3 ok, 0 failed, 0 rejected, 0 pending over 3 variants;" in out  # one row in each variant
    assert f"checkpoint (fp16): the embedded tiny checkpoint, {tiny}" in out
    assert f"checkpoint (w4a4): {tiny.parent / (tiny.name + '-w4a4')}" in out
    assert (tiny.parent / f"{tiny.name}-w4a4" / "config.json").is_file()


def test_checkpoint_names_resolve_and_paths_stay_as_given(tmp_path):
    from pipeline.config import load_job_config, resolve_checkpoint_names

    path = tmp_path / "tiny"  # a directory named like the name: a path, kept as given
    path.mkdir()
    cfg = load_job_config(
        None, ["engine.checkpoint=tiny", f"variants.a.checkpoint={path}", "variants.b.precision=fp32"]
    )
    resolved = resolve_checkpoint_names(cfg)
    assert resolved.engine.checkpoint is None  # `tiny` is null: the embedded tiny checkpoint
    assert (
        resolved.engine_config("a").checkpoint == str(path) and resolved.engine_config("b").checkpoint is None
    )
