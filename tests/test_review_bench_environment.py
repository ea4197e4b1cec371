"""bench/environment.py: a GPU benchmark records the versions of the packages whose kernels the engine runs on
the GPU beside torch's (flash-attn-4's attention, picked first by attention=auto; the Triton GEMMs), whichever
packages the script itself names."""

import torch

import bench.environment as env


def test_a_gpu_run_records_the_attention_and_triton_versions(monkeypatch):
    installed = {"flash-attn-4": "4.0.0b36", "triton": "3.6.0", "transformers": "5.17.0"}

    def version(name):
        if name not in installed:
            raise env.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(env, "version", version)
    monkeypatch.setattr(env, "_driver", lambda: "580.159.04")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    got = env.environment("transformers")  # as bench/generate.py names its packages
    assert got["flash-attn-4"] == "4.0.0b36" and got["triton"] == "3.6.0"
    assert got["flash-attn"] == "not installed"  # FlashAttention-2, attention=auto's second pick
    assert got["transformers"] == "5.17.0" and got["gpu"] == "NVIDIA H100 80GB HBM3"


def test_a_cpu_run_records_no_gpu_packages(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    got = env.environment()
    assert "gpu" not in got and "flash-attn-4" not in got
