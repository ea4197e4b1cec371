import json
import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from engine.api import Engine, SynthRequest
from engine.config import EngineConfig, GenerationConfig
from engine.errors import AudioError, CheckpointError, InputError
from engine.frontend.audio import fade_and_pad
from engine.frontend.duration import estimate_target_frames
from engine.frontend.prompt import VoicePrompt

DATA = Path(__file__).parent / "data"
CLIPS = json.loads((DATA / "clips.json").read_text())
CLIP = DATA / "en_24k_mono.wav"
TRANSCRIPT = CLIPS["en_24k_mono.wav"]["transcript"]
# Few steps and no silence removal keep the tiny model fast and the output length predictable.
FAST = GenerationConfig(num_step=2, postprocess_output=False)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return Engine(EngineConfig(prompt_cache_dir=str(tmp_path_factory.mktemp("prompts")), generation=FAST))


def _pad(engine):
    return 2 * int(engine.gen.pad_duration * engine.sample_rate)


def _count_encodes(engine, monkeypatch):
    calls = []
    original = engine.codec.encode

    def counting(wavs, device=None):
        calls.append(len(wavs))
        return original(wavs, device)

    monkeypatch.setattr(engine.codec, "encode", counting)
    return calls


def test_engine_identity(engine):
    assert engine.precision == "fp32" and engine.device == torch.device("cpu")
    assert engine.model_id.startswith("tiny@") and len(engine.model_id) == len("tiny@") + 12
    assert engine.sample_rate == engine.codec.sample_rate == 24000


