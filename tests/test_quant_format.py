import json
from pathlib import Path

import pytest
import torch

from engine.errors import QuantError
from engine.w4a4 import format as format_module
from engine.w4a4.format import (
    FORMAT_VERSION,
    QuantMeta,
    W4A4Tensors,
    pack_int4,
    read_w4a4_safetensors,
    unpack_int4,
    write_w4a4_safetensors,
)


def random_layer(n=96, k=128, rank=16, smooth=True, seed=0) -> W4A4Tensors:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=g)
    return W4A4Tensors(
        qweight=pack_int4(q),
        wscales=torch.rand(n, k // 64, generator=g).half() * 0.01,
        proj_down=torch.randn(k, rank, generator=g).half(),
        proj_up=torch.randn(n, rank, generator=g).half(),
        smooth=(torch.rand(k, generator=g) + 0.5).half() if smooth else None,
    )


@pytest.mark.parametrize("shape", [(1, 2), (7, 64), (33, 130), (5, 3072)])
def test_pack_roundtrip(shape):
    q = torch.randint(-8, 8, shape, dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (shape[0], shape[1] // 2)
    assert torch.equal(unpack_int4(packed), q)


def test_pack_layout_low_nibble_is_even_k():
    q = torch.tensor([[-8, 7, 1, -1]], dtype=torch.int8)
    packed = pack_int4(q)
    # -8 -> 0x8 (low), 7 -> 0x7 (high); 1 -> 0x1 (low), -1 -> 0xF (high)
    assert packed.tolist() == [[0x78, 0xF1]]


def test_pack_rejects_out_of_range_and_odd_k():
    with pytest.raises(QuantError, match=r"\[-8, 7\]"):
        pack_int4(torch.tensor([[8, 0]]))
    with pytest.raises(QuantError, match="even"):
        pack_int4(torch.zeros(2, 3, dtype=torch.int8))


def test_tensors_validate_shapes():
    t = random_layer()
    t.validate("x")
    bad = W4A4Tensors(t.qweight, t.wscales[:, :1], t.proj_down, t.proj_up)
    with pytest.raises(QuantError, match=r"x\.wscales has shape"):
        bad.validate("x")
    with pytest.raises(QuantError, match="not a multiple"):
        W4A4Tensors(
            torch.zeros(4, 48, dtype=torch.uint8), torch.zeros(4, 1), torch.zeros(96, 16), torch.zeros(4, 16)
        ).validate("odd")


def test_meta_rejects_wrong_version_and_format():
    meta = QuantMeta(rank=16, source_hash="abc")
    assert QuantMeta.from_dict(json.loads(json.dumps(meta.to_dict()))) == meta
    with pytest.raises(QuantError, match="version"):
        QuantMeta.from_dict({**meta.to_dict(), "version": FORMAT_VERSION + 1})
    assert QuantMeta.from_dict({**meta.to_dict(), "version": 1}).version == 1  # still read (same tensors)
    with pytest.raises(QuantError, match="format"):
        QuantMeta.from_dict({**meta.to_dict(), "format": "awq"})
    with pytest.raises(QuantError, match="rank"):
        QuantMeta.from_dict({**meta.to_dict(), "rank": 8})


def _write(tmp_path):
    t = random_layer()
    state = {**t.state_dict("llm.layers.0.mlp.up_proj"), "llm.norm.weight": torch.ones(128)}
    meta = QuantMeta(rank=16, source_hash="feed", layers=("llm.layers.0.mlp.up_proj",))
    path = tmp_path / "model.safetensors"
    write_w4a4_safetensors(path, state, meta)
    return path, state, meta


def test_safetensors_roundtrip(tmp_path):
    path, state, meta = _write(tmp_path)
    got, got_meta = read_w4a4_safetensors(path, expected=meta)
    assert got_meta == meta
    assert set(got) == set(state) and all(torch.equal(got[k], state[k]) for k in state)
    back = W4A4Tensors.from_state("llm.layers.0.mlp.up_proj", got)
    assert back.rank == 16 and back.in_features == 128 and back.out_features == 96


def test_failed_write_leaves_neither_file_nor_temporary(tmp_path, monkeypatch):
    def disk_full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(format_module, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        _write(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_truncated_file_is_refused(tmp_path):
    path, _, _ = _write(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(QuantError, match="truncated or corrupt"):
        read_w4a4_safetensors(path)


def test_corrupt_bytes_fail_checksum(tmp_path):
    path, _, _ = _write(tmp_path)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(QuantError, match="checksum"):
        read_w4a4_safetensors(path)


def test_source_hash_mismatch_is_refused(tmp_path):
    path, _, meta = _write(tmp_path)
    other = QuantMeta(rank=16, source_hash="0ther", layers=meta.layers)
    with pytest.raises(QuantError, match="different runs"):
        read_w4a4_safetensors(path, expected=other)


def test_missing_tensor_names_the_key():
    t = random_layer()
    state = t.state_dict("a")
    del state["a.proj_up"]
    with pytest.raises(QuantError, match=r"a\.proj_up"):
        W4A4Tensors.from_state("a", state)
