"""Checkpoint reading: the tiny checkpoint round-trips; every malformed checkpoint is refused by name;
the checkpoint fingerprint."""

import hashlib
import json
import os
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import engine.tiny.checkpoint as tiny_module
from engine.checkpoint import resolve_checkpoint
from engine.config import FastPaths
from engine.errors import CheckpointError
from engine.loading import load_model
from engine.tiny import ensure_tiny_checkpoint, tiny_state_dict


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("cache"))


@pytest.fixture
def broken(tiny, tmp_path):
    """A writable copy of the tiny checkpoint to damage."""
    shutil.copytree(tiny, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def rewrite_weights(ckpt, edit):
    sd = load_file(ckpt / "model.safetensors")
    edit(sd)
    save_file(sd, str(ckpt / "model.safetensors"))


def test_tiny_checkpoint_is_deterministic(tiny, tmp_path):
    again = ensure_tiny_checkpoint(tmp_path)
    assert again != tiny
    names = sorted(p.relative_to(tiny) for p in tiny.rglob("*") if p.is_file())
    assert [str(n) for n in names] == sorted(
        str(p.relative_to(again)) for p in again.rglob("*") if p.is_file()
    )
    for name in names:
        assert (tiny / name).read_bytes() == (again / name).read_bytes(), name


def test_tiny_checkpoint_is_cached(tiny):
    stamp = (tiny / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_checkpoint(tiny.parent) == tiny
    assert (tiny / "model.safetensors").stat().st_mtime_ns == stamp


def test_tiny_checkpoint_published_by_a_concurrent_builder_is_kept(tiny, monkeypatch):
    inode = (tiny / "model.safetensors").stat().st_ino
    real_complete, calls = tiny_module._complete, []

    def complete(path):  # the first check runs before the other builder has published
        calls.append(path)
        return len(calls) > 1 and real_complete(path)

    monkeypatch.setattr(tiny_module, "_complete", complete)
    assert ensure_tiny_checkpoint(tiny.parent) == tiny
    assert len(calls) > 1
    assert (tiny / "model.safetensors").stat().st_ino == inode
    assert not [p for p in tiny.parent.iterdir() if p.name.startswith(".tiny-")]


def test_tiny_checkpoint_loads_with_the_weights_it_was_made_from(tiny):
    cfg, model = load_model(tiny, dtype=torch.bfloat16, fast_paths=FastPaths(grouped_projections=False))
    expected = tiny_state_dict(cfg)
    got = model.state_dict()
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == torch.bfloat16
        torch.testing.assert_close(got[name].float(), tensor.to(torch.bfloat16).float(), rtol=0, atol=0)
    assert json.loads((tiny / "config.json").read_text())["model_type"] == "omnivoice"


def shard_checkpoint(path):
    """Split path/model.safetensors into two shards with an index (as large checkpoints ship); returns
    the original tensors."""
    sd = load_file(path / "model.safetensors")
    names = sorted(sd)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in halves.items():
        save_file({k: sd[k] for k in keys}, str(path / shard))
    index = {"weight_map": {k: shard for shard, keys in halves.items() for k in keys}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "model.safetensors").unlink()
    return sd


def test_sharded_checkpoint_loads(broken):
    sd = shard_checkpoint(broken)
    _, model = load_model(broken)
    torch.testing.assert_close(model.state_dict()["audio_heads.weight"], sd["audio_heads.weight"])


def test_tolerates_buffers_upstream_saves(broken):
    def add(sd):
        sd["codebook_layer_offsets"] = torch.arange(8) * 1025
        sd["llm.rotary_emb.inv_freq"] = torch.ones(8)

    rewrite_weights(broken, add)
    load_model(broken)


def test_missing_tensor_is_named(broken):
    rewrite_weights(broken, lambda sd: sd.pop("llm.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        CheckpointError, match=r"missing tensor llm\.layers\.1\.mlp\.up_proj\.weight.*\[192, 64\]"
    ):
        load_model(broken)


def test_unexpected_tensor_is_named(broken):
    rewrite_weights(broken, lambda sd: sd.__setitem__("llm.layers.2.extra.weight", torch.zeros(3)))
    with pytest.raises(CheckpointError, match=r"unexpected tensor llm\.layers\.2\.extra\.weight"):
        load_model(broken)


def test_wrong_shape_is_named(broken):
    rewrite_weights(broken, lambda sd: sd.__setitem__("audio_heads.weight", torch.zeros(8200, 32)))
    with pytest.raises(
        CheckpointError, match=r"audio_heads\.weight has shape \[8200, 32\], expected \[8200, 64\]"
    ):
        load_model(broken)


def test_wrong_model_type_is_named(broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["model_type"] = "llama"
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="'llama'.*'omnivoice'"):
        load_model(broken)


def test_pickle_weights_are_refused(broken):
    (broken / "model.safetensors").unlink()
    (broken / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*safetensors"):
        load_model(broken)


def test_missing_shard_is_named(broken):
    (broken / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "gone.safetensors"}})
    )
    with pytest.raises(CheckpointError, match=r"gone\.safetensors"):
        load_model(broken)


def test_corrupt_weights_are_named(broken):
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(CheckpointError, match=r"model\.safetensors cannot be read as safetensors"):
        load_model(broken)


def test_nonexistent_path_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="neither an existing directory"):
        resolve_checkpoint(tmp_path / "nothing" / "here")


