"""The high-level engine: synthesis requests in, float32 waveforms at the codec rate out, with timings.

One `synthesize` call prepares every request (validation, voice prompt from the cache), generates all
of them together through the Runner (a long text is cut into chunks; chunk k of every long request
runs in round k, and round 0 also carries every short request), decodes all token sequences in
batches, then post-processes each waveform as upstream does. `generate` stops before the post-processing,
which each of its results' `finish()` does (a caller may run it on another thread); on CUDA it also
leaves the decode queued on a stream of its own, which `finish()` waits for. A request's checks,
target length and chunks come from engine.frontend.requests, which a job's planner runs alone.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch.profiler import record_function

from engine.checkpoint import checkpoint_fingerprint, locate_checkpoint, read_config
from engine.codec import Codec
from engine.config import EngineConfig, GenerationConfig
from engine.devices import DTYPES, resolve_device
from engine.errors import AudioError, CheckpointError, InputError
from engine.frontend.audio import (
    PreparedReference,
    cross_fade_chunks,
    postprocess_output,
    prepare_reference,
    read_clip_bytes,
    too_long,
)
from engine.frontend.prompt import PromptCache, VoicePrompt, build_prompts
from engine.frontend.requests import CodecShape, PreparedRequest, RequestFrontend, SynthRequest
from engine.frontend.text import TextFrontend
from engine.generate.batching import even_batches
from engine.generate.loop import HostBatch, Runner
from engine.generate.packing import GenItem, packed_tokens
from engine.kernels.fused import fused_ops
from engine.loading import LoadTimer, load_model

log = logging.getLogger(__name__)

# Padded frames decoded per codec call (16 clips of 30 s at 25 frames/s): bounds the decoder's memory.
DECODE_BATCH_FRAMES = 12_000
# A decode call's fixed cost in frames of decoding (H200, codec-h200.json: ~2.6 ms a call against ~16 us a
# padded frame at batch 16): a clip joins a call padded to a longer one only if it wastes fewer frames.
DECODE_CALL_FRAMES = 160
# Upstream warns that references over 20 s slow generation down and clone worse.
LONG_REFERENCE_S = 20.0
# Clips preload() keeps prepared at most (a batch's worth is taken by its generate()).
PRELOADED_CLIPS = 512
# Clips preload() prepares at once: reading, resampling and trimming release the GIL, so threads overlap.
PRELOAD_THREADS = min(4, os.cpu_count() or 1)
# Batches prepare_ahead keeps: the job prepares up to four before they generate (two of the shard on the
# device, two of the next one: pipeline.shard_runner); the bound drops the ones never asked for (a batch
# that failed is retried in halves, which are other request lists).
PREPARED_AHEAD = 6


@dataclass
class SynthResult:
    audio: np.ndarray  # float32, mono, at sample_rate
    sample_rate: int
    target_frames: int
    token_work: int  # packed tokens x decoding steps spent on this request
    # prepare, generate and decode: seconds of the whole synthesize call (prepare_ahead instead of
    # prepare's where the batch was prepared beside the one before); postprocess: this request's.
    timings: dict[str, float] = field(default_factory=dict)
    # The generated audio codes [codebooks, frames], a long text's chunks joined in order (A/B reports
    # compare them between variants).
    tokens: np.ndarray | None = None


@dataclass
class Generated:
    """A request generated and decoded, before post-processing (host work only: finish() may run on any
    thread while the device goes on with the next batch)."""

    pieces: list[np.ndarray]  # decoded audio of each text chunk
    tokens: np.ndarray  # [codebooks, frames], the chunks joined
    target_frames: int
    token_work: int
    ref_rms: float | None
    sample_rate: int
    gen: GenerationConfig
    timings: dict[str, float]
    decoding: QueuedDecode | None = None  # on CUDA: pieces and tokens hold their values once it is done

    def finish(self) -> SynthResult:
        if self.decoding is not None:
            self.timings.update(self.decoding.wait())
        start = time.perf_counter()
        wav = cross_fade_chunks(self.pieces, self.sample_rate)
        wav = postprocess_output(wav, self.sample_rate, self.ref_rms, self.gen)
        return SynthResult(
            audio=np.ascontiguousarray(wav, dtype=np.float32),
            sample_rate=self.sample_rate,
            target_frames=self.target_frames,
            token_work=self.token_work,
            timings={**self.timings, "postprocess": time.perf_counter() - start},
            tokens=self.tokens,
        )


class QueuedDecode:
    """A batch's decode and its copies to pinned host memory, queued on the engine's decode stream after
    its generation: wait() blocks until they are done and gives the generation's and the decode's device
    seconds (the decode's from the generation's end, so they include waiting for the decode stream), and
    with the generation before it on the same stream (before: its end), "generation_idle": how long the
    generation stream sat idle from that end to this batch's start."""

    def __init__(
        self,
        began: torch.cuda.Event,
        generated: torch.cuda.Event,
        decoded: torch.cuda.Event,
        before: torch.cuda.Event | None = None,
    ):
        self.began, self.generated, self.decoded, self.before = began, generated, decoded, before

    def wait(self) -> dict[str, float]:
        self.decoded.synchronize()
        seconds = {
            "generate": self.began.elapsed_time(self.generated) / 1e3,
            "decode": self.generated.elapsed_time(self.decoded) / 1e3,
        }
        if self.before is not None:
            seconds["generation_idle"] = self.before.elapsed_time(self.began) / 1e3
        return seconds


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


