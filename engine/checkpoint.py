"""Read the files of an official OmniVoice checkpoint (k2-fsa/OmniVoice layout): config, weights, identity.

A checkpoint is a directory holding config.json, model.safetensors (or model.safetensors.index.json
and its shards), tokenizer.json and audio_tokenizer/. A Hugging Face repo id ("owner/name") is
fetched into the Hugging Face cache first. Only safetensors are read: pickles can run code on load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import threading
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from safetensors import SafetensorError, safe_open

from engine.config import ModelConfig, cache_root
from engine.errors import CheckpointError

if TYPE_CHECKING:  # the planner reads configs here; torch comes with the first tensor read (safetensors)
    import torch

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# Tensors upstream may save that the engine does not use (it computes them itself).
IGNORED = re.compile(r"codebook_layer_offsets|llm\.lm_head\..*|(.*\.)?rotary_emb\..*")
NETWORK_PROBE_S = 4.0


def resolve_checkpoint(path_or_repo: str | os.PathLike) -> Path:
    """A local checkpoint directory for a directory path or a Hugging Face repo id ("owner/name")."""
    text = str(path_or_repo)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{path} is a file: --checkpoint takes the checkpoint directory.")
    if REPO_ID.fullmatch(text):
        return _download(text)
    raise CheckpointError(
        f"checkpoint {text!r} is neither an existing directory nor a Hugging Face repo id (owner/name)."
    )


def check_checkpoint_path(checkpoint: str | os.PathLike | None) -> None:
    """Refuse, without the network, what resolve_checkpoint would: a file, or a path that is neither an
    existing directory nor a repo id. None (the embedded tiny checkpoint) and a repo id pass."""
    if checkpoint is None:
        return
    path = Path(str(checkpoint)).expanduser()
    if path.is_dir() or (not path.exists() and REPO_ID.fullmatch(str(checkpoint))):
        return
    resolve_checkpoint(checkpoint)


def locate_checkpoint(checkpoint: str | os.PathLike | None) -> tuple[Path, str]:
    """(local directory, short name) of an EngineConfig.checkpoint; None is the embedded tiny checkpoint."""
    if checkpoint is None:
        from engine.tiny import ensure_tiny_checkpoint

        return ensure_tiny_checkpoint(), "tiny"
    return resolve_checkpoint(checkpoint), Path(str(checkpoint).rstrip("/")).name or str(checkpoint)


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not in the local cache: fetch it below
        pass
    offline = f"pass a local checkpoint directory with --checkpoint (the {repo_id} layout)"
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise CheckpointError(
            f"{repo_id} is not in the Hugging Face cache and HF_HUB_OFFLINE is set: {offline}."
        )
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    if not _reachable(endpoint):
        raise CheckpointError(f"cannot reach {endpoint} to download {repo_id} (offline?): {offline}.")
    try:
        return Path(snapshot_download(repo_id, etag_timeout=10))
    except Exception as e:
        raise CheckpointError(f"downloading {repo_id} from {endpoint} failed ({e}): {offline}.") from None


def _reachable(endpoint: str) -> bool:
    """Whether a TCP connection to the endpoint opens within NETWORK_PROBE_S (name lookup included)."""
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    result = []

    def probe() -> None:
        try:
            socket.create_connection((url.hostname, port), timeout=NETWORK_PROBE_S).close()
            result.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(NETWORK_PROBE_S)
    return bool(result)


def read_config(ckpt_dir: Path) -> tuple[ModelConfig, dict]:
    """The model config and the raw config.json dict (which may carry a "quantization" entry)."""
    cfg = ModelConfig.from_json(ckpt_dir / "config.json")
    return cfg, json.loads((ckpt_dir / "config.json").read_text())


def weight_files(ckpt_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint; CheckpointError for pickles or missing shards."""
    index = ckpt_dir / WEIGHTS_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise CheckpointError(f"{index} is not a safetensors index (needs a 'weight_map'): {e}") from None
        missing = [s for s in shards if not (ckpt_dir / s).is_file()]
        if missing:
            raise CheckpointError(f"{index} names shards that are not in {ckpt_dir}: {', '.join(missing)}.")
        return [ckpt_dir / s for s in shards]
    if (ckpt_dir / WEIGHTS).is_file():
        return [ckpt_dir / WEIGHTS]
    pickles = sorted(p.name for p in ckpt_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{ckpt_dir} holds pickle weights ({', '.join(pickles)}), which are refused because loading them "
            "can run arbitrary code. Convert them to safetensors (safetensors.torch.save_file) as "
            f"{WEIGHTS}."
        )
    raise CheckpointError(f"{ckpt_dir} has neither {WEIGHTS} nor {WEIGHTS_INDEX}.")