def test_the_engine_says_where_its_load_went(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="engine.api"):
        engine = Engine(EngineConfig(prompt_cache_dir=str(tmp_path), generation=FAST))
    timings = engine.load_timings  # on CPU: no CUDA context, extension or fp8 conversion
    assert list(timings) == ["weights", "merge", "codec", "runner", "other"]
    assert all(t >= 0 for t in timings.values())
    (ready,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready")]
    assert f"weights {timings['weights']:.2f}, merge" in ready and f"codec {timings['codec']:.2f}" in ready


def test_clone_on_a_real_clip_returns_float32_audio_of_the_target_length(engine):
    (out,) = engine.synthesize(
        [SynthRequest(text="Hello there, nice to meet you.", ref_audio=CLIP, ref_text=TRANSCRIPT)]
    )
    prepared = engine.prepare(
        SynthRequest(text="Hello there, nice to meet you.", ref_audio=CLIP, ref_text=TRANSCRIPT)
    )
    expected = estimate_target_frames(
        "Hello there, nice to meet you.", prepared.prompt.ref_text, prepared.prompt.tokens.shape[1]
    )
    assert out.target_frames == expected
    assert out.audio.dtype == np.float32 and out.audio.ndim == 1 and out.sample_rate == 24000
    assert len(out.audio) == expected * engine.codec.hop_length + _pad(engine)
    assert np.isfinite(out.audio).all() and np.abs(out.audio).max() > 0
    assert set(out.timings) == {"prepare", "generate", "decode", "postprocess"}
    assert all(v >= 0 for v in out.timings.values())
    items_tokens = engine.runner.packed_tokens(engine._gen_item(prepared, 0, None))
    assert out.token_work == items_tokens * FAST.num_step


def test_reference_text_gets_final_punctuation(engine):
    prompt = engine.prepare(SynthRequest(text="Hi.", ref_audio=CLIP, ref_text=TRANSCRIPT.rstrip("."))).prompt
    assert prompt.ref_text == TRANSCRIPT


def test_same_clip_is_encoded_once(engine, monkeypatch, tmp_path):
    calls = _count_encodes(engine, monkeypatch)
    audio, rate = sf.read(DATA / "en_16k_mono.wav", dtype="float32")
    clip = tmp_path / "fresh.flac"  # content no other test has cached
    sf.write(clip, audio * 0.9, rate)
    text = CLIPS["en_16k_mono.wav"]["transcript"]
    first = engine.prepare(SynthRequest(text="One.", ref_audio=clip, ref_text=text))
    second = engine.prepare(SynthRequest(text="Two.", ref_audio=clip.read_bytes(), ref_text=text))
    assert len(calls) == 1
    assert torch.equal(first.prompt.tokens, second.prompt.tokens)
    assert (
        first.prompt.tokens.shape[0] == engine.codec.num_codebooks and first.prompt.tokens.dtype == torch.long
    )
    assert 0.03 < first.prompt.ref_rms < 0.1 and first.prompt.ref_text == text


def test_a_cached_prompt_is_held_to_a_lower_max_ref_seconds(tmp_path):
    """A clip cached under the default 60 s limit is refused by an engine whose limit it exceeds, as a clip
    not yet cached would be."""
    cache = str(tmp_path / "prompts")
    clip = DATA / "en_16k_mono.wav"
    seconds = sf.info(clip).duration
    req = SynthRequest(text="One.", ref_audio=clip, ref_text=CLIPS["en_16k_mono.wav"]["transcript"])
    Engine(EngineConfig(prompt_cache_dir=cache, generation=FAST)).prepare(req)
    strict = Engine(EngineConfig(prompt_cache_dir=cache, generation=FAST, max_ref_seconds=seconds / 2))
    with pytest.raises(
        AudioError, match=rf"en_16k_mono\.wav is {seconds:.1f} s long, over the {seconds / 2:g} s"
    ):
        strict.prepare(req)


def test_new_clips_of_one_call_are_encoded_together(engine, monkeypatch, tmp_path):
    calls = _count_encodes(engine, monkeypatch)
    audio, rate = sf.read(DATA / "en_8k_mono.wav", dtype="float32")
    text = CLIPS["en_8k_mono.wav"]["transcript"]
    paths = [tmp_path / "a.wav", tmp_path / "b.ogg"]
    for path, gain in zip(paths, (0.8, 0.7)):
        sf.write(path, audio * gain, rate)
    reqs = [SynthRequest(text="Hi.", ref_audio=p, ref_text=text) for p in (*paths, paths[0])]
    prepared = engine.prepare_many(reqs)
    assert calls == [2]
    assert prepared[0].prompt is prepared[2].prompt
    bad = SynthRequest(text="Hi.", ref_audio=tmp_path / "missing.wav", ref_text=text)
    with pytest.raises(AudioError, match="missing.wav does not exist"):
        engine.prepare_many([bad, *reqs])
    assert calls == [2]


def test_voice_design_and_auto_modes(engine):
    design = SynthRequest(text="A calm voice speaking.", instruct="female, low pitch", seed=3)
    auto = SynthRequest(text="A calm voice speaking.", seed=3)
    out_design, out_auto = engine.synthesize([design, auto])
    for out in (out_design, out_auto):
        assert len(out.audio) == out.target_frames * engine.codec.hop_length + _pad(engine)
        # no reference: peak-normalised to 0.5 before the fades, which we divide out again
        ramp = fade_and_pad(np.ones(len(out.audio) - _pad(engine), np.float32), 24000, 0.1, 0.1)
        assert np.abs(out.audio[ramp > 0] / ramp[ramp > 0]).max() == pytest.approx(0.5, abs=1e-5)
    ids_design = engine._gen_item(engine.prepare(design), 0, None).prompt_ids
    ids_auto = engine._gen_item(engine.prepare(auto), 0, None).prompt_ids
    assert ids_design != ids_auto


def test_batch_results_do_not_depend_on_neighbours(engine):
    a = SynthRequest(text="The first sentence.", ref_audio=CLIP, ref_text=TRANSCRIPT, seed=1)
    b = SynthRequest(text="Another, rather longer sentence here.", instruct="male", seed=2)
    together = engine.synthesize([a, b])[1]
    (alone,) = engine.synthesize([b])
    assert together.target_frames == alone.target_frames and together.token_work == alone.token_work
    np.testing.assert_allclose(together.audio, alone.audio, atol=1e-4)


def test_a_numpy_integer_seed_is_the_same_seed(engine):
    plain, numpy_seed = (SynthRequest(text="Seeded.", instruct="male", seed=s) for s in (5, np.int64(5)))
    np.testing.assert_array_equal(
        engine.synthesize([plain])[0].tokens, engine.synthesize([numpy_seed])[0].tokens
    )


def test_voice_prompt_request_equals_clip_request(engine, tmp_path):
    by_clip = SynthRequest(text="Same voice.", ref_audio=CLIP, ref_text=TRANSCRIPT, seed=5)
    prompt = engine.prepare(by_clip).prompt
    prompt.save(tmp_path / "voice")
    by_prompt = SynthRequest(text="Same voice.", prompt=VoicePrompt.load(tmp_path / "voice"), seed=5)
    out_clip, out_prompt = engine.synthesize([by_clip, by_prompt])
    np.testing.assert_allclose(out_clip.audio, out_prompt.audio, atol=1e-4)


def test_duration_and_speed(engine):
    fixed = engine.prepare(SynthRequest(text="Timed text.", duration=1.2))
    assert fixed.target_frames == 30
    normal = engine.prepare(
        SynthRequest(text="A sentence of some length, spoken.", ref_audio=CLIP, ref_text=TRANSCRIPT)
    )
    fast = engine.prepare(
        SynthRequest(
            text="A sentence of some length, spoken.", ref_audio=CLIP, ref_text=TRANSCRIPT, speed=2.0
        )
    )
    assert fast.target_frames < normal.target_frames


@pytest.fixture(scope="module")
def chunking_engine():
    gen = replace(FAST, audio_chunk_threshold=2.0, audio_chunk_duration=1.0)
    return Engine(EngineConfig(generation=gen))


@pytest.mark.parametrize("with_clip", [True, False])
def test_long_text_is_chunked_and_cross_faded(chunking_engine, with_clip):
    engine, gen = chunking_engine, chunking_engine.gen
    text = "First part of it. Then a second part, with a comma. And a third sentence to end."
    ref = {"ref_audio": CLIP, "ref_text": TRANSCRIPT} if with_clip else {}
    req = SynthRequest(text=text, seed=7, **ref)
    prepared = engine.prepare(req)
    assert len(prepared.chunks) >= 3
    assert "".join(c.text for c in prepared.chunks).replace(" ", "") == text.replace(" ", "")
    (out,) = engine.synthesize([req])
    hop, fade = engine.codec.hop_length, int(0.3 * engine.sample_rate) // 3
    frames = [c.target_frames for c in prepared.chunks]
    assert out.target_frames == sum(frames)
    assert len(out.audio) == sum(frames) * hop + (len(frames) - 1) * fade + _pad(engine)
    # each chunk is one generation: the work adds up chunk by chunk (a first chunk's tokens only
    # matter here by their shape)
    first = torch.zeros(engine.codec.num_codebooks, frames[0], dtype=torch.long)
    work = sum(
        engine.runner.packed_tokens(engine._gen_item(prepared, i, first)) * gen.num_step
        for i in range(len(prepared.chunks))
    )
    assert out.token_work == work
    later = engine._gen_item(prepared, 1, first)
    if with_clip:
        assert torch.equal(later.ref_tokens, prepared.prompt.tokens)
    else:  # later chunks clone the first chunk: its text and tokens are their reference
        assert later.ref_tokens is first
        assert later.prompt_ids == engine.text.prompt_ids(
            prepared.chunks[1].text, prepared.chunks[0].text, None, None, gen.denoise, has_ref=True
        )


# ---------------------------------------------------------------- bad requests


@pytest.mark.parametrize(
    ("request_kwargs", "error", "match"),
    [
        ({"text": ""}, InputError, "empty or whitespace"),
        ({"text": " \n\t"}, InputError, "empty or whitespace"),
        ({"text": "x" * 5001}, InputError, "over the 5000-character limit.*engine.max_text_chars=5001"),
        ({"text": "Hi.", "ref_audio": str(CLIP)}, InputError, "has no transcript"),
        ({"text": "Hi.", "ref_audio": str(CLIP), "ref_text": "  "}, InputError, "has no transcript"),
        ({"text": "Hi.", "ref_text": "words"}, InputError, "without ref_audio"),
        ({"text": "Hi.", "ref_text": 7}, InputError, "ref_text 7 is given without ref_audio"),
        ({"text": "Hi.", "language": "Klingonese"}, InputError, "Klingonese"),
        ({"text": "Hi.", "speed": -1.0}, InputError, "speed=-1.0"),
        ({"text": "Hi.", "duration": 0.0}, InputError, "duration=0.0"),
        ({"text": "Hi.", "seed": 1.5}, InputError, "seed=1.5"),
        ({"text": "Hi.", "ref_audio": "", "ref_text": "a"}, InputError, "ref_audio='': give the clip's path"),
        ({"text": "Hi.", "ref_audio": bytearray(b"RIFF"), "ref_text": "a"}, InputError, "=bytearray"),
        ({"text": "Hi.", "ref_audio": str(DATA), "ref_text": "a"}, AudioError, "is a folder: give an audio"),
        ({"text": "Hi.", "prompt": {"tokens": []}}, InputError, "prompt is a dict: give a VoicePrompt"),
        ({"text": "Hi.", "seed": 2**70}, InputError, r"seed=1180591620717411303424: give an integer from 0"),
        ({"text": "Hi.", "seed": -1}, InputError, "seed=-1"),
        ({"text": "Hi.", "duration": 3600.0}, InputError, "3600 s of audio, over the 600 s limit"),
        ({"text": "Hello there.", "speed": 0.001}, InputError, "over the 600 s limit"),
        (
            {"text": "Hi.", "ref_audio": "/no/such/clip.wav", "ref_text": "x"},
            AudioError,
            "clip.wav does not exist",
        ),
    ],
)
def test_bad_requests(engine, request_kwargs, error, match):
    with pytest.raises(error, match=match):
        engine.synthesize([SynthRequest(**request_kwargs)])


def test_bad_voice_prompts(engine):
    good = engine.prepare(SynthRequest(text="Hi.", ref_audio=CLIP, ref_text=TRANSCRIPT)).prompt
    with pytest.raises(InputError, match="both a voice prompt and ref_audio"):
        engine.prepare(SynthRequest(text="Hi.", prompt=good, ref_audio=CLIP))
    wrong_books = VoicePrompt(good.tokens[:1], good.ref_text, good.ref_rms)
    with pytest.raises(InputError, match="not int64 codes"):
        engine.prepare(SynthRequest(text="Hi.", prompt=wrong_books))
    out_of_range = VoicePrompt(good.tokens.clone().fill_(1024), good.ref_text, good.ref_rms)
    with pytest.raises(InputError, match="not int64 codes"):
        engine.prepare(SynthRequest(text="Hi.", prompt=out_of_range))
    with pytest.raises(InputError, match="empty ref_text"):
        engine.prepare(SynthRequest(text="Hi.", prompt=VoicePrompt(good.tokens, " ", good.ref_rms)))
    with pytest.raises(InputError, match=r"empty ref_text \(None\)"):
        engine.prepare(SynthRequest(text="Hi.", prompt=VoicePrompt(good.tokens, None, good.ref_rms)))


def test_precision_must_fit_the_checkpoint():
    with pytest.raises(CheckpointError, match="precision='w4a4' with an unquantized checkpoint"):
        Engine(EngineConfig(precision="w4a4"))


@pytest.mark.gpu
def test_cuda_engine_runs_bf16_with_cuda_graphs():
    engine = Engine(EngineConfig(device="cuda", generation=FAST))
    assert engine.precision == "bf16" and engine.device.type == "cuda"
    reqs = [
        SynthRequest(text="Hello from the GPU.", ref_audio=CLIP, ref_text=TRANSCRIPT, seed=1),
        SynthRequest(text="A designed voice.", instruct="female", seed=2),
    ]
    for out in engine.synthesize(reqs):
        assert out.audio.dtype == np.float32 and np.isfinite(out.audio).all()
        assert len(out.audio) == out.target_frames * engine.codec.hop_length + _pad(engine)
        assert out.token_work > 0 and out.timings["generate"] > 0


@pytest.mark.gpu
def test_cuda_decode_on_its_own_stream_equals_a_decode_waited_for():
    """On CUDA generate() queues each batch's decode on the engine's decode stream and returns before it
    ran; audio read after the next batch was queued is what a decode on the generation stream, waited for,
    makes of the same tokens (the same kernels on the same shapes: bit for bit)."""
    engine = Engine(EngineConfig(device="cuda", generation=FAST))
    first = engine.generate([SynthRequest(text="One batch.", ref_audio=CLIP, ref_text=TRANSCRIPT, seed=3)])
    second = engine.generate([SynthRequest(text="And the next, queued meanwhile.", instruct="male", seed=4)])
    for g in (*first, *second):
        g.decoding.wait()
        (want,) = engine._decode([torch.from_numpy(g.tokens).to("cuda")])
        assert len(g.pieces) == 1 and np.array_equal(g.pieces[0], want)
        out = g.finish()
        assert out.timings["generate"] > 0 and out.timings["decode"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ("bf16", "fp8"))
def test_cuda_generate_queues_a_prepared_batch_without_waiting_for_the_device(precision):
    """Once its requests are prepared (prepare_ahead) and its graph captured, generate() queues the batch,
    its decode and the copies back without one host-device synchronization (torch's sync debug mode raises
    on any), so the host goes on to the next batch while this one runs; the tokens are those of the same
    requests run before."""
    if precision == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs an Ada or Hopper GPU")
    engine = Engine(EngineConfig(device="cuda", precision=precision, generation=FAST))
    reqs = [
        SynthRequest(text="Queued on the device.", ref_audio=CLIP, ref_text=TRANSCRIPT, seed=5),
        SynthRequest(text="And this one too.", instruct="female", seed=6),
    ]
    before = engine.synthesize(reqs)  # captures the batch's graph
    again = [replace(r) for r in reqs]  # new objects: prepare_ahead keys a batch by its requests' ids
    engine.prepare_ahead(again)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        generated = engine.generate(again)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for g, want in zip(generated, before, strict=True):
        assert np.array_equal(g.finish().tokens, want.tokens)


@pytest.mark.gpu
def test_cuda_preparing_a_batch_waits_for_the_device_only_for_its_codes(tmp_path):
    """prepare_ahead, as the job's preparing threads run it beside the generation: of the host's waits on
    the device, only the clips' codes coming back remain, once per encode (the last encode batch's copy);
    a wait anywhere else would hold the preparing thread behind the generation's queued steps. torch's sync
    debug mode warns on every wait; where one comes from is in the assertion's message."""
    import warnings

    clips = sorted(n for n in CLIPS if n.endswith(".wav"))
    reqs = [
        SynthRequest(text=f"Line {i}.", ref_audio=DATA / n, ref_text=CLIPS[n]["transcript"], seed=i)
        for i, n in enumerate(clips)
    ]
    engine = Engine(EngineConfig(device="cuda", prompt_cache_dir=str(tmp_path), generation=FAST))
    engine.synthesize(reqs[:1])  # the first encode and generation (cuDNN's set-up, graph capture)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.prepare_ahead(reqs[1:])  # clips the prompt cache lacks
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tuple(map(id, reqs[1:])) in engine._ahead
    waits = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    assert len(waits) == 1, waits


@pytest.mark.gpu
def test_cuda_next_batch_prepared_beside_the_steps_changes_no_token():
    """As the job runs it: each batch's `then` prepares the next one (its clip encoded on the encode stream,
    on the engine's thread) while the batch's steps are queued; every batch's tokens equal those of the
    same requests synthesized one batch at a time on a fresh engine."""
    clips = sorted(n for n in CLIPS if n.endswith(".wav"))

    def request(b, i, name):
        transcript = CLIPS[name]["transcript"]
        return SynthRequest(text=f"Batch {b}, line {i}.", ref_audio=DATA / name, ref_text=transcript)

    batches = [[request(b, i, n) for i, n in enumerate(clips[b::2])] for b in range(2)]
    engine = Engine(EngineConfig(device="cuda", prompt_cache_dir=None, generation=FAST))
    first = engine.generate(batches[0], then=lambda: engine.prepare_ahead(batches[1]))
    assert tuple(map(id, batches[1])) in engine._ahead  # prepared beside the first batch's steps
    generated = [first, engine.generate(batches[1])]
    fresh = Engine(EngineConfig(device="cuda", prompt_cache_dir=None, generation=FAST))
    for batch, outs in zip(batches, generated, strict=True):
        for out, want in zip(outs, fresh.synthesize(batch), strict=True):
            assert np.array_equal(out.finish().tokens, want.tokens)


@pytest.mark.gpu
def test_cuda_batches_measure_the_generation_streams_idle_before_them():
    """generation_idle: the device seconds the generation stream sat idle between the batch before's end
    and this batch's start. None before an engine's first batch; at least the host's pause when the host
    queued a batch only after a pause with the device done; ~0 for a batch queued while the stream was
    still busy (a ~1 s sleep kernel queued before both)."""
    import time

    engine = Engine(EngineConfig(device="cuda", prompt_cache_dir=None, generation=FAST))
    reqs = [SynthRequest(text="A pause between batches.", seed=1)]
    first = engine.synthesize(reqs)[0]  # waits for its decode: the stream is done with it
    time.sleep(0.3)
    second = engine.synthesize(reqs)[0]
    assert "generation_idle" not in first.timings
    assert second.timings["generation_idle"] >= 0.29
    torch.cuda._sleep(2_000_000_000)  # clock cycles on the generation stream
    engine.generate(reqs)
    queued = engine.generate(reqs)[0].finish()
    assert queued.timings["generation_idle"] < 0.01


@pytest.mark.gpu
def test_cuda_clips_are_encoded_without_waiting_for_the_generation_queued_before():
    """On CUDA the engine encodes reference clips on a stream of its own, at a higher priority than the
    generation's: preparing a request whose clip the prompt cache lacks returns while work queued before it
    on the generation stream still runs (a ~4 s sleep kernel), and its prompt equals the codec's encode on
    the generation stream (the same kernels: bit for bit)."""
    from engine.frontend.audio import read_clip_bytes
    from engine.frontend.prompt import build_prompt

    engine = Engine(EngineConfig(device="cuda", prompt_cache_dir=None, generation=FAST))
    first, second = (DATA / n for n in ("en_16k_mono.wav", "en_24k_mono.wav"))
    engine.prepare(SynthRequest(text="Warm up.", ref_audio=first, ref_text=CLIPS[first.name]["transcript"]))
    req = SynthRequest(text="Hi.", ref_audio=second, ref_text=CLIPS[second.name]["transcript"])
    torch.cuda.synchronize()
    torch.cuda._sleep(8_000_000_000)  # clock cycles
    prepared = engine.prepare(req)
    assert not torch.cuda.current_stream().query()  # the sleep still runs: prepare did not wait for it
    torch.cuda.synchronize()
    assert engine._encode_stream().priority < torch.cuda.current_stream().priority  # lower: scheduled first
    name, text = engine.requests.clip_of(req)
    want = build_prompt(read_clip_bytes(second), name, text, engine.codec, engine.reference_settings)
    assert torch.equal(prepared.prompt.tokens, want.tokens)


def test_then_runs_beside_the_batchs_steps_and_is_done_when_generate_returns(engine, monkeypatch):
    """generate's `then` (the next batch's host work) starts on its own thread once the batch is set up,
    while its steps run: here a step waits until `then` has started, which a `then` run after the steps
    could never satisfy."""
    import threading

    from engine.generate.decoding import BatchDecoder

    started, finished, seen = threading.Event(), threading.Event(), []
    step = BatchDecoder.step

    def waiting_step(self, *args):
        seen.append(started.wait(timeout=60))
        return step(self, *args)

    def then():
        seen.append(threading.current_thread().name)
        started.set()
        finished.set()

    monkeypatch.setattr(BatchDecoder, "step", waiting_step)
    engine.generate([SynthRequest(text="Beside.", ref_audio=CLIP, ref_text=TRANSCRIPT, seed=3)], then=then)
    assert finished.is_set() and seen[0].startswith("ovbatch-then") and all(seen[1:])


@pytest.mark.parametrize("stage", ["steps", "decode"])
def test_a_batch_that_fails_leaves_no_then_running(engine, monkeypatch, stage):
    import threading
    import time

    from engine.generate.decoding import BatchDecoder

    finished = threading.Event()

    def broken(*args):
        raise RuntimeError(f"{stage} failed")

    def slow_then():
        time.sleep(0.3)
        finished.set()

    if stage == "steps":
        monkeypatch.setattr(BatchDecoder, "step", broken)
    else:
        monkeypatch.setattr(engine, "_decode_queued" if engine.device.type == "cuda" else "_decode", broken)
    with pytest.raises(RuntimeError, match=f"{stage} failed"):
        engine.generate([SynthRequest(text="Fails.", instruct="male", seed=4)], then=slow_then)
    assert finished.is_set()


def test_a_failed_batch_leaves_no_clip_key_for_a_later_one(engine, tmp_path):
    """preload() keys a clip by its content when read; a batch that fails must not leave that key for a
    later batch, which may find other content under the same path."""
    import shutil

    voice, bad = tmp_path / "voice.wav", tmp_path / "bad.wav"
    shutil.copy(DATA / "en_24k_mono.wav", voice)
    bad.write_bytes(b"not audio")
    a, b = (SynthRequest(text="Hi.", ref_audio=str(p), ref_text=TRANSCRIPT) for p in (voice, bad))
    engine.preload([a, b])
    with pytest.raises(AudioError):
        engine.prepare_many([a, b])
    shutil.copy(DATA / "en_16k_mono.wav", voice)  # the same path, another clip
    got = engine.prepare(SynthRequest(text="Hi.", ref_audio=str(voice), ref_text=TRANSCRIPT)).prompt
    want = engine.prepare(SynthRequest(text="Hi.", ref_audio=DATA / "en_16k_mono.wav", ref_text=TRANSCRIPT))
    assert torch.equal(got.tokens, want.prompt.tokens)


def test_preloaded_clips_give_the_prompts_and_audio_an_unprepared_engine_makes(tmp_path, monkeypatch):
    """preload() prepares on the host the clips the prompt cache lacks (a clip it cannot use keeps its
    error for generate to report); synthesize then takes them instead of preparing them again, with the
    same result as without preload (the same code runs, so the audio is bit-equal)."""
    from engine.frontend import prompt as prompt_mod

    broken = tmp_path / "broken.wav"
    broken.write_bytes(b"RIFF....WAVE")
    clips = sorted(n for n in CLIPS if n.endswith((".wav", ".flac")))
    reqs = [
        SynthRequest(text=f"Line {i}.", ref_audio=DATA / n, ref_text=CLIPS[n]["transcript"])
        for i, n in enumerate(clips)
    ]
    cold = lambda: Engine(EngineConfig(prompt_cache_dir=None, generation=FAST))  # noqa: E731
    want = cold().synthesize(reqs)

    engine = cold()
    engine.preload([*reqs, SynthRequest(text="x", ref_audio=broken, ref_text="words")])
    assert len(engine._references) == len(clips) + 1
    prepared_inline = []
    real = prompt_mod.prepare_reference
    monkeypatch.setattr(
        prompt_mod, "prepare_reference", lambda *a, **k: prepared_inline.append(1) or real(*a, **k)
    )
    got = engine.synthesize(reqs)
    assert not prepared_inline and len(engine._references) == 1  # only the broken clip's error is left
    for a, b in zip(got, want, strict=True):
        assert np.array_equal(a.audio, b.audio) and np.array_equal(a.tokens, b.tokens)
    with pytest.raises(AudioError, match="broken.wav"):
        engine.synthesize([SynthRequest(text="x", ref_audio=broken, ref_text="words")])
    engine.preload(reqs)  # every clip is in the prompt cache now: nothing to prepare
    assert not engine._references


def test_a_preloaded_clip_is_read_once_and_its_prompt_keyed_by_those_bytes(tmp_path):
    """preload() reads and hashes a clip; the batch's preparation takes that key and reads the clip no
    second time (here it is gone from disk by then), with the same audio as an engine that never
    preloaded. A clip preload cannot read is left for synthesize to report."""
    import shutil

    name = sorted(n for n in CLIPS if n.endswith(".wav"))[0]
    clip = tmp_path / name
    shutil.copy(DATA / name, clip)
    reqs = [SynthRequest(text="Line one.", ref_audio=clip, ref_text=CLIPS[name]["transcript"], seed=3)]
    cold = lambda: Engine(EngineConfig(prompt_cache_dir=None, generation=FAST))  # noqa: E731
    want = cold().synthesize(reqs)

    engine = cold()
    missing = SynthRequest(text="x", ref_audio=tmp_path / "missing.wav", ref_text="words")
    engine.preload([*reqs, missing])
    clip.unlink()
    (got,) = engine.synthesize(reqs)
    assert np.array_equal(got.audio, want[0].audio) and np.array_equal(got.tokens, want[0].tokens)
    assert not engine._clip_keys and not engine._references
    with pytest.raises(AudioError, match="missing.wav"):
        engine.synthesize([missing])


def test_preload_prepares_a_clip_that_rows_share_once(tmp_path, monkeypatch):
    """preload() reads clips on several threads; rows that share a clip and its transcript (one speaker's
    rows) have it prepared once, not once per thread that meets it."""
    import engine.api as api

    name = sorted(n for n in CLIPS if n.endswith(".wav"))[0]
    reqs = [
        SynthRequest(text=f"Line {i}.", ref_audio=DATA / name, ref_text=CLIPS[name]["transcript"])
        for i in range(8)
    ]
    calls = []
    real = api.prepare_reference
    monkeypatch.setattr(api, "prepare_reference", lambda *a, **k: calls.append(1) or real(*a, **k))
    engine = Engine(EngineConfig(prompt_cache_dir=None, generation=FAST))
    engine.preload(reqs)
    assert len(calls) == 1 and len(engine._references) == 1


def test_decode_calls_take_clips_of_like_length_and_keep_their_order(engine, monkeypatch):
    from engine.api import DECODE_BATCH_FRAMES, DECODE_CALL_FRAMES

    calls = []
    original = engine.codec.decode

    def recording(codes):
        calls.append([c.shape[1] for c in codes])
        return original(codes)

    monkeypatch.setattr(engine.codec, "decode", recording)
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.integers(1, 500, size=40)] + [3]
    codes = [torch.randint(0, engine.codec.codebook_size, (engine.codec.num_codebooks, n)) for n in lengths]
    audio = engine._decode(codes)
    assert [len(a) for a in audio] == [n * engine.codec.hop_length for n in lengths]  # in the given order
    assert sorted(n for call in calls for n in call) == sorted(lengths)
    for call in calls:
        assert call == sorted(call, reverse=True)
        assert len(call) * call[0] <= DECODE_BATCH_FRAMES and call[0] - call[-1] <= DECODE_CALL_FRAMES
    assert [call[0] for call in calls] == sorted((call[0] for call in calls), reverse=True)
    for n, wav in zip(lengths[:3], engine._decode(codes[:3])):  # each clip's audio is its own alone
        (alone,) = engine._decode([codes[lengths.index(n)]])
        np.testing.assert_allclose(wav, alone, atol=1e-5)


