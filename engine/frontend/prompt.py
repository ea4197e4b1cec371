"""Voice prompts (a reference clip's codec tokens, transcript and loudness) and their on-disk cache.

A prompt is stored as `<stem>.safetensors` (the tokens) plus `<stem>.json` (transcript, RMS, shape and
a checksum of the tokens), never as a pickle. The cache keeps one directory per key and publishes it
with a single atomic rename, so concurrent writers of the same key leave exactly one complete entry.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.profiler import record_function

from engine.errors import AudioError, InputError
from engine.frontend.audio import (
    ClipSource,
    PreparedReference,
    ReferenceSettings,
    prepare_reference,
    read_clip_bytes,
)
from engine.fsmodes import chmod_tree_as_created

log = logging.getLogger(__name__)

PROMPT_FORMAT = "ovbatch-voice-prompt"
PROMPT_VERSION = 1
ENTRY_STEM = "prompt"


def _positive(value: object) -> bool:
    """A positive finite number (a ref_rms of 0 would silence the output, < 0 flip it)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return number and math.isfinite(value) and value > 0


def _tokens_sha256(tokens: torch.Tensor) -> str:
    return hashlib.sha256(tokens.contiguous().numpy().tobytes()).hexdigest()


@dataclass
class VoicePrompt:
    tokens: torch.Tensor  # long [C, F] reference audio codes
    ref_text: str
    ref_rms: float
    # the clip's length as given (engine.max_ref_seconds applies to it on a cache hit); None: not known
    source_seconds: float | None = None

    def __post_init__(self) -> None:
        if not _positive(self.ref_rms):
            raise InputError(
                f"voice prompt ref_rms={self.ref_rms!r}: give the reference clip's RMS, a positive finite "
                "number (it scales the output's loudness)."
            )
        if self.source_seconds is not None and not _positive(self.source_seconds):
            raise InputError(
                f"voice prompt source_seconds={self.source_seconds!r}: give the reference clip's length in "
                "seconds, a positive finite number, or None."
            )

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
            **({} if self.source_seconds is None else {"source_seconds": float(self.source_seconds)}),
            "shape": list(tokens.shape),
            "tokens_sha256": _tokens_sha256(tokens),
        }
        stem.with_suffix(".json").write_text(json.dumps(meta, ensure_ascii=False, indent=1), encoding="utf-8")

    @classmethod
    def load(cls, stem: str | Path) -> VoicePrompt:
        """Read a prompt written by save(); InputError naming the file when it is missing or inconsistent."""
        stem = Path(stem)
        json_path, st_path = stem.with_suffix(".json"), stem.with_suffix(".safetensors")
        fix = "write it again with VoicePrompt.save (or delete it to have it rebuilt)."
        try:
            meta = json.loads(json_path.read_text(encoding="utf-8"))
            tokens = load_file(str(st_path))["tokens"]
        except FileNotFoundError as e:
            raise InputError(f"voice prompt {e.filename} is missing: {fix}") from None
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, OSError, SafetensorError) as e:
            raise InputError(f"voice prompt {stem} is unreadable ({e!r}): {fix}") from None
        if not isinstance(meta, dict):
            raise InputError(f"{json_path} holds {type(meta).__name__}, not a prompt's metadata: {fix}")
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
        ref_text, ref_rms, seconds = meta.get("ref_text"), meta.get("ref_rms"), meta.get("source_seconds")
        if (
            not isinstance(ref_text, str)
            or not _positive(ref_rms)
            or not (seconds is None or _positive(seconds))
        ):
            raise InputError(
                f"{json_path} needs a text ref_text, a positive finite ref_rms and source_seconds (or none), "
                f"has {ref_text!r}, {ref_rms!r} and {seconds!r}: {fix}"
            )
        return cls(tokens, ref_text, float(ref_rms), None if seconds is None else float(seconds))


