"""The high-level engine: synthesis requests in, float32 waveforms at the codec rate out, with timings.

One `synthesize` call prepares every request (validation, voice prompt from the cache), generates all
of them together through the Runner (a long text is cut into chunks; chunk k of every long request
runs in round k, and round 0 also carries every short request), decodes all token sequences in
batches, then post-processes each waveform as upstream does.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from engine.checkpoint import checkpoint_fingerprint, read_config, resolve_checkpoint
from engine.codec import Codec
from engine.config import DTYPES, EngineConfig, resolve_device
from engine.errors import AudioError, CheckpointError, InputError
from engine.frontend.audio import ReferenceSettings, clip_name, cross_fade_chunks, postprocess_output
from engine.frontend.chunking import Chunk, needs_chunking, plan_chunks
from engine.frontend.duration import effective_speed, estimate_target_frames
from engine.frontend.prompt import PromptCache, VoicePrompt, build_prompts
from engine.frontend.text import (
    TextFrontend,
    add_punctuation,
    has_chinese,
    resolve_instruct,
    resolve_language,
)
from engine.generate.batching import even_batches
from engine.generate.loop import Runner
from engine.generate.packing import GenItem, packed_tokens
from engine.loading import load_model

log = logging.getLogger(__name__)

# Frames decoded per codec call (16 clips of 30 s at 25 frames/s): bounds the decoder's memory.
DECODE_BATCH_FRAMES = 12_000
# Longest output one request may ask for (through its text, speed or duration).
MAX_OUTPUT_S = 600.0
# Upstream warns that references over 20 s slow generation down and clone worse.
LONG_REFERENCE_S = 20.0


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
class SynthResult:
    audio: np.ndarray  # float32, mono, at sample_rate
    sample_rate: int
    target_frames: int
    token_work: int  # packed tokens x decoding steps spent on this request
    # prepare, generate and decode: seconds of the whole synthesize call; postprocess: this request's.
    timings: dict[str, float] = field(default_factory=dict)
    # The generated audio codes [codebooks, frames], a long text's chunks joined in order (A/B reports
    # compare them between variants).
    tokens: np.ndarray | None = None


@dataclass
class PreparedRequest:
    request: SynthRequest
    language: str | None
    instruct: str | None
    prompt: VoicePrompt | None
    target_frames: int  # of the whole text
    chunks: list[Chunk]  # one chunk holding the whole text unless the text is long


def resolve_precision(precision: str, device: torch.device, quantized: bool) -> tuple[str, torch.dtype]:
    """(precision name, activation dtype). auto: w4a4 for a W4A4 checkpoint, else bf16 on CUDA and fp32
    on CPU."""
    if precision == "auto":
        precision = "w4a4" if quantized else ("bf16" if device.type == "cuda" else "fp32")
    if (precision == "w4a4") != quantized:
        kind = "a W4A4" if quantized else "an unquantized"
        raise CheckpointError(
            f"precision={precision!r} with {kind} checkpoint: use precision='auto', or pass "
            + ("an unquantized checkpoint." if quantized else "a W4A4 checkpoint made by the quantizer.")
        )
    if precision == "fp8" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise CheckpointError(
            f"precision='fp8' needs FP8 tensor cores (sm_89 or newer); {name} has none: use bf16."
        )
    if precision in ("w4a4", "fp8"):
        return precision, torch.bfloat16 if device.type == "cuda" else torch.float32
    return precision, DTYPES[precision]


def _chunk_seed(seed: int, index: int) -> int:
    """Seed of chunk `index` of a request: chunk 0 uses the request's seed (so a text's first chunk and
    an unchunked text draw alike), later chunks a fixed derivation of it."""
    return seed if index == 0 else (seed * 1_000_003 + index * 0x9E3779B97F4A7C15) % (1 << 63)


class Engine:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.gen = cfg.generation
        if cfg.checkpoint is None:
            from engine.tiny import ensure_tiny_checkpoint

            ckpt_dir, name = ensure_tiny_checkpoint(), "tiny"
        else:
            ckpt_dir = resolve_checkpoint(cfg.checkpoint)
            name = Path(str(cfg.checkpoint).rstrip("/")).name or str(cfg.checkpoint)
        self.checkpoint_dir = ckpt_dir
        self.device = resolve_device(cfg.device)
        _, raw_config = read_config(ckpt_dir)
        self.precision, self.dtype = resolve_precision(
            cfg.precision, self.device, "quantization" in raw_config
        )
        self.model_config, self.model = load_model(
            ckpt_dir,
            self.device,
            self.dtype,
            attention=cfg.attention,
            fast_paths=cfg.fast_paths,
            fp8=self.precision == "fp8",
        )
        self.model_id = f"{name}@{checkpoint_fingerprint(ckpt_dir)[:12]}"
        self.text = TextFrontend(ckpt_dir / "tokenizer.json")
        self.codec = Codec.from_dir(ckpt_dir / "audio_tokenizer", device=self.device)
        if self.codec.num_codebooks != self.model_config.num_audio_codebook:
            raise CheckpointError(
                f"{ckpt_dir}: the codec has {self.codec.num_codebooks} codebooks, the model "
                f"{self.model_config.num_audio_codebook}; audio_tokenizer/ must come with this model."
            )
        self.sample_rate = self.codec.sample_rate
        self.frame_rate = self.codec.frame_rate
        self.reference_settings = ReferenceSettings(
            preprocess=self.gen.preprocess_prompt, max_seconds=cfg.max_ref_seconds
        )
        self.prompts = PromptCache(
            cfg.prompt_cache_dir,
            self.codec.identity,
            self.reference_settings.fingerprint(self.codec.sample_rate, self.codec.hop_length),
        )
        self.runner = Runner(self.model, cfg, self.device, self.dtype)
        log.info("engine ready: %s, %s on %s", self.model_id, self.precision, self.device)

    # ------------------------------------------------------------------------------------- prepare

    def prepare(self, req: SynthRequest) -> PreparedRequest:
        """Validate a request and build its voice prompt (through the cache)."""
        return self.prepare_many([req])[0]

    def prepare_many(self, reqs: list[SynthRequest]) -> list[PreparedRequest]:
        """prepare() for many requests; the reference clips missing from the cache are encoded together."""
        styles = [self._checked_style(r) for r in reqs]
        prompts = self._voice_prompts(reqs)
        return [self._planned(r, lang, instruct, p) for r, (lang, instruct), p in zip(reqs, styles, prompts)]

    def _checked_style(self, req: SynthRequest) -> tuple[str | None, str | None]:
        """Check text and seed; resolve language and instruct."""
        text = req.text
        if not isinstance(text, str) or not text.strip():
            raise InputError(f"text {text!r} is empty or whitespace only: give the words to speak.")
        if len(text) > self.cfg.max_text_chars:
            raise InputError(
                f"text of {len(text)} characters ({text[:40]!r}...) is over the {self.cfg.max_text_chars}-"
                "character limit: split it into several requests or raise EngineConfig.max_text_chars."
            )
        if isinstance(req.seed, bool) or not isinstance(req.seed, int | np.integer):
            raise InputError(f"seed={req.seed!r}: give an integer.")
        language = resolve_language(req.language)
        instruct = resolve_instruct(req.instruct, use_zh=has_chinese(text)) if req.instruct else None
        return language, instruct

    def _planned(
        self, req: SynthRequest, language: str | None, instruct: str | None, prompt: VoicePrompt | None
    ) -> PreparedRequest:
        """Target frames (duration/speed applied) and, for a long text or one whose generation would not
        fit the token budget, its chunks, cut so that each fits where chunks of a few characters can."""
        text = req.text
        ref_text = prompt.ref_text if prompt else None
        ref_frames = prompt.tokens.shape[1] if prompt else None
        target = estimate_target_frames(text, ref_text, ref_frames, req.speed, req.duration, self.frame_rate)
        if target > MAX_OUTPUT_S * self.frame_rate:
            raise InputError(
                f"request (text {text[:40]!r}, speed={req.speed}, duration={req.duration}) asks for "
                f"{target / self.frame_rate:.0f} s of audio, over the {MAX_OUTPUT_S:.0f} s limit: "
                "use a shorter duration, a speed nearer 1, or split the text."
            )
        p = PreparedRequest(req, language, instruct, prompt, target, [Chunk(text, target, False)])
        is_long = needs_chunking(target, self.gen.audio_chunk_threshold, self.frame_rate)
        if self.gen.audio_chunk_duration > 0 and (is_long or not self._fits(p)):
            speed = effective_speed(text, ref_text, ref_frames, req.speed, req.duration, self.frame_rate)
            p.chunks = plan_chunks(
                text,
                target,
                ref_text,
                ref_frames,
                speed,
                self.gen.audio_chunk_duration,
                self.frame_rate,
                fits=lambda chunks: self._fits(replace(p, chunks=chunks)),
            )
        return p

    @property
    def token_budget(self) -> int:
        """Packed tokens one generation may take: max_batch_tokens, and the largest graph bucket."""
        return min(self.cfg.max_batch_tokens, max(self.cfg.buckets))

    def _fits(self, p: PreparedRequest) -> bool:
        # The budget comes from run settings (not part of a row's key); it only binds where a chunk of
        # about audio_chunk_duration would not fit, which the planner would otherwise reject.
        return all(text + ref + 2 * target <= self.token_budget for text, ref, target in self.chunk_sizes(p))

    def _clip_of(self, req: SynthRequest) -> tuple[str, str] | None:
        """(clip name, reference text as prompts store it) when the request clones a clip; checks that
        the voice fields go together."""
        if req.prompt is not None:
            if req.ref_audio is not None or req.ref_text is not None:
                raise InputError(
                    "a request gives both a voice prompt and ref_audio/ref_text: pass one of the two."
                )
            return None
        if req.ref_audio is None:
            if req.ref_text is not None:
                raise InputError(
                    f"ref_text {req.ref_text!r:.40} is given without ref_audio: add the reference clip, "
                    "or drop ref_text for voice design / auto voice."
                )
            return None
        name = clip_name(req.ref_audio)
        if not isinstance(req.ref_text, str) or not req.ref_text.strip():
            raise InputError(
                f"reference clip {name} has no transcript (ref_text={req.ref_text!r}): give the words spoken "
                "in the clip (automatic transcription is not part of this engine)."
            )
        return name, add_punctuation(req.ref_text) if self.gen.preprocess_prompt else req.ref_text

    def _voice_prompts(self, reqs: list[SynthRequest]) -> list[VoicePrompt | None]:
        prompts: list[VoicePrompt | None] = [None] * len(reqs)
        wanted: list[tuple[int, str, str]] = []  # (request index, clip name, reference text)
        for i, req in enumerate(reqs):
            clip = self._clip_of(req)
            if clip is not None:
                wanted.append((i, *clip))
            elif req.prompt is not None:
                prompts[i] = self._checked_prompt(req.prompt)
        if not wanted:
            return prompts

        def make_many(misses: list[tuple[int, bytes]]) -> list[VoicePrompt | AudioError]:
            clips = [(raw, wanted[j][1], wanted[j][2]) for j, raw in misses]
            return build_prompts(clips, self.codec, self.reference_settings)

        made = self.prompts.get_or_create_many(
            [reqs[i].ref_audio for i, _, _ in wanted], [text for _, _, text in wanted], make_many
        )
        for (i, name, _), prompt in zip(wanted, made):
            seconds = prompt.tokens.shape[1] / self.frame_rate
            if seconds > LONG_REFERENCE_S:
                log.warning("reference %s is %.1f s long: 3-10 s clones faster and better", name, seconds)
            prompts[i] = prompt
        return prompts

    def _checked_prompt(self, prompt: VoicePrompt) -> VoicePrompt:
        tokens = prompt.tokens
        codebooks, size = self.codec.num_codebooks, self.codec.codebook_size
        if (
            not isinstance(tokens, torch.Tensor)
            or tokens.dtype != torch.long
            or tokens.dim() != 2
            or tokens.shape[0] != codebooks
            or tokens.shape[1] == 0
            or int(tokens.min()) < 0
            or int(tokens.max()) >= size
        ):
            raise InputError(
                f"voice prompt tokens {getattr(tokens, 'dtype', type(tokens))} "
                f"{tuple(getattr(tokens, 'shape', ()))} are not int64 codes [{codebooks}, frames>0] in "
                f"0..{size - 1}: build the prompt with this engine's codec."
            )
        if not isinstance(prompt.ref_text, str) or not prompt.ref_text.strip():
            raise InputError(
                f"voice prompt has an empty ref_text ({prompt.ref_text!r:.40}): rebuild it with the clip's "
                "transcript."
            )
        return prompt

    # ---------------------------------------------------------------------------------- synthesize

    def synthesize(self, reqs: list[SynthRequest]) -> list[SynthResult]:
        if not reqs:
            return []
        start = time.perf_counter()
        prepared = self.prepare_many(reqs)
        t0 = time.perf_counter()
        tokens, work = self._generate(prepared)
        t1 = time.perf_counter()
        audio = self._decode([t for per_request in tokens for t in per_request])
        t2 = time.perf_counter()
        results = []
        decoded = iter(audio)
        for p, per_request, w in zip(prepared, tokens, work):
            pieces = [next(decoded) for _ in per_request]
            post_start = time.perf_counter()
            wav = cross_fade_chunks(pieces, self.sample_rate)
            wav = postprocess_output(wav, self.sample_rate, p.prompt.ref_rms if p.prompt else None, self.gen)
            timings = {
                "prepare": t0 - start,
                "generate": t1 - t0,
                "decode": t2 - t1,
                "postprocess": time.perf_counter() - post_start,
            }
            results.append(
                SynthResult(
                    audio=np.ascontiguousarray(wav, dtype=np.float32),
                    sample_rate=self.sample_rate,
                    target_frames=sum(c.target_frames for c in p.chunks),
                    token_work=w,
                    timings=timings,
                    tokens=torch.cat(per_request, dim=1).cpu().numpy(),
                )
            )
        return results

    def _chunk_reference(self, p: PreparedRequest, index: int) -> tuple[str | None, int]:
        """The transcript and frame count of what chunk `index` clones: the voice prompt, or (no clip)
        the first chunk's generated audio for the later chunks of a long text; (None, 0) for none."""
        chunk = p.chunks[index]
        if p.prompt is not None:
            return p.prompt.ref_text, int(p.prompt.tokens.shape[1])
        if chunk.first_chunk_is_ref:
            return p.chunks[0].text, p.chunks[0].target_frames
        return None, 0

    def _chunk_prompt_ids(self, p: PreparedRequest, index: int, ref_text: str | None) -> list[int]:
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
            ref_text, ref_frames = self._chunk_reference(p, index)
            sizes.append((len(self._chunk_prompt_ids(p, index, ref_text)), ref_frames, chunk.target_frames))
        return sizes

    def _gen_item(self, p: PreparedRequest, index: int, first_tokens: torch.Tensor | None) -> GenItem:
        ref_text, _ = self._chunk_reference(p, index)
        ref_tokens = None
        if ref_text is not None:
            ref_tokens = p.prompt.tokens if p.prompt is not None else first_tokens
        ids = self._chunk_prompt_ids(p, index, ref_text)
        return GenItem(ids, ref_tokens, p.chunks[index].target_frames, _chunk_seed(p.request.seed, index))

    def _generate(self, prepared: list[PreparedRequest]) -> tuple[list[list[torch.Tensor]], list[int]]:
        """Tokens of every chunk of every request, and each request's token work."""
        tokens: list[list[torch.Tensor]] = [[] for _ in prepared]
        work = [0] * len(prepared)
        for index in range(max(len(p.chunks) for p in prepared)):
            members = [i for i, p in enumerate(prepared) if index < len(p.chunks)]
            items = [self._gen_item(prepared[i], index, tokens[i][0] if tokens[i] else None) for i in members]
            out: list[torch.Tensor] = []
            for chunk in even_batches(items, packed_tokens, self.cfg.max_batch_tokens):
                out += self.runner.generate(chunk, self.gen)
            for i, item, t in zip(members, items, out):
                tokens[i].append(t)
                work[i] += Runner.packed_tokens(item) * self.gen.num_step
        return tokens, work

    def _decode(self, codes: list[torch.Tensor]) -> list[np.ndarray]:
        audio: list[np.ndarray] = []
        start = 0
        while start < len(codes):
            end, frames = start, 0
            while end < len(codes) and (end == start or frames + codes[end].shape[1] <= DECODE_BATCH_FRAMES):
                frames += codes[end].shape[1]
                end += 1
            audio += [a.cpu().numpy() for a in self.codec.decode(codes[start:end])]
            start = end
        return audio
