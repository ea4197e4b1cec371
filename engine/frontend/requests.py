"""A synthesis request's shape, without the model or the codec: checks, language, reference frames, target
frames, text chunks and packed sizes.

The engine prepares every request with it; a job's planner sizes rows with it on a CPU. The reference
clip is prepared as the engine prepares it and counted in whole codec hops (the codec makes one frame
per hop of a prepared clip), never encoded, so planning costs milliseconds per clip and a row's target
length comes from the same code wherever it is computed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine.config import EngineConfig
from engine.errors import InputError
from engine.frontend.audio import ClipSource, ReferenceSettings, clip_name, prepare_reference
from engine.frontend.chunking import Chunk, needs_chunking, plan_chunks
from engine.frontend.duration import effective_speed, estimate_target_frames
from engine.frontend.text import (
    TextFrontend,
    add_punctuation,
    has_chinese,
    resolve_instruct,
    resolve_language,
)

if TYPE_CHECKING:
    from engine.frontend.prompt import VoicePrompt

# Longest output one request may ask for (through its text, speed or duration).
MAX_OUTPUT_S = 600.0


@dataclass
class SynthRequest:
    text: str
    ref_audio: str | Path | bytes | None = None  # clip path or file content; needs ref_text
    ref_text: str | None = None
    prompt: VoicePrompt | None = None  # a prepared voice instead of ref_audio + ref_text
    language: str | None = None
    instruct: str | None = None  # voice design: a style description (no reference needed)
    duration: float | None = None  # seconds; overrides speed
    speed: float | None = None
    seed: int = 0


@dataclass
class PreparedRequest:
    request: SynthRequest
    language: str | None
    instruct: str | None
    ref_text: str | None  # the reference's transcript as the prompt uses it; None without a reference
    ref_frames: int  # codec frames of the reference (0 without one)
    target_frames: int  # of the whole text
    chunks: list[Chunk]  # one chunk holding the whole text unless the text is long
    prompt: VoicePrompt | None = None  # the reference's codes (None where only the size was needed)
    # Whether the token budget (run settings) cut the text into other chunks than its length alone would
    # (then the row's audio depends on that budget, and a job keeps it: pipeline.plan.Plan.token_budget).
    cut_to_budget: bool = False


@dataclass(frozen=True)
class CodecShape:
    """What sizing needs of the codec: its rate and hop (read from its config, no weights)."""

    sample_rate: int
    hop_length: int

    @property
    def frame_rate(self) -> float:
        return self.sample_rate / self.hop_length

    @classmethod
    def from_dir(cls, codec_dir: Path) -> CodecShape:
        from engine.codec.checkpoint import read_codec_config

        cfg = read_codec_config(codec_dir / "config.json")
        return cls(int(cfg.sample_rate), int(cfg.hop_length))


def reference_frames(clip: ClipSource, codec: CodecShape, settings: ReferenceSettings) -> int:
    """Codec frames the clip's prompt will hold (AudioError when the clip cannot be used)."""
    return (
        len(prepare_reference(clip, codec.sample_rate, codec.hop_length, settings).audio) // codec.hop_length
    )


