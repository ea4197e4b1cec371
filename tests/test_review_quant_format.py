"""A W4A4 file whose tensors disagree with its own metadata is refused at read (review)."""

import pytest
import torch

from engine.errors import QuantError
from engine.w4a4.format import (
    QuantMeta,
    W4A4Tensors,
    pack_int4,
    read_w4a4_safetensors,
    write_w4a4_safetensors,
)


def _layer(rank: int, n: int = 32, k: int = 128) -> W4A4Tensors:
    g = torch.Generator().manual_seed(0)
    return W4A4Tensors(
        qweight=pack_int4(torch.randint(-8, 8, (n, k), generator=g)),
        wscales=torch.rand(n, k // 64, generator=g).half(),
        proj_down=torch.randn(k, rank, generator=g).half(),
        proj_up=torch.randn(n, rank, generator=g).half(),
    )


def test_a_layer_whose_rank_is_not_the_metadatas_is_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    meta = QuantMeta(rank=32, source_hash="abc", layers=("a", "b"))
    write_w4a4_safetensors(path, {**_layer(32).state_dict("a"), **_layer(16).state_dict("b")}, meta)
    with pytest.raises(QuantError, match=r"b\.proj_down has rank 16.*rank 32"):
        read_w4a4_safetensors(path, expected=meta)