def checkpoint_fingerprint(ckpt_dir: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> str:
    """The identity of a checkpoint's weights: files_fingerprint of config.json and of each weight file, in
    weight_files order. Engine.model_id shows its first 12 digits; a W4A4 checkpoint records its source's
    fingerprint as quantization.source_hash."""
    ckpt_dir = Path(ckpt_dir)
    config = ckpt_dir / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{config} not found: a checkpoint directory needs config.json.")
    return files_fingerprint([config, *weight_files(ckpt_dir)], cache_dir)


def _stamp(st: os.stat_result) -> tuple[int, ...]:
    return st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns


def files_fingerprint(files: list[Path], cache_dir: str | os.PathLike | None = None) -> str:
    """sha256 over the sha256 of each file, in order (64 hex digits).

    Hashing reads every byte (seconds for a full-size checkpoint), so the result is kept in `cache_dir`
    (default <cache_root>/fingerprints) under the files' paths, sizes and modification times: a load of
    unchanged files reads none of them to name them. The stamps hold the inode and change time too: a
    file replaced or rewritten keeps neither, whatever size and modification time it is given."""
    stamps = [(str(p.resolve()), *_stamp(p.stat())) for p in files]
    key = hashlib.sha256(json.dumps(stamps).encode()).hexdigest()
    cached = Path(cache_dir or cache_root() / "fingerprints") / key
    try:
        known = cached.read_text().strip()
    except OSError:
        known = ""
    if re.fullmatch(r"[0-9a-f]{64}", known):
        return known
    digest = hashlib.sha256()
    for path in files:
        with path.open("rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    fingerprint = digest.hexdigest()
    _remember(cached, fingerprint)
    return fingerprint


def _remember(path: Path, text: str) -> None:
    """Write `path` whole or not at all (a read-only cache folder is not an error: the next load hashes)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text + "\n")
        os.replace(tmp, path)
    except OSError as e:
        log.warning("fingerprint not cached in %s (%s)", path.parent, e)


def tensor_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the files, read from the headers only; CheckpointError naming a
    file whose header is not safetensors."""
    shapes = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except SafetensorError as e:
            raise CheckpointError(f"{file} cannot be read as safetensors ({e}): re-download it.") from None
    return shapes


def read_tensors(
    files: list[Path], device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """All tensors of the files (except IGNORED ones); floating ones cast to dtype when given."""
    tensors = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if IGNORED.fullmatch(name):
                    continue
                tensors[name] = owned_copy(f.get_tensor(name), device, dtype)
    return tensors


def owned_copy(t: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """t on `device`, a floating t cast to dtype when given, in memory of its own: safetensors' CPU tensors
    lie over the mapped file at its offsets, and a CPU BLAS may sum a short product in an order that depends
    on the operands' alignment (the codec's 1-frame decode differed from transformers' by an ulp on an AMD
    EPYC, tests/test_codec.py). One copy, as a move to the GPU makes anyway."""
    cast = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
    return t.to(device=device, dtype=cast, copy=True)


def check_shapes(
    expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], where: Path
) -> None:
    """CheckpointError naming every missing, unexpected or misshapen tensor."""
    found = {k: v for k, v in found.items() if not IGNORED.fullmatch(k)}
    problems = [
        f"missing tensor {k} (expected shape {list(v)})" for k, v in expected.items() if k not in found
    ]
    problems += [f"unexpected tensor {k} (shape {list(v)})" for k, v in found.items() if k not in expected]
    problems += [
        f"tensor {k} has shape {list(found[k])}, expected {list(v)}"
        for k, v in expected.items()
        if k in found and tuple(found[k]) != tuple(v)
    ]
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise CheckpointError(
            f"{where} does not match its config.json: {shown}. Use the weights that came with this config."
        )
