"""The layering docs/ARCHITECTURE.md promises, read from the source with ast (every import statement counts,
module level or inside a function):

- the engine never imports the pipeline;
- the run-time path (what engine.api and engine.loading import, transitively) never imports the offline
  quantizer;
- the model (engine/model) imports no quantization module: Linear implementations are handed to it at load;
- nothing on the forward path reads the environment: the fast-path switches are EngineConfig fields;
- comments in engine/ and csrc/ carry no version tags (history lives in git).
- a CPU engine loads and synthesizes without importing torch._dynamo (seconds in every worker).
"""

import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENGINE = REPO / "engine"
QUANTIZATION = ("engine.w4a4", "engine.fp8", "engine.quantizer")
FORWARD_PATH = ("engine/model", "engine/generate", "engine/w4a4", "engine/fp8", "engine/kernels")
# Once per process: the CUDA extension's build (its cache directory and extra compiler flags), and
# flash-attn-4's import (its kernel cache, and whether quack's ptxas patch is asked for). Not per forward.
FORWARD_PATH_EXEMPT = ("engine/kernels/build.py", "engine/kernels/flash4.py")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module an import statement in the file names (absolute imports, with their parents)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in found:
            parts = name.split(".")
            names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return names


def engine_modules() -> dict[str, Path]:
    return {module_name(p): p for p in ENGINE.rglob("*.py")}


def test_engine_never_imports_the_pipeline():
    offenders = {
        name: sorted(n for n in imports_of(path) if n.split(".")[0] in ("pipeline", "jobs", "bench"))
        for name, path in engine_modules().items()
    }
    assert not {k: v for k, v in offenders.items() if v}


def test_runtime_path_never_imports_the_offline_quantizer():
    modules = engine_modules()
    seen, todo, via = set(), ["engine.api", "engine.loading"], {}
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for imported in imports_of(modules[name]):
            if imported in modules and imported not in seen:
                via.setdefault(imported, name)
                todo.append(imported)
    reached = sorted(n for n in seen if n.startswith("engine.quantizer"))
    assert not reached, {n: f"imported by {via[n]}" for n in reached}
    assert "engine.w4a4.linear" in seen and "engine.generate.loop" in seen  # the walk sees the real path


def test_model_imports_no_quantization_module():
    offenders = {
        name: sorted(n for n in imports_of(path) if n.startswith(QUANTIZATION))
        for name, path in engine_modules().items()
        if name.startswith("engine.model")
    }
    assert not {k: v for k, v in offenders.items() if v}


def reads_environment(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
            if isinstance(node.value, ast.Name) and node.value.id == "os":
                lines.append(node.lineno)
    return lines


def test_nothing_on_the_forward_path_reads_the_environment():
    files = [p for d in FORWARD_PATH for p in (REPO / d).rglob("*.py")]
    assert len(files) > 10
    offenders = {
        str(p.relative_to(REPO)): reads_environment(p)
        for p in files
        if str(p.relative_to(REPO)) not in FORWARD_PATH_EXEMPT
    }
    assert not {k: v for k, v in offenders.items() if v}


def test_a_cpu_engine_loads_and_synthesizes_without_importing_torch_dynamo():
    """torch._dynamo takes seconds to import, in every worker process: loading builds
    the model on the meta device, where nn.Embedding's init and weight_norm's norm run torch's reference
    ops that import it, and torch's varlen attention module imports it too (loaded on CUDA only)."""
    code = (
        "import sys\n"
        "from engine.api import Engine, SynthRequest\n"
        "from engine.config import EngineConfig\n"
        "Engine(EngineConfig(device='cpu')).synthesize([SynthRequest(text='Hi.', seed=1)])\n"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_checks_see_what_they_look_for(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import os\ndef f():\n    from pipeline.store import x\n    return os.environ.get('A')")
    assert "pipeline.store" in imports_of(probe) and reads_environment(probe) == [4]


VERSION_TAG = re.compile(r"\bv\d+[a-z]?\b")


def comments(path: Path) -> list[tuple[int, str]]:
    if path.suffix == ".py":
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        return [(t.start[0], t.string) for t in tokens if t.type == tokenize.COMMENT]
    found = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        for marker in ("//", "/*", " * "):
            if marker in line:
                found.append((number, line[line.index(marker) :]))
                break
    return found


def test_comments_say_why_not_which_version():
    """Version tags (v24, v45b) and such logs belong in commit messages, not in the code."""
    files = [*ENGINE.rglob("*.py"), *(REPO / "csrc").glob("*.c*"), *(REPO / "csrc").glob("*.h")]
    tagged = [
        f"{p.relative_to(REPO)}:{n}: {text.strip()}"
        for p in files
        for n, text in comments(p)
        if VERSION_TAG.search(text)
    ]
    assert not tagged, tagged
