"""The Triton kernels' code checked on the CPU: tests/interpret_kernels.py runs them under Triton's
interpreter (Triton 3.9 on: an older one fails on numpy 2's scalars) in a process of its own, against their
references. Where Triton is missing this skips, saying why, except in CI (CI=true), where `make setup`
installs it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
MIN_TRITON = (3, 9)


def triton_version() -> tuple[int, ...] | None:
    try:
        import triton
    except ImportError:
        return None
    return tuple(int(part) for part in triton.__version__.split(".")[:2])


@pytest.mark.parametrize("kernel", ("swiglu", "qkv_rope", "guided_argmax"))
def test_the_kernel_under_the_interpreter_against_its_reference(kernel):
    version = triton_version()
    if version is None or version < MIN_TRITON:
        why = f"Triton {'missing' if version is None else version} (3.9 on runs these kernels' interpreter)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{why}: `make setup` installs it on a CPU torch")
        pytest.skip(f"{why}: pip install 'triton>=3.9' next to a CPU torch, or run `make test-gpu`")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, str(HERE / "interpret_kernels.py"), kernel], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