def test_repo_id_offline_fails_fast(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens there
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.chdir(tmp_path)
    start = time.monotonic()
    with pytest.raises(CheckpointError, match="--checkpoint"):
        resolve_checkpoint("k2-fsa/OmniVoice")
    assert time.monotonic() - start < 10


def test_one_fingerprint_names_a_checkpoint_by_config_and_weights(tiny, broken):
    from engine.api import Engine
    from engine.checkpoint import checkpoint_fingerprint
    from engine.config import EngineConfig

    # sha256 over the sha256 of config.json and of each weight file: the scheme model ids have always used
    outer = hashlib.sha256()
    for path in (tiny / "config.json", tiny / "model.safetensors"):
        outer.update(hashlib.sha256(path.read_bytes()).digest())
    fingerprint = checkpoint_fingerprint(tiny)
    assert fingerprint == outer.hexdigest()
    assert checkpoint_fingerprint(broken) == fingerprint  # a copy: the same checkpoint
    engine = Engine(EngineConfig(checkpoint=str(tiny), device="cpu"))
    assert engine.model_id == f"{tiny.name}@{fingerprint[:12]}"

    (broken / "tokenizer_config.json").write_text("{}")  # not part of the weights or their config
    assert checkpoint_fingerprint(broken) == fingerprint
    rewrite_weights(broken, lambda sd: sd["llm.norm.weight"].add_(1))
    changed_weights = checkpoint_fingerprint(broken)
    assert changed_weights != fingerprint
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "note": 1}))
    assert checkpoint_fingerprint(broken) not in (fingerprint, changed_weights)
    (broken / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        checkpoint_fingerprint(broken)


def test_a_fingerprint_is_hashed_once_per_unchanged_checkpoint(broken, tmp_path, monkeypatch):
    """Issue 42: an engine start on an unchanged checkpoint reads no weights to name it; a rewritten file
    (new size or modification time) is hashed again."""
    from engine.checkpoint import checkpoint_fingerprint

    cache = tmp_path / "fingerprints"
    first = checkpoint_fingerprint(broken, cache)
    assert [p.read_text().strip() for p in cache.iterdir()] == [first]

    def no_reading(*args):
        raise AssertionError("the weights were read again")

    monkeypatch.setattr(hashlib, "file_digest", no_reading)
    assert checkpoint_fingerprint(broken, cache) == first
    monkeypatch.undo()
    rewrite_weights(broken, lambda sd: sd["llm.norm.weight"].add_(1))
    second = checkpoint_fingerprint(broken, cache)
    assert second != first and len(list(cache.iterdir())) == 2
    (cache / "not-a-folder").write_text("")
    assert checkpoint_fingerprint(broken, cache / "not-a-folder") == second  # no cache: hashed, not an error
    weights = broken / "model.safetensors"
    before = weights.stat()
    replacement = weights.with_name("new.safetensors")
    data = weights.read_bytes()
    replacement.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # another file of the same size
    os.replace(replacement, weights)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))  # and the same modification time
    assert checkpoint_fingerprint(broken, cache) != second


def test_fingerprint_of_a_sharded_checkpoint_covers_every_shard(broken):
    from engine.checkpoint import checkpoint_fingerprint

    shard_checkpoint(broken)
    before = checkpoint_fingerprint(broken)
    second = broken / "model-00002-of-00002.safetensors"
    save_file({k: v * 2 for k, v in load_file(second).items()}, str(second))
    assert checkpoint_fingerprint(broken) != before