def build_prompts(
    clips: list[tuple[bytes, str, str]],
    codec,
    settings: ReferenceSettings,
    prepared: list[PreparedReference | AudioError | None] | None = None,
) -> list[VoicePrompt | AudioError]:
    """(clip bytes, clip name, reference text) -> prompts: each clip prepared (engine.frontend.audio; or
    taken from `prepared`, one entry per clip, None where it is not ready), the usable ones encoded in one
    codec call (the codec batches them). A clip that cannot be used yields its AudioError in place, so the
    others still get theirs."""
    refs: list[PreparedReference | AudioError] = []
    for (raw, name, _), ready in zip(clips, prepared or [None] * len(clips), strict=True):
        if ready is not None:
            refs.append(ready)
            continue
        try:
            refs.append(
                prepare_reference(
                    name, codec.sample_rate, codec.hop_length, settings, has_transcript=True, raw=raw
                )
            )
        except AudioError as e:
            refs.append(e)
    usable = [i for i, r in enumerate(refs) if isinstance(r, PreparedReference)]
    out: list[VoicePrompt | AudioError] = list(refs)
    if usable:  # one call: the codec batches the clips (bounded by its ENCODE_BATCH_SECONDS)
        with record_function("ovbatch.encode"):
            codes = codec.encode([torch.from_numpy(refs[i].audio) for i in usable], device="cpu")
        for i, tokens in zip(usable, codes, strict=True):
            out[i] = VoicePrompt(
                tokens=tokens.to(torch.long).contiguous(),
                ref_text=clips[i][2],
                ref_rms=refs[i].rms,
                source_seconds=refs[i].source_seconds,
            )
    return out


def build_prompt(raw: bytes, name: str, ref_text: str, codec, settings: ReferenceSettings) -> VoicePrompt:
    """One clip's prompt (build_prompts for a single clip); AudioError when the clip cannot be used."""
    (prompt,) = build_prompts([(raw, name, ref_text)], codec, settings)
    if isinstance(prompt, AudioError):
        raise prompt
    return prompt


