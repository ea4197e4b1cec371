"""engine.kernels.flash4.import_flash4_forward on stand-in packages: the kernel cache is pointed, quack's
package __init__ is skipped, quack.dsl still runs first, and any failure leaves quack to the usual import."""

import builtins
import os
import sys
import textwrap
from pathlib import Path

import pytest

from engine.kernels.flash4 import import_flash4_forward


def write(path: Path, text: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


@pytest.fixture
def packages(tmp_path, monkeypatch):
    """quack (whose __init__ records that it ran) and flash_attn.cute.interface (which, as flash-attn-4's
    modules do, imports quack's submodules only) on sys.path; sys.modules restored afterwards."""
    write(tmp_path / "quack/__init__.py", "import builtins\nbuiltins.quack_init_ran = True\nrmsnorm = 'fn'\n")
    write(tmp_path / "quack/dsl/__init__.py", "import builtins\nbuiltins.quack_dsl_ran = True\n")
    write(tmp_path / "quack/layout_utils.py", "from quack.dsl import *  # noqa\nVALUE = 7\n")
    write(tmp_path / "flash_attn/__init__.py")
    write(tmp_path / "flash_attn/cute/__init__.py")
    write(
        tmp_path / "flash_attn/cute/interface.py",
        """
        from quack import layout_utils

        def _flash_attn_fwd():
            return layout_utils.VALUE
        """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in (
        "CUTE_DSL_PTXAS_PATH",
        "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED",
        "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR",
    ):
        monkeypatch.delenv(name, raising=False)  # and restored after the test
    for flag in ("quack_init_ran", "quack_dsl_ran"):
        monkeypatch.setattr(builtins, flag, False, raising=False)
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        del sys.modules[name]


def test_quack_is_entered_bare_with_its_dsl_imported(packages):
    forward = import_flash4_forward()
    assert forward() == 7
    assert builtins.quack_dsl_ran and not builtins.quack_init_ran
    assert sys.modules["quack"].__path__ == [str(packages / "quack")]
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"].endswith("flash4")


@pytest.mark.parametrize("why", ["imported already", "ptxas patch asked for"])
def test_quack_imports_as_usual_where_it_must(packages, monkeypatch, why):
    if why == "imported already":
        import quack  # noqa: F401
    else:
        monkeypatch.setenv("CUTE_DSL_PTXAS_PATH", "/usr/local/cuda/bin/ptxas")
    assert import_flash4_forward()() == 7
    assert builtins.quack_init_ran


def test_a_failing_quack_dsl_is_left_to_the_usual_import_to_report(packages):
    write(packages / "quack/dsl/__init__.py", "raise ImportError('no cutlass here')\n")
    with pytest.raises(ImportError, match="no cutlass here"):
        import_flash4_forward()
    assert builtins.quack_init_ran  # the bare quack was dropped, then imported as usual


def test_without_flash_attn_no_bare_quack_is_left_behind(packages):
    write(packages / "flash_attn/cute/interface.py", "raise ImportError('no flash_attn here')\n")
    with pytest.raises(ImportError, match="no flash_attn here"):
        import_flash4_forward()
    assert "quack" not in sys.modules
    import quack

    assert quack.rmsnorm == "fn" and builtins.quack_init_ran  # a later `import quack` gets the real package
