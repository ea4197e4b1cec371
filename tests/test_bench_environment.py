"""A benchmark's default result file is named by the GPU model, so a run on another card keeps its own."""

import pytest
import torch

from bench.environment import gpu_tag, results_path


@pytest.mark.parametrize(
    ("device_name", "tag"),
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA GeForce RTX 4090", "geforce-rtx-4090"),
    ],
)
def test_gpu_tag_is_the_model_of_the_device_name(monkeypatch, device_name, tag):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: device_name)
    assert gpu_tag() == tag
    assert str(results_path("e2e")) == f"bench/results/e2e-{tag}.json"


def test_without_a_gpu_the_tag_is_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert results_path("plan").name == "plan-cpu.json"
