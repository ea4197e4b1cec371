"""flash-attn-4 (the `flash-attn-4` package, CuTe DSL kernels) brought into the process: where its compiled
kernels are kept, and its import. Read once, when the attention backend is chosen: not per forward."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

from engine.config import cache_root


def import_flash4_forward():
    """flash-attn-4's varlen forward (flash_attn.cute.interface._flash_attn_fwd).

    Its kernel cache first: flash-attn-4 compiles each kernel configuration on its first call (seconds),
    and its disk cache, set by environment variables it reads when imported, keeps them under our cache
    for the processes after.

    Then the import, without quack's package __init__. quack, the CuTe kernel library flash-attn-4 builds
    on, imports its own RMSNorm, softmax and cross-entropy kernels there, and torch._dynamo with them,
    none of which the forward uses, on every worker's start. flash-attn-4 imports only
    quack's submodules, so quack is entered as a bare package (its __init__ not run) and quack.dsl
    imported, as that __init__ does first (it patches CuTe's tensor indexing, which the kernels use). A
    quack imported already, or one asked for its ptxas patch (CUTE_DSL_PTXAS_PATH), is imported as usual.
    In this process `from quack import rmsnorm` then gives quack's module of that name, not its function."""
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(cache_root() / "flash4"))
    spec = None
    if "quack" not in sys.modules and "CUTE_DSL_PTXAS_PATH" not in os.environ:
        spec = importlib.util.find_spec("quack")
    bare = spec is not None and spec.submodule_search_locations is not None
    if bare:
        sys.modules["quack"] = importlib.util.module_from_spec(spec)
        try:
            importlib.import_module("quack.dsl")
        except Exception:
            _forget_quack()  # the import below tries again as usual, and reports
            bare = False
    try:
        from flash_attn.cute.interface import _flash_attn_fwd
    except Exception:
        if bare:
            _forget_quack()  # no bare quack left behind for the process's other users
        raise
    return _flash_attn_fwd


def _forget_quack() -> None:
    for name in [m for m in sys.modules if m == "quack" or m.startswith("quack.")]:
        del sys.modules[name]
