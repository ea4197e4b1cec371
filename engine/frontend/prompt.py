"""Voice prompts (a reference clip's codec tokens, transcript and loudness) and their on-disk cache.

A prompt is stored as `<stem>.safetensors` (the tokens) plus `<stem>.json` (transcript, RMS, shape and
a checksum of the tokens), never as a pickle. The cache keeps one directory per key and publishes it
with a single atomic rename, so concurrent writers of the same key leave exactly one complete entry.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from engine.errors import InputError
from engine.frontend.audio import ClipSource, ReferenceSettings, prepare_reference, read_clip_bytes

log = logging.getLogger(__name__)

PROMPT_FORMAT = "ovbatch-voice-prompt"
PROMPT_VERSION = 1
ENTRY_STEM = "prompt"


def _tokens_sha256(tokens: torch.Tensor) -> str:
    return hashlib.sha256(tokens.contiguous().numpy().tobytes()).hexdigest()


@dataclass
class VoicePrompt:
    tokens: torch.Tensor  # long [C, F] reference audio codes
    ref_text: str
    ref_rms: float

    def save(self, stem: str | Path) -> None:
        """Write `<stem>.safetensors` and `<stem>.json`."""
        stem = Path(stem)
        tokens = self.tokens.detach().to("cpu", torch.long).contiguous()
        save_file({"tokens": tokens}, str(stem.with_suffix(".safetensors")))
        meta = {
            "format": PROMPT_FORMAT,
            "version": PROMPT_VERSION,
            "ref_text": self.ref_text,
            "ref_rms": float(self.ref_rms),
            "shape": list(tokens.shape),
            "tokens_sha256": _tokens_sha256(tokens),
        }
        stem.with_suffix(".json").write_text(json.dumps(meta, ensure_ascii=False, indent=1))

    @classmethod
    def load(cls, stem: str | Path) -> VoicePrompt:
        """Read a prompt written by save(); InputError naming the file when it is missing or inconsistent."""
        stem = Path(stem)
        json_path, st_path = stem.with_suffix(".json"), stem.with_suffix(".safetensors")
        fix = "write it again with VoicePrompt.save (or delete it to have it rebuilt)."
        try:
            meta = json.loads(json_path.read_text())
            tokens = load_file(str(st_path))["tokens"]
        except FileNotFoundError as e:
            raise InputError(f"voice prompt {e.filename} is missing: {fix}") from None
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, OSError, SafetensorError) as e:
            raise InputError(f"voice prompt {stem} is unreadable ({e!r}): {fix}") from None
        if meta.get("format") != PROMPT_FORMAT or meta.get("version") != PROMPT_VERSION:
            raise InputError(
                f"{json_path} is not a version-{PROMPT_VERSION} {PROMPT_FORMAT} file "
                f"(format {meta.get('format')!r}, version {meta.get('version')!r}): {fix}"
            )
        if (
            tokens.dtype != torch.long
            or list(tokens.shape) != meta.get("shape")
            or _tokens_sha256(tokens) != meta.get("tokens_sha256")
        ):
            raise InputError(f"voice prompt {st_path} does not match {json_path} (shape or checksum): {fix}")
        return cls(tokens=tokens, ref_text=meta["ref_text"], ref_rms=float(meta["ref_rms"]))


def build_prompt(raw: bytes, name: str, ref_text: str, codec, settings: ReferenceSettings) -> VoicePrompt:
    """Prepare a clip's samples (engine.frontend.audio) and encode them with the codec."""
    ref = prepare_reference(name, codec.sample_rate, codec.hop_length, settings, has_transcript=True, raw=raw)
    (tokens,) = codec.encode([torch.from_numpy(ref.audio)])
    return VoicePrompt(tokens=tokens.to("cpu", torch.long), ref_text=ref_text, ref_rms=ref.rms)


class PromptCache:
    """Prompts keyed by (clip content, reference text, preparation settings, codec identity).

    directory=None keeps them in memory for this process only.
    """

    def __init__(self, directory: str | Path | None, codec_identity: str, settings_fingerprint: dict):
        self.directory = Path(directory) if directory is not None else None
        self._memory: dict[str, VoicePrompt] = {}
        self._context = {"codec": codec_identity, "settings": settings_fingerprint}
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)

    def key(self, clip_bytes: bytes, ref_text: str) -> str:
        material = {
            "clip_sha256": hashlib.sha256(clip_bytes).hexdigest(),
            "ref_text": ref_text,
            **self._context,
        }
        return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()

    def entry_dir(self, key: str) -> Path:
        assert self.directory is not None
        return self.directory / key[:2] / key

    def get_or_create(
        self, clip: ClipSource, ref_text: str, make: Callable[[bytes], VoicePrompt]
    ) -> VoicePrompt:
        """The cached prompt, or make(clip_bytes) stored under the key (make runs only on a miss)."""
        raw = read_clip_bytes(clip)
        key = self.key(raw, ref_text)
        if self.directory is None:
            if key not in self._memory:
                self._memory[key] = make(raw)
            return self._memory[key]
        cached = self._load(key)
        if cached is not None:
            return cached
        prompt = make(raw)
        self._publish(key, prompt)
        return prompt

    def _load(self, key: str) -> VoicePrompt | None:
        entry = self.entry_dir(key)
        if not entry.exists():
            return None
        try:
            return VoicePrompt.load(entry / ENTRY_STEM)
        except InputError as e:
            log.warning("prompt cache entry %s is damaged (%s); rebuilding it", entry, e)
            shutil.rmtree(entry, ignore_errors=True)
            return None

    def _publish(self, key: str, prompt: VoicePrompt) -> None:
        final = self.entry_dir(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".tmp-{uuid.uuid4().hex[:8]}-", dir=final.parent))
        try:
            prompt.save(staging / ENTRY_STEM)
            os.rename(staging, final)  # atomic; fails when another writer published first
        except OSError:
            if not final.exists():
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