def _decode_groups(codes: list[torch.Tensor]) -> Iterator[list[int]]:
    """The codec calls for these code sequences (their indices). A call pads its clips to its longest, so
    calls take the clips longest first, a call's clips within DECODE_CALL_FRAMES of its longest and within
    DECODE_BATCH_FRAMES padded."""
    order = sorted(range(len(codes)), key=lambda i: -codes[i].shape[1])
    while order:
        longest = codes[order[0]].shape[1]
        size = 1
        while (
            size < len(order)
            and (size + 1) * longest <= DECODE_BATCH_FRAMES
            and longest - codes[order[size]].shape[1] <= DECODE_CALL_FRAMES
        ):
            size += 1
        group, order = order[:size], order[size:]
        yield group


def _to_pinned(t: torch.Tensor) -> np.ndarray:
    """A copy of a device tensor into pinned host memory, queued on the current stream (the array holds the
    values once the stream has run it)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host.numpy()


def _traced_call(name: str, fn: Callable[[], None]) -> None:
    """fn() inside a profiler range `name` (bench/profile_job.py reads them, per thread)."""
    with record_function(name):
        fn()


def _chunk_seed(seed: int, index: int) -> int:
    """Seed of chunk `index` of a request: chunk 0 uses the request's seed (so a text's first chunk and
    an unchunked text draw alike), later chunks a fixed derivation of it."""
    return seed if index == 0 else (seed * 1_000_003 + index * 0x9E3779B97F4A7C15) % (1 << 63)


def _round_members(prepared: list[PreparedRequest], index: int) -> list[int]:
    """The requests that chunk round `index` generates: those with more than `index` chunks."""
    return [i for i, p in enumerate(prepared) if index < len(p.chunks)]


@dataclass
class _Ahead:
    """A batch's requests prepared, and where prepare_ahead made them, its first chunk round's runner calls
    packed on the host."""

    requests: list[PreparedRequest]
    first_calls: list[HostBatch] = field(default_factory=list)


class Engine:
    def __init__(self, cfg: EngineConfig):
        start = time.perf_counter()
        self.cfg = cfg
        self.gen = cfg.generation
        ckpt_dir, name = locate_checkpoint(cfg.checkpoint)
        self.checkpoint_dir = ckpt_dir
        self.device = resolve_device(cfg.device)
        timer = LoadTimer(self.device)
        if self.device.type == "cuda":
            with timer.phase("cuda_init"):  # runtime and context, else paid by the first weight copied
                torch.zeros(1, device=self.device)
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
            timer=timer,
        )
        self.model_id = f"{name}@{checkpoint_fingerprint(ckpt_dir)[:12]}"
        self.text = TextFrontend(ckpt_dir / "tokenizer.json")
        with timer.phase("codec"):
            fused = self.device.type == "cuda" and cfg.fast_paths.fused_kernels
            self.codec = Codec.from_dir(ckpt_dir / "audio_tokenizer", device=self.device, fused=fused)
        if self.codec.num_codebooks != self.model_config.num_audio_codebook:
            raise CheckpointError(
                f"{ckpt_dir}: the codec has {self.codec.num_codebooks} codebooks, the model "
                f"{self.model_config.num_audio_codebook}; audio_tokenizer/ must come with this model."
            )
        self.sample_rate = self.codec.sample_rate
        self.frame_rate = self.codec.frame_rate
        self.requests = RequestFrontend(
            cfg, self.text, CodecShape(self.codec.sample_rate, self.codec.hop_length)
        )
        self.reference_settings = self.requests.reference_settings
        self.prompts = PromptCache(
            cfg.prompt_cache_dir,
            self.codec.identity,
            self.reference_settings.fingerprint(self.codec.sample_rate, self.codec.hop_length),
        )
        if self.device.type == "cuda" and cfg.fast_paths.fused_kernels:
            with timer.phase("extension"):  # loaded here rather than by the first forward (graph capture)
                fused_ops(torch.empty(0, device=self.device, dtype=self.dtype))
        with timer.phase("runner"):  # on CUDA it picks the attention backend (imports flash-attn)
            self.runner = Runner(self.model, cfg, self.device, self.dtype)
        self._references: dict[str, PreparedReference | AudioError] = {}  # preload(): cache key -> ready
        # preload(): (clip, reference text) -> cache key, so that preparing its batch reads and hashes the
        # clip no second time (and keys the prompt by the bytes it was prepared from)
        self._clip_keys: dict[tuple[object, str], str] = {}
        self._clip_readers = ThreadPoolExecutor(PRELOAD_THREADS, thread_name_prefix="ovbatch-clip")
        self._beside = ThreadPoolExecutor(1, thread_name_prefix="ovbatch-then")  # generate's `then`
        # prepare_ahead(): the request objects' ids -> (those requests, their preparation and first runner
        # calls packed on the host, its seconds)
        self._ahead: dict[tuple[int, ...], tuple[list[SynthRequest], _Ahead, float]] = {}
        # _references and _clip_keys change on the preload threads and the preparing and generating ones;
        # _ahead on the preparing ones and each shard's thread.
        self._lock = threading.Lock()
        # CUDA: where a batch's decode runs, beside the next batch's generation
        self._decode_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._generated: torch.cuda.Event | None = None  # CUDA: the last batch's generation end
        # CUDA: each preparing thread's stream for encoding reference clips (_encode_stream), and the load's
        # end, which those streams start after
        self._encode_streams = threading.local()
        self._loaded = self._device_mark()
        total = time.perf_counter() - start
        # Seconds of this load by phase; "other": the rest (config, fingerprint, tokenizer, frontends).
        self.load_timings = {phase: round(t, 3) for phase, t in timer.seconds.items()}
        self.load_timings["other"] = round(total - sum(timer.seconds.values()), 3)
        log.info(
            "engine ready: %s, %s on %s, loaded in %.2f s (%s)",
            self.model_id,
            self.precision,
            self.device,
            total,
            ", ".join(f"{phase} {t:.2f}" for phase, t in self.load_timings.items()),
        )

    # ------------------------------------------------------------------------------------- prepare

    def prepare(self, req: SynthRequest) -> PreparedRequest:
        """Validate a request and build its voice prompt (through the cache)."""
        return self.prepare_many([req])[0]

    def prepare_many(self, reqs: list[SynthRequest]) -> list[PreparedRequest]:
        """prepare() for many requests; the reference clips missing from the cache are encoded together."""
        styles = [self.requests.checked_style(r) for r in reqs]
        prompts = self._voice_prompts(reqs)
        prepared = []
        for req, (language, instruct), prompt in zip(reqs, styles, prompts):
            ref_text, ref_frames = (prompt.ref_text, int(prompt.tokens.shape[1])) if prompt else (None, 0)
            p = self.requests.planned(req, language, instruct, ref_text, ref_frames)
            prepared.append(replace(p, prompt=prompt))
        return prepared

    def _voice_prompts(self, reqs: list[SynthRequest]) -> list[VoicePrompt | None]:
        prompts: list[VoicePrompt | None] = [None] * len(reqs)
        wanted: list[tuple[int, str, str]] = []  # (request index, clip name, reference text)
        for i, req in enumerate(reqs):
            clip = self.requests.clip_of(req)
            if clip is not None:
                wanted.append((i, *clip))
            elif req.prompt is not None:
                prompts[i] = self._checked_prompt(req.prompt)
        if not wanted:
            return prompts

        def make_many(misses: list[tuple[int, bytes | None, str]]) -> list[VoicePrompt | AudioError]:
            with self._lock:  # what preload() prepared
                ready = [self._references.pop(key, None) for _, _, key in misses]
            clips = []
            for m, (j, raw, _) in enumerate(misses):
                if raw is None and ready[m] is None:  # keyed by preload(), its preparation since dropped
                    try:
                        raw = read_clip_bytes(sources[j])
                    except AudioError as e:
                        ready[m] = e
                clips.append((raw, wanted[j][1], wanted[j][2]))
            # Every tensor of the encode lives and dies on its stream (None: no-op): nothing to record.
            with torch.cuda.stream(self._encode_stream()):
                return build_prompts(clips, self.codec, self.reference_settings, ready)

        sources = [reqs[i].ref_audio for i, _, _ in wanted]
        seen = [(source, text) for source, (_, _, text) in zip(sources, wanted)]
        with self._lock:
            keys = [self._clip_keys.get(clip) for clip in seen]
        try:
            made = self.prompts.get_or_create_many(sources, [text for _, _, text in wanted], make_many, keys)
        finally:  # used once, or never if the batch failed: a later batch reads its clips again
            with self._lock:
                for clip in seen:
                    self._clip_keys.pop(clip, None)
        limit = self.reference_settings.max_seconds  # a prompt cached under a higher limit meets this one
        for (i, name, _), prompt in zip(wanted, made):
            if prompt.source_seconds is not None and prompt.source_seconds > limit:
                raise too_long(name, prompt.source_seconds, limit)
            seconds = prompt.tokens.shape[1] / self.frame_rate
            if seconds > LONG_REFERENCE_S:
                log.warning("reference %s is %.1f s long: 3-10 s clones faster and better", name, seconds)
            prompts[i] = prompt
        return prompts

    def warm(self, clips: Sequence[tuple[str, str]], ahead: Sequence[tuple[str, str]] = ()) -> None:
        """Make the voice prompts of these (reference clip, transcript) pairs now, through the prompt cache,
        as the batches that use them would (a job does this while it plans, the device idle meanwhile), so
        that those batches find them. Clips that cannot be used are left to their rows to report. ahead:
        the pairs of the call to come, whose clips are read and prepared on the host meanwhile (as
        preload() does), beside this call's encode."""
        usable = self._warm_requests(clips)
        self.preload(usable)  # ready where the call before had them ahead
        reading = [self._clip_readers.submit(self._preload_one, req) for req in self._warm_requests(ahead)]
        try:
            if usable:
                self._voice_prompts(usable)
        except (AudioError, InputError) as e:  # the usable clips' prompts are cached before it is raised
            log.debug("warming the prompt cache left a clip to its rows: %s", e)
        finally:
            wait(reading)

    def _warm_requests(self, clips: Sequence[tuple[str, str]]) -> list[SynthRequest]:
        """Requests that clone these (clip, transcript) pairs, those whose voice fields go together."""
        usable = []
        for clip, text in clips:
            req = SynthRequest(text=text, ref_audio=clip, ref_text=text)
            try:
                self.requests.clip_of(req)
            except InputError:
                continue
            usable.append(req)
        return usable

    def flush(self) -> None:
        """Until the voice prompts made so far are written to the prompt cache on disk (its writer thread
        writes them behind the batches that made them)."""
        self.prompts.flush()

    def preload(self, reqs: list[SynthRequest]) -> None:
        """Prepare on the host (decode, resample, trim) the reference clips of requests about to be
        generated that the prompt cache lacks, so that their generate() only encodes them; PRELOAD_THREADS
        clips at a time. Safe on another thread while this engine generates (no device work); a request
        it cannot read is left for generate() to report."""
        distinct = {(req.ref_audio, req.ref_text): req for req in reqs if req.ref_audio is not None}
        list(self._clip_readers.map(self._preload_one, distinct.values()))

    def _preload_one(self, req: SynthRequest) -> None:
        try:
            clip = self.requests.clip_of(req)
            if clip is None:
                return
            raw = read_clip_bytes(req.ref_audio)
        except (AudioError, InputError):  # generate() reports it
            return
        key = self.prompts.key(raw, clip[1])
        with self._lock:
            self._clip_keys[(req.ref_audio, clip[1])] = key
            while len(self._clip_keys) > PRELOADED_CLIPS:  # keys a failed batch never used
                self._clip_keys.pop(next(iter(self._clip_keys)))
            if key in self._references:
                return
        if self.prompts.has(key):
            return
        try:
            rate, hop = self.codec.sample_rate, self.codec.hop_length
            ref = prepare_reference(clip[0], rate, hop, self.reference_settings, raw=raw)
        except AudioError as e:
            ref = e
        except InputError:
            return
        with self._lock:
            self._references[key] = ref
            while len(self._references) > PRELOADED_CLIPS:  # entries a failed batch never used
                self._references.pop(next(iter(self._references)))

    def _encode_stream(self) -> torch.cuda.Stream | None:
        """CUDA: this thread's stream for encoding reference clips (None elsewhere). Waiting for the codes
        (the prompt cache keeps them on the host) never waits for the generation queued before them, nor
        for another thread's encode, so that two batches prepared at once encode side by side; at a higher
        priority than the generation's, so that a preparation the device will wait for is not held behind
        the steps (no gain from the priority has been measured)."""
        if self.device.type != "cuda":
            return None
        stream = getattr(self._encode_streams, "stream", None)
        if stream is None:
            stream = self._encode_streams.stream = torch.cuda.Stream(self.device, priority=-1)
            stream.wait_event(self._loaded)
        return stream

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
        return [g.finish() for g in self.generate(reqs)]

    def capture(self, batches: list[list[tuple[int, int]]]) -> int:
        """Capture the CUDA graphs that batches of these shapes will replay ((packed tokens, target frames)
        per request, as a plan sizes them); returns how many were new (0 where graphs are off)."""
        return self.runner.capture([[(packed - target, target) for packed, target in b] for b in batches])

    def prepare_ahead(self, reqs: list[SynthRequest]) -> None:
        """prepare_many(reqs) now, and the batch's first runner calls packed on the host, for the generate()
        call that comes with these same request objects: a caller runs it while the device generates other
        batches (the job: on its preparing threads), so that this batch's host work overlaps the device's; it
        may run on several threads at once, for different batches. The last PREPARED_AHEAD batches prepared
        are kept. What fails here is left for that generate() to raise."""
        start = time.perf_counter()
        try:
            prepared = self.prepare_many(reqs)
            ahead = _Ahead(prepared, self._runner_calls(prepared, 0, [[] for _ in prepared]))
        except Exception as e:  # noqa: BLE001 - generate() prepares again and reports it with its batch
            log.debug("prepare_ahead left %d requests to generate(): %s", len(reqs), e)
            return
        with self._lock:
            self._ahead[tuple(map(id, reqs))] = (reqs, ahead, time.perf_counter() - start)
            while len(self._ahead) > PREPARED_AHEAD:
                self._ahead.pop(next(iter(self._ahead)))

    def _prepared(self, reqs: list[SynthRequest]) -> tuple[_Ahead, dict[str, float]]:
        """The requests prepared, and its seconds: "prepare", prepared here, or "prepare_ahead", by
        prepare_ahead beside an earlier batch (when it had these very objects; its first runner calls
        packed too)."""
        with self._lock:  # an entry holds its requests, so their ids are not reused while it is kept
            entry = self._ahead.pop(tuple(map(id, reqs)), None)
        if entry is not None:
            return entry[1], {"prepare": 0.0, "prepare_ahead": entry[2]}
        start = time.perf_counter()
        ahead = _Ahead(self.prepare_many(reqs))
        return ahead, {"prepare": time.perf_counter() - start}

    def generate(self, reqs: list[SynthRequest], then: Callable[[], None] | None = None) -> list[Generated]:
        """synthesize() up to the decoded audio; each Generated's finish() does the rest on the host.
        then: the host's work for the next batch (e.g. its prepare_ahead), run on the engine's own thread
        beside this batch's steps once the batch is set up (its graph captured); this returns once it is done.
        Its seconds count in no phase here.

        On CUDA the decode runs on its own stream once the generation is done, and its audio comes back
        to pinned host memory: this returns without waiting for either, so the caller can queue the next
        batch's generation while this one decodes; finish() waits for the audio."""
        if not reqs:
            return []
        with record_function("ovbatch.prepare"):
            ahead, timings = self._prepared(reqs)
        prepared = ahead.requests
        t0 = time.perf_counter()
        began = self._device_mark()
        beside: list[Future] = []  # `then`, once started

        def start_then() -> None:
            beside.append(self._beside.submit(_traced_call, "ovbatch.then", then))

        try:
            with record_function("ovbatch.generate"):
                tokens, work = self._generate_tokens(ahead, start_then if then is not None else None)
            per_request = [torch.cat(chunks, dim=1) for chunks in tokens]
            flat = [t for chunks in tokens for t in chunks]
            if self.device.type == "cuda":
                with record_function("ovbatch.decode"):
                    audio, joined, decoding = self._decode_queued(flat, per_request, began)
            else:
                t1 = time.perf_counter()
                with record_function("ovbatch.decode"):
                    audio = self._decode(flat)
                joined = [t.numpy() for t in per_request]
                decoding = None
                timings.update(generate=t1 - t0, decode=time.perf_counter() - t1)
        except BaseException:
            wait(beside)  # a batch that fails, in its steps or its decode, leaves no `then` running
            raise
        if beside:
            with record_function("ovbatch.wait_then"):
                beside[0].result()
        decoded = iter(audio)
        return [
            Generated(
                pieces=[next(decoded) for _ in chunks],
                tokens=joined_tokens,
                target_frames=sum(c.target_frames for c in p.chunks),
                token_work=w,
                ref_rms=p.prompt.ref_rms if p.prompt else None,
                sample_rate=self.sample_rate,
                gen=self.gen,
                timings=dict(timings),
                decoding=decoding,
            )
            for p, chunks, joined_tokens, w in zip(prepared, tokens, joined, work)
        ]

    def _device_mark(self) -> torch.cuda.Event | None:
        """A timing event recorded on the device's current stream (None off CUDA)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _gen_item(self, p: PreparedRequest, index: int, first_tokens: torch.Tensor | None) -> GenItem:
        ref_text, _ = self.requests.chunk_reference(p, index)
        ref_tokens = None
        if ref_text is not None:
            ref_tokens = p.prompt.tokens if p.prompt is not None else first_tokens
        ids = self.requests.chunk_prompt_ids(p, index, ref_text)
        return GenItem(ids, ref_tokens, p.chunks[index].target_frames, _chunk_seed(p.request.seed, index))

    def _generate_tokens(
        self, ahead: _Ahead, on_last_start: Callable[[], None] | None = None
    ) -> tuple[list[list[torch.Tensor]], list[int]]:
        """Tokens of every chunk of every request, and each request's token work. on_last_start: called
        when the last runner call's batch is set up (no graph capture follows it)."""
        prepared = ahead.requests
        tokens: list[list[torch.Tensor]] = [[] for _ in prepared]
        work = [0] * len(prepared)
        rounds = max(len(p.chunks) for p in prepared)
        for index in range(rounds):
            members = _round_members(prepared, index)
            if index == 0 and ahead.first_calls:
                calls = ahead.first_calls
            else:
                calls = self._runner_calls(prepared, index, tokens)
            out: list[torch.Tensor] = []
            for b, host in enumerate(calls):
                last = index == rounds - 1 and b == len(calls) - 1
                out += self.runner.generate_packed(host, self.gen, on_start=on_last_start if last else None)
            items = [item for host in calls for item in host.items]
            for i, item, t in zip(members, items, out, strict=True):
                tokens[i].append(t)
                work[i] += Runner.packed_tokens(item) * self.gen.num_step
        return tokens, work

    def _runner_calls(
        self, prepared: list[PreparedRequest], index: int, tokens: list[list[torch.Tensor]]
    ) -> list[HostBatch]:
        """The runner calls of chunk round `index` (the requests with that many chunks; a later round's
        items may take a request's first-chunk tokens as its reference): cut into batches, packed on the
        host."""
        items = [
            self._gen_item(prepared[i], index, tokens[i][0] if tokens[i] else None)
            for i in _round_members(prepared, index)
        ]
        batches = even_batches(items, packed_tokens, self.cfg.token_budget)
        return [self.runner.pack(batch) for batch in batches]

    def _decode(self, codes: list[torch.Tensor]) -> list[np.ndarray]:
        """The audio of each code sequence, on this thread's stream, waited for."""
        audio: list[np.ndarray | None] = [None] * len(codes)
        for group in _decode_groups(codes):
            for i, wav in zip(group, self.codec.decode([codes[i] for i in group])):
                audio[i] = wav.cpu().numpy()
        return audio

    def _decode_queued(
        self, codes: list[torch.Tensor], per_request: list[torch.Tensor], began: torch.cuda.Event
    ) -> tuple[list[np.ndarray], list[np.ndarray], QueuedDecode]:
        """CUDA: the audio of each code sequence and each request's joined tokens, decoded and copied on
        the decode stream once the generation queued so far is done; the arrays (pinned host memory)
        hold them once the QueuedDecode is done. The codes come from the sampler, so the codec's range
        check (a host sync) is skipped."""
        generated = self._device_mark()
        before, self._generated = self._generated, generated
        stream = self._decode_stream
        stream.wait_event(generated)
        audio: list[np.ndarray | None] = [None] * len(codes)
        with torch.cuda.stream(stream):
            for t in (*codes, *per_request):  # made on the generation stream, read on this one
                t.record_stream(stream)
            for group in _decode_groups(codes):
                for i, wav in zip(group, self.codec.decode([codes[i] for i in group], trusted=True)):
                    audio[i] = _to_pinned(wav)
            joined = [_to_pinned(t) for t in per_request]
            decoded = self._device_mark()
        return audio, joined, QueuedDecode(began, generated, decoded, before)