def test_a_batch_prepared_ahead_generates_as_one_prepared_in_its_call(tmp_path, monkeypatch):
    """generate(batch_a, then=...) runs `then` once, after batch_a's generation is queued; prepare_ahead
    there prepares batch_b and packs its runner call on the host, whose generate() then prepares and packs
    nothing (the same code ran earlier: the audio is bit-equal to a cold engine's). Only the very request
    objects given to prepare_ahead count, and batches prepared ahead are kept apart; what it cannot
    prepare is raised by that batch's own generate()."""
    clips = sorted(n for n in CLIPS if n.endswith((".wav", ".flac")))
    batch_a = [
        SynthRequest(text="First batch.", ref_audio=DATA / clips[0], ref_text=CLIPS[clips[0]]["transcript"])
    ]
    batch_b = [
        SynthRequest(text=f"Line {i}.", ref_audio=DATA / n, ref_text=CLIPS[n]["transcript"], seed=i)
        for i, n in enumerate(clips[1:])
    ]
    cold = lambda: Engine(EngineConfig(prompt_cache_dir=None, generation=FAST))  # noqa: E731
    want = cold().synthesize(batch_b)

    engine = cold()
    prepares = []
    real = engine.prepare_many
    monkeypatch.setattr(engine, "prepare_many", lambda reqs: prepares.append(len(reqs)) or real(reqs))
    packs = []
    real_pack = engine.runner.pack
    monkeypatch.setattr(engine.runner, "pack", lambda items: packs.append(len(items)) or real_pack(items))
    calls = []
    engine.generate(batch_a, then=lambda: calls.append(1) or engine.prepare_ahead(batch_b))
    assert calls == [1] and prepares == [1, len(batch_b)] and packs == [1, len(batch_b)]
    got = [g.finish() for g in engine.generate(batch_b)]
    assert prepares == [1, len(batch_b)] and packs == [1, len(batch_b)]  # batch_b was not prepared again
    for a, b in zip(got, want, strict=True):
        assert np.array_equal(a.audio, b.audio) and np.array_equal(a.tokens, b.tokens)
        assert a.timings["prepare"] == 0 and a.timings["prepare_ahead"] > 0  # its seconds, beside batch_a

    alone = engine.generate([replace(r) for r in batch_b])[0]
    assert alone.timings["prepare"] > 0 and "prepare_ahead" not in alone.timings

    assert prepares == [1, len(batch_b), len(batch_b)]
    engine.prepare_ahead(batch_b)
    engine.generate([replace(r) for r in batch_b])  # equal requests, other objects: prepared in the call
    assert prepares == [1, len(batch_b), len(batch_b), len(batch_b), len(batch_b)]
    batch_c = [replace(r) for r in batch_b]
    engine.prepare_ahead(batch_b)  # e.g. the next batches of two shards in one worker
    engine.prepare_ahead(batch_c)
    engine.generate(batch_c)
    engine.generate(batch_b)
    assert len(prepares) == 7  # each generate() found its own batch's preparation

    broken = tmp_path / "broken.wav"
    broken.write_bytes(b"RIFF....WAVE")
    bad = [SynthRequest(text="x", ref_audio=broken, ref_text="words")]
    engine.prepare_ahead(bad)  # no error here
    with pytest.raises(AudioError, match="broken.wav"):
        engine.generate(bad)