class RequestFrontend:
    def __init__(self, cfg: EngineConfig, text: TextFrontend, codec: CodecShape):
        self.cfg = cfg
        self.gen = cfg.generation
        self.text = text
        self.codec = codec
        self.frame_rate = codec.frame_rate
        self.reference_settings = ReferenceSettings(
            preprocess=self.gen.preprocess_prompt, max_seconds=cfg.max_ref_seconds
        )

    @classmethod
    def from_checkpoint(cls, cfg: EngineConfig, ckpt_dir: Path) -> RequestFrontend:
        """Reads only the tokenizer and the codec's config of the checkpoint."""
        return cls(
            cfg, TextFrontend(ckpt_dir / "tokenizer.json"), CodecShape.from_dir(ckpt_dir / "audio_tokenizer")
        )

    def checked_style(self, req: SynthRequest) -> tuple[str | None, str | None]:
        """Check text and seed; resolve language and instruct."""
        text = req.text
        if not isinstance(text, str) or not text.strip():
            raise InputError(f"text {text!r} is empty or whitespace only: give the words to speak.")
        if not any(c.isprintable() and not c.isspace() for c in text):  # zero-width, format, control
            raise InputError(f"text {text!r} holds no visible character: give the words to speak.")
        if len(text) > self.cfg.max_text_chars:
            raise InputError(
                f"text of {len(text)} characters ({text[:40]!r}...) is over the {self.cfg.max_text_chars}-"
                "character limit: split it into several requests or raise max_text_chars (in a job: "
                f"engine.max_text_chars={len(text)})."
            )
        integer = isinstance(req.seed, int | np.integer) and not isinstance(req.seed, bool)
        if not integer or not 0 <= req.seed < 2**63:
            raise InputError(f"seed={req.seed!r}: give an integer from 0 to 2**63 - 1.")
        language = resolve_language(req.language)
        instruct = resolve_instruct(req.instruct, use_zh=has_chinese(text)) if req.instruct else None
        return language, instruct

    def clip_of(self, req: SynthRequest) -> tuple[str, str] | None:
        """(clip name, reference text as prompts store it) when the request clones a clip; checks that
        the voice fields go together."""
        if req.prompt is not None:
            if req.ref_audio is not None or req.ref_text is not None:
                raise InputError(
                    "a request gives both a voice prompt and ref_audio/ref_text: pass one of the two."
                )
            from engine.frontend.prompt import VoicePrompt  # imports this module's neighbours

            if not isinstance(req.prompt, VoicePrompt):
                raise InputError(
                    f"prompt is a {type(req.prompt).__name__}: give a VoicePrompt (VoicePrompt.load reads a "
                    "saved one)."
                )
            return None
        if req.ref_audio is None:
            if req.ref_text is not None:
                raise InputError(
                    f"ref_text {req.ref_text!r:.40} is given without ref_audio: add the reference clip, "
                    "or drop ref_text for voice design / auto voice."
                )
            return None
        empty = isinstance(req.ref_audio, str) and not req.ref_audio.strip()
        if not isinstance(req.ref_audio, str | Path | bytes) or empty:
            raise InputError(
                f"ref_audio={req.ref_audio!r:.60}: give the clip's path or its file's bytes (or leave it "
                "unset for voice design / auto voice)."
            )
        name = clip_name(req.ref_audio)
        if not isinstance(req.ref_text, str) or not req.ref_text.strip():
            raise InputError(
                f"reference clip {name} has no transcript (ref_text={req.ref_text!r}): give the words spoken "
                "in the clip (automatic transcription is not part of this engine)."
            )
        return name, add_punctuation(req.ref_text) if self.gen.preprocess_prompt else req.ref_text

    def reference_frames(self, clip: ClipSource) -> int:
        return reference_frames(clip, self.codec, self.reference_settings)

    def size(
        self, req: SynthRequest, frames_of: Callable[[ClipSource], int] | None = None
    ) -> PreparedRequest:
        """A request prepared without its prompt's codes; frames_of (default reference_frames) gives a
        clip's frame count where the caller has it already."""
        language, instruct = self.checked_style(req)
        clip = self.clip_of(req)
        if clip is not None:
            frames = (frames_of or self.reference_frames)(req.ref_audio)
            return self.planned(req, language, instruct, clip[1], frames)
        if req.prompt is not None:
            return self.planned(req, language, instruct, req.prompt.ref_text, int(req.prompt.tokens.shape[1]))
        return self.planned(req, language, instruct, None, 0)

    def planned(
        self,
        req: SynthRequest,
        language: str | None,
        instruct: str | None,
        ref_text: str | None,
        ref_frames: int,
    ) -> PreparedRequest:
        """Target frames (duration/speed applied) and, for a long text or one whose generation would not
        fit the token budget, its chunks, cut so that each fits where chunks of a few characters can."""
        text = req.text
        frames = ref_frames if ref_text is not None else None
        target = estimate_target_frames(text, ref_text, frames, req.speed, req.duration, self.frame_rate)
        if target > MAX_OUTPUT_S * self.frame_rate:
            raise InputError(
                f"request (text {text[:40]!r}, speed={req.speed}, duration={req.duration}) asks for "
                f"{target / self.frame_rate:.0f} s of audio, over the {MAX_OUTPUT_S:.0f} s limit: "
                "use a shorter duration, a speed nearer 1, or split the text."
            )
        p = PreparedRequest(
            req, language, instruct, ref_text, ref_frames, target, [Chunk(text, target, False)]
        )
        is_long = needs_chunking(target, self.gen.audio_chunk_threshold, self.frame_rate)
        if self.gen.audio_chunk_duration > 0 and (is_long or not self._fits(p)):
            speed = effective_speed(text, ref_text, frames, req.speed, req.duration, self.frame_rate)
            chunk_s = self.gen.audio_chunk_duration
            chunked = partial(plan_chunks, text, target, ref_text, frames, speed, chunk_s, self.frame_rate)
            p.chunks = chunked(fits=lambda chunks: self._fits(replace(p, chunks=chunks)))
            p.cut_to_budget = not is_long or p.chunks != chunked()
        return p

    def _fits(self, p: PreparedRequest) -> bool:
        # The budget comes from run settings; it binds only where a chunk of about audio_chunk_duration
        # would not fit (cut_to_budget), which the planner would otherwise reject.
        budget = self.cfg.token_budget
        return all(text + ref + 2 * target <= budget for text, ref, target in self.chunk_sizes(p))

    def chunk_reference(self, p: PreparedRequest, index: int) -> tuple[str | None, int]:
        """The transcript and frame count of what chunk `index` clones: the reference, or (no clip) the
        first chunk's generated audio for the later chunks of a long text; (None, 0) for none."""
        chunk = p.chunks[index]
        if p.ref_text is not None:
            return p.ref_text, p.ref_frames
        if chunk.first_chunk_is_ref:
            return p.chunks[0].text, p.chunks[0].target_frames
        return None, 0

    def chunk_prompt_ids(self, p: PreparedRequest, index: int, ref_text: str | None) -> list[int]:
        return self.text.prompt_ids(
            p.chunks[index].text,
            ref_text,
            p.language,
            p.instruct,
            self.gen.denoise,
            has_ref=ref_text is not None,
        )

    def chunk_sizes(self, p: PreparedRequest) -> list[tuple[int, int, int]]:
        """(text tokens, reference frames, target frames) of each chunk of a prepared request; the runner
        packs text + reference + 2 x target tokens per chunk, one generation each."""
        sizes = []
        for index, chunk in enumerate(p.chunks):
            ref_text, ref_frames = self.chunk_reference(p, index)
            sizes.append((len(self.chunk_prompt_ids(p, index, ref_text)), ref_frames, chunk.target_frames))
        return sizes