class PromptCache:
    """Prompts keyed by (clip content, reference text, preparation settings, codec identity).

    directory=None keeps them in memory for this process only. On disk, the prompts made are written by one
    writer thread, so that the caller (a batch being prepared while the device waits) goes on at once; until
    written, a lookup in this process finds them in memory. flush() waits for the writes. A write that fails
    is logged: the prompt is still used, only not kept.
    """

    def __init__(self, directory: str | Path | None, codec_identity: str, settings_fingerprint: dict):
        self.directory = Path(directory) if directory is not None else None
        self._memory: dict[str, VoicePrompt] = {}  # directory=None: every prompt; else those being written
        self._lock = threading.Lock()
        self._context = {"codec": codec_identity, "settings": settings_fingerprint}
        self._writer: ThreadPoolExecutor | None = None
        self._write_failed = False  # warned once
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="ovbatch-prompt-writer")

    def key(self, clip_bytes: bytes, ref_text: str) -> str:
        material = {
            "clip_sha256": hashlib.sha256(clip_bytes).hexdigest(),
            "ref_text": ref_text,
            **self._context,
        }
        return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()

    def has(self, key: str) -> bool:
        with self._lock:
            if key in self._memory:
                return True
        return self.directory is not None and self.entry_dir(key).exists()

    def flush(self) -> None:
        """Until every prompt made so far is written (or its write failed)."""
        if self._writer is not None:
            self._writer.submit(lambda: None).result()  # one writer thread: it runs after the writes queued

    def entry_dir(self, key: str) -> Path:
        assert self.directory is not None
        return self.directory / key[:2] / key

    def get_or_create(
        self, clip: ClipSource, ref_text: str, make: Callable[[bytes], VoicePrompt]
    ) -> VoicePrompt:
        """The cached prompt, or make(clip_bytes) stored under the key (make runs only on a miss)."""
        return self.get_or_create_many(
            [clip], [ref_text], lambda misses: [make(raw) for _, raw, _ in misses]
        )[0]

    def get_or_create_many(
        self,
        clips: list[ClipSource],
        ref_texts: list[str],
        make_many: Callable[[list[tuple[int, bytes | None, str]]], list[VoicePrompt | AudioError]],
        keys: list[str | None] | None = None,
    ) -> list[VoicePrompt]:
        """Prompts for many clips: hits are read back, the misses made by ONE make_many call.

        make_many receives (index into clips, clip bytes, key) for one clip per distinct missing key and
        returns a prompt or an AudioError for each. keys: a clip's key where the caller has it already (it
        read and hashed the clip): that clip is not read again, and make_many gets None for its bytes.
        Every prompt made is cached before the first error (unreadable clip or AudioError) is raised, so
        a retry without the bad clip hits the cache.
        """
        found: list[VoicePrompt | None] = [None] * len(clips)
        errors: list[AudioError] = []
        misses: dict[str, list[int]] = {}
        raws: dict[int, bytes] = {}
        for i, (clip, ref_text) in enumerate(zip(clips, ref_texts, strict=True)):
            key = keys[i] if keys is not None else None
            if key is None:
                try:
                    raws[i] = read_clip_bytes(clip)
                except AudioError as e:
                    errors.append(e)
                    continue
                key = self.key(raws[i], ref_text)
            found[i] = self._load(key)
            if found[i] is None:
                misses.setdefault(key, []).append(i)
        if misses:
            made = make_many([(group[0], raws.get(group[0]), key) for key, group in misses.items()])
            with record_function("ovbatch.prompt_store"):
                for (key, group), prompt in zip(misses.items(), made, strict=True):
                    if isinstance(prompt, AudioError):
                        errors.append(prompt)
                        continue
                    self._store(key, prompt)
                    for i in group:
                        found[i] = prompt
        if errors:
            raise errors[0]
        return found

    def _store(self, key: str, prompt: VoicePrompt) -> None:
        with self._lock:
            self._memory[key] = prompt
        if self._writer is not None:
            self._writer.submit(self._write, key, prompt)

    def _write(self, key: str, prompt: VoicePrompt) -> None:
        """On the writer thread: publish the entry, then drop it from memory."""
        try:
            self._publish(key, prompt)
        except Exception as e:  # noqa: BLE001 - the cache is an optimisation: a failed write fails no row
            first, self._write_failed = not self._write_failed, True
            log.log(
                logging.WARNING if first else logging.DEBUG,
                "prompt cache entry %s was not written (%s): the prompt is used but not kept; check that "
                "engine.prompt_cache_dir is writable and has space%s",
                self.entry_dir(key),
                e,
                " (further failures are logged at debug level)" if first else "",
            )
        finally:
            with self._lock:
                self._memory.pop(key, None)

    def _load(self, key: str) -> VoicePrompt | None:
        with self._lock:
            prompt = self._memory.get(key)
        if prompt is not None or self.directory is None:
            return prompt
        entry = self.entry_dir(key)
        if not entry.exists():
            return None
        try:
            prompt = VoicePrompt.load(entry / ENTRY_STEM)
        except InputError as e:
            log.warning("prompt cache entry %s is damaged (%s); rebuilding it", entry, e)
            shutil.rmtree(entry, ignore_errors=True)
            return None
        if prompt.source_seconds is None:  # an entry from before clips' lengths were kept
            log.info("prompt cache entry %s does not know its clip's length; rebuilding it", entry)
            shutil.rmtree(entry, ignore_errors=True)
            return None
        return prompt

    def _publish(self, key: str, prompt: VoicePrompt) -> None:
        final = self.entry_dir(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
        try:
            prompt.save(staging / ENTRY_STEM)
            chmod_tree_as_created(staging)  # mkdtemp and save_file make owner-only entries; others reuse them
            os.rename(staging, final)  # atomic; fails when another writer published first
        except OSError:
            if not final.exists():
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