def _two_batches_prepared_at_once(device: str) -> Engine:
    """Two batches prepared at once from two threads (their clips, some shared, read, encoded and cached
    together) generate the tokens and audio they have when prepared alone; the engine that prepared them."""
    from concurrent.futures import ThreadPoolExecutor

    clips = sorted(n for n in CLIPS if n.endswith((".wav", ".flac")))
    batches = [
        [
            SynthRequest(
                text=f"Batch {b} line {i}.", ref_audio=DATA / n, ref_text=CLIPS[n]["transcript"], seed=i
            )
            for i, n in enumerate(clips[b::2] + clips[:1])  # the first clip in both batches
        ]
        for b in range(2)
    ]
    cfg = EngineConfig(device=device, prompt_cache_dir=None, generation=FAST)
    want = [Engine(cfg).synthesize(b) for b in batches]
    engine = Engine(cfg)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(engine.prepare_ahead, batches))
    for batch, expected in zip(batches, want, strict=True):
        got = [g.finish() for g in engine.generate(batch)]
        assert all(g.timings["prepare"] == 0 for g in got)  # prepared ahead, not in the call
        for a, b in zip(got, expected, strict=True):
            assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.audio, b.audio)
    return engine


def test_two_batches_prepared_at_once_on_two_threads_generate_as_prepared_one_by_one():
    """The job prepares two batches at once (pipeline.shard_runner.PREPARE_THREADS)."""
    _two_batches_prepared_at_once("cpu")


@pytest.mark.gpu
def test_cuda_two_batches_prepared_at_once_encode_on_streams_of_their_own():
    """On CUDA each preparing thread encodes on a stream of its own (above the generation's priority), so
    that two batches' encodes run side by side; the batches still generate as prepared one by one."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    engine = _two_batches_prepared_at_once("cuda")
    barrier = threading.Barrier(2)

    def stream_of_a_thread(_: int) -> torch.cuda.Stream:
        barrier.wait()  # both threads alive at once: two threads, not one twice
        return engine._encode_stream()

    with ThreadPoolExecutor(2) as pool:
        streams = list(pool.map(stream_of_a_thread, range(2)))
    assert streams[0] != streams[1] and engine._encode_stream() not in streams
    assert all(s.priority < torch.cuda.current_stream().priority for s in streams)
