"""Parity with the official OmniVoice package (0.2.1) on the same config and weights.

Runs where `omnivoice` is importable (the GPU machine); elsewhere tests/test_model.py and
tests/test_runner.py hold the same cases against our dense reference. Tiny size always; full size
(real dimensions, random weights) when CUDA is present. The harness is bench/parity.py.
"""

import pytest
import torch

pytest.importorskip("omnivoice")

from bench.parity import cases, run_parity  # noqa: E402

pytestmark = pytest.mark.official
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = ["tiny"] + ([pytest.param("full", marks=pytest.mark.gpu)] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module", params=SIZES)
def parity(request):
    return request.param, run_parity(request.param, DEVICE)


@pytest.mark.parametrize("case", list(cases("tiny")))
def test_fp32_sdpa_matches_official(parity, case):
    size, results = parity
    r = results[f"{size}/{case}/fp32"]
    assert r["backend"] == "sdpa"
    assert r["max_abs_logit_diff"] <= 1e-4, r
    assert r["token_agreement"] >= 0.999, r


@pytest.mark.parametrize("case", list(cases("tiny")))
def test_bf16_fast_backend_matches_official(parity, case):
    size, results = parity
    r = results[f"{size}/{case}/bf16"]
    if DEVICE == "cuda":
        assert r["backend"] in ("flash", "flash4", "varlen"), r
    assert r["logits_cosine"] >= 0.999, r
