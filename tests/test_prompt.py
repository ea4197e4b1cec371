import io
import json
import logging
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from engine.errors import AudioError, InputError
from engine.frontend.audio import ReferenceSettings, prepare_reference
from engine.frontend.prompt import PromptCache, VoicePrompt, build_prompt, build_prompts

DATA = Path(__file__).parent / "data"
CLIP = DATA / "en_24k_mono.wav"
TEXT = "The quick brown fox jumps over the lazy dog."


class CountingCodec:
    """Stands in for engine.codec.Codec: deterministic codes from the samples, counts encode calls."""

    sample_rate, hop_length, num_codebooks, identity = 24000, 960, 4, "counting-codec-v1"

    def __init__(self):
        self.calls = 0
        self.seen: list[torch.Tensor] = []

    def encode(self, wavs, device=None):
        self.calls += 1
        self.seen.extend(wavs)
        out = []
        for w in wavs:
            frames = w.reshape(-1, self.hop_length)
            level = (frames.abs().mean(dim=1) * 1000).long() % 1024
            out.append(torch.stack([(level + c) % 1024 for c in range(self.num_codebooks)]))
        return out


def _random_prompt(rng, frames=None):
    frames = frames or int(rng.integers(1, 400))
    tokens = torch.from_numpy(rng.integers(0, 1024, size=(8, frames)))
    return VoicePrompt(
        tokens=tokens, ref_text='Grüße, 你好 — "quoted"', ref_rms=float(rng.uniform(0.01, 0.3))
    )


def _cache(directory, codec=None, settings=None):
    codec, settings = codec or CountingCodec(), settings or ReferenceSettings()
    return PromptCache(directory, codec.identity, settings.fingerprint(codec.sample_rate, codec.hop_length))


def _maker(codec, settings=None, text=TEXT):
    return lambda raw: build_prompt(raw, "clip", text, codec, settings or ReferenceSettings())


# ---------------------------------------------------------------- VoicePrompt files


def test_voice_prompt_roundtrip(tmp_path):
    rng = np.random.default_rng()
    prompt = _random_prompt(rng)
    prompt.save(tmp_path / "voice")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["voice.json", "voice.safetensors"]
    back = VoicePrompt.load(tmp_path / "voice")
    assert torch.equal(back.tokens, prompt.tokens) and back.tokens.dtype == torch.long
    assert back.ref_text == prompt.ref_text and back.ref_rms == prompt.ref_rms
    assert (tmp_path / "voice.safetensors").read_bytes()[8:9] == b"{"  # safetensors header, not a pickle


def test_voice_prompt_files_are_utf8_whatever_the_locale(tmp_path):
    script = (
        "import sys, torch; from engine.frontend.prompt import VoicePrompt; "
        "p = VoicePrompt(torch.zeros(8, 3, dtype=torch.long), '\\u4f60\\u597d, Gr\\u00fc\\u00dfe', 0.1); "
        "p.save(sys.argv[1]); "
        "assert VoicePrompt.load(sys.argv[1]).ref_text == p.ref_text"
    )
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONIOENCODING": ""}
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "v")], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "你好" in (tmp_path / "v.json").read_bytes().decode("utf-8")


def test_voice_prompt_detects_mismatched_or_damaged_files(tmp_path):
    rng = np.random.default_rng()
    _random_prompt(rng, 50).save(tmp_path / "a")
    _random_prompt(rng, 50).save(tmp_path / "b")
    (tmp_path / "b.json").replace(tmp_path / "a.json")  # tokens of a, metadata of b
    with pytest.raises(InputError, match=r"a\.safetensors does not match .*a\.json"):
        VoicePrompt.load(tmp_path / "a")
    with pytest.raises(InputError, match=r"c\.json is missing"):
        VoicePrompt.load(tmp_path / "c")
    _random_prompt(rng).save(tmp_path / "d")
    (tmp_path / "d.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(InputError, match="unreadable"):
        VoicePrompt.load(tmp_path / "d")
    _random_prompt(rng).save(tmp_path / "e")
    meta = json.loads((tmp_path / "e.json").read_text())
    (tmp_path / "e.json").write_text(json.dumps({**meta, "version": 99}))
    with pytest.raises(InputError, match="not a version-1 ovbatch-voice-prompt file"):
        VoicePrompt.load(tmp_path / "e")
    for damaged in (
        {k: v for k, v in meta.items() if k != "ref_rms"},
        {**meta, "ref_rms": 0.0},
        {**meta, "source_seconds": -3.0},
    ):
        (tmp_path / "e.json").write_text(json.dumps(damaged))
        with pytest.raises(InputError, match=r"e\.json needs a text ref_text, a positive finite ref_rms"):
            VoicePrompt.load(tmp_path / "e")
    (tmp_path / "e.json").write_text("null")
    with pytest.raises(InputError, match=r"e\.json holds NoneType, not a prompt's metadata"):
        VoicePrompt.load(tmp_path / "e")
    with pytest.raises(InputError, match="voice prompt ref_rms=-1.0: give the reference clip's RMS"):
        VoicePrompt(torch.zeros(8, 3, dtype=torch.long), "words", -1.0)
    with pytest.raises(InputError, match="voice prompt source_seconds=nan: give the reference clip's length"):
        VoicePrompt(torch.zeros(8, 3, dtype=torch.long), "words", 0.1, float("nan"))


def test_voice_prompt_keeps_its_clips_length_when_it_knows_it(tmp_path):
    rng = np.random.default_rng()
    known = _random_prompt(rng)
    known.source_seconds = 4.25
    for name, prompt in (("known", known), ("unknown", _random_prompt(rng))):
        prompt.save(tmp_path / name)
        assert VoicePrompt.load(tmp_path / name).source_seconds == prompt.source_seconds
    assert "source_seconds" not in json.loads((tmp_path / "unknown.json").read_text())


# ---------------------------------------------------------------- building and caching


def test_build_prompt_encodes_the_prepared_reference():
    codec = CountingCodec()
    prompt = build_prompt(CLIP.read_bytes(), "clip", TEXT, codec, ReferenceSettings())
    ref = prepare_reference(CLIP, 24000, 960)
    assert codec.calls == 1 and torch.equal(codec.seen[0], torch.from_numpy(ref.audio))
    assert prompt.tokens.shape == (4, len(ref.audio) // 960) and prompt.tokens.dtype == torch.long
    assert prompt.ref_rms == ref.rms and prompt.ref_text == TEXT


@pytest.mark.parametrize("on_disk", [True, False])
def test_same_clip_twice_encodes_once(tmp_path, on_disk):
    codec = CountingCodec()
    cache = _cache(tmp_path if on_disk else None, codec)
    first = cache.get_or_create(CLIP, TEXT, _maker(codec))
    second = cache.get_or_create(CLIP.read_bytes(), TEXT, _maker(codec))  # same content, given as bytes
    assert codec.calls == 1
    assert torch.equal(first.tokens, second.tokens) and first.ref_rms == second.ref_rms
    if on_disk:  # a fresh cache object (another process, a later job) reads the entry back once written
        cache.flush()
        again = _cache(tmp_path, codec).get_or_create(CLIP, TEXT, _maker(codec))
        assert codec.calls == 1 and torch.equal(again.tokens, first.tokens)


def test_key_depends_on_clip_text_settings_and_codec(tmp_path):
    codec = CountingCodec()
    cache = _cache(tmp_path, codec)
    cache.get_or_create(CLIP, TEXT, _maker(codec))
    cache.get_or_create(CLIP, TEXT + " Again.", _maker(codec, text=TEXT + " Again."))
    cache.get_or_create(DATA / "en_16k_mono.wav", TEXT, _maker(codec))
    assert codec.calls == 3
    raw_settings = ReferenceSettings(preprocess=False)
    raw = _cache(tmp_path, codec, raw_settings)
    raw.get_or_create(CLIP, TEXT, _maker(codec, raw_settings))
    assert codec.calls == 4
    other = CountingCodec()
    other.identity = "another-codec"
    other_cache = _cache(tmp_path, other)
    other_cache.get_or_create(CLIP, TEXT, _maker(other))
    assert other.calls == 1
    for written in (cache, raw, other_cache):
        written.flush()
    # limits that do not change the prepared samples share entries
    longer = _cache(tmp_path, codec, ReferenceSettings(max_seconds=30))
    longer.get_or_create(CLIP, TEXT, _maker(codec))
    assert codec.calls == 4
    longer.flush()
    assert len(list(tmp_path.glob("*/*/prompt.json"))) == 5


def test_damaged_entry_is_rebuilt(tmp_path):
    codec = CountingCodec()
    cache = _cache(tmp_path, codec)
    first = cache.get_or_create(CLIP, TEXT, _maker(codec))
    cache.flush()
    (entry,) = tmp_path.glob("*/*/prompt.safetensors")
    entry.write_bytes(b"garbage")
    again = cache.get_or_create(CLIP, TEXT, _maker(codec))
    assert codec.calls == 2 and torch.equal(again.tokens, first.tokens)
    cache.flush()
    assert VoicePrompt.load(entry.with_suffix("")).ref_text == TEXT


def test_a_prompt_carries_its_clips_length_as_given(tmp_path):
    prompt = _cache(tmp_path).get_or_create(CLIP, TEXT, _maker(CountingCodec()))
    info = sf.info(CLIP)
    assert prompt.source_seconds == pytest.approx(info.frames / info.samplerate)


def test_an_entry_that_does_not_know_its_clips_length_is_rebuilt(tmp_path):
    """Entries written before prompts kept their clip's length: engine.max_ref_seconds could not be held
    to them on a hit, so they are made again (once)."""
    codec = CountingCodec()
    cache = _cache(tmp_path, codec)
    cache.get_or_create(CLIP, TEXT, _maker(codec))
    cache.flush()
    (meta_path,) = tmp_path.glob("*/*/prompt.json")
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({k: v for k, v in meta.items() if k != "source_seconds"}))
    fresh = _cache(tmp_path, codec)
    assert fresh.get_or_create(CLIP, TEXT, _maker(codec)).source_seconds is not None and codec.calls == 2
    fresh.flush()
    assert "source_seconds" in json.loads(meta_path.read_text())


def test_bad_clip_is_not_cached(tmp_path):
    codec = CountingCodec()
    cache = _cache(tmp_path, codec)
    with pytest.raises(AudioError, match="is silent"):
        cache.get_or_create(_silent_wav(), TEXT, _maker(codec))
    cache.flush()
    assert codec.calls == 0 and not list(tmp_path.rglob("prompt.json"))


def test_a_prompt_being_written_is_found_in_memory(tmp_path, monkeypatch):
    codec = CountingCodec()
    cache = _cache(tmp_path, codec)
    release = threading.Event()
    publish = PromptCache._publish
    monkeypatch.setattr(PromptCache, "_publish", lambda self, *a: (release.wait(10), publish(self, *a)))
    first = cache.get_or_create(CLIP, TEXT, _maker(codec))  # returns while its entry is still unwritten
    key = cache.key(CLIP.read_bytes(), TEXT)
    assert not cache.entry_dir(key).exists() and cache.has(key)
    assert cache.get_or_create(CLIP, TEXT, _maker(codec)) is first and codec.calls == 1
    release.set()
    cache.flush()
    assert cache.entry_dir(key).exists() and cache.has(key)
    assert torch.equal(_cache(tmp_path, codec).get_or_create(CLIP, TEXT, _maker(codec)).tokens, first.tokens)
    assert codec.calls == 1


def test_a_prompt_that_cannot_be_written_is_still_used(tmp_path, caplog):
    codec = CountingCodec()
    cache = _cache(tmp_path, codec)
    key = cache.key(CLIP.read_bytes(), TEXT)
    cache.entry_dir(key).parent.write_bytes(b"")  # a file where the entry's folder must go
    with caplog.at_level(logging.WARNING, logger="engine.frontend.prompt"):
        prompt = cache.get_or_create(CLIP, TEXT, _maker(codec))
        cache.flush()
    assert prompt.tokens.shape[0] == codec.num_codebooks and not cache.has(key)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert key in warning and "not written" in warning and "prompt_cache_dir" in warning
    with caplog.at_level(logging.WARNING, logger="engine.frontend.prompt"):
        cache.get_or_create(CLIP, TEXT, _maker(codec))  # not kept: made again
        cache.flush()
    assert codec.calls == 2 and len(caplog.records) == 1  # one warning, not one a clip


def _silent_wav():
    buf = io.BytesIO()
    sf.write(buf, np.zeros(24000, np.float32), 24000, format="WAV")
    return buf.getvalue()


def test_many_clips_make_one_batch_of_distinct_misses(tmp_path):
    codec = CountingCodec()
    cache = _cache(tmp_path, codec)
    other, third = DATA / "en_16k_mono.wav", DATA / "en_44k_stereo.flac"
    cache.get_or_create(third, TEXT, _maker(codec))  # a hit later
    codec.calls, codec.seen = 0, []
    batches = []

    def make_many(misses):
        batches.append([i for i, _, _ in misses])
        return build_prompts([(raw, f"clip{i}", TEXT) for i, raw, _ in misses], codec, ReferenceSettings())

    clips = [CLIP, other, CLIP.read_bytes(), third, other]
    prompts = cache.get_or_create_many(clips, [TEXT] * 5, make_many)
    assert batches == [[0, 1]]  # one call, one clip per distinct missing key
    assert codec.calls == 1 and len(codec.seen) == 2  # encoded together
    assert prompts[0] is prompts[2] and prompts[1] is prompts[4]
    raws = [c if isinstance(c, bytes) else c.read_bytes() for c in clips]
    singles = [build_prompt(raw, "c", TEXT, CountingCodec(), ReferenceSettings()) for raw in raws]
    for got, single in zip(prompts, singles):
        assert torch.equal(got.tokens, single.tokens) and got.ref_rms == single.ref_rms


def test_a_bad_clip_in_a_batch_does_not_lose_the_others(tmp_path):
    codec = CountingCodec()
    cache = _cache(tmp_path, codec)
    clips, texts = [_silent_wav(), CLIP, tmp_path / "missing.wav"], [TEXT] * 3

    def make_many(misses):
        return build_prompts([(raw, f"clip{i}", TEXT) for i, raw, _ in misses], codec, ReferenceSettings())

    with pytest.raises(AudioError, match="missing.wav does not exist"):
        cache.get_or_create_many(clips, texts, make_many)
    assert codec.calls == 1 and len(codec.seen) == 1  # the good clip was encoded and cached
    with pytest.raises(AudioError, match="clip0 is silent"):
        cache.get_or_create_many(clips[:2], texts[:2], make_many)
    assert codec.calls == 1
    cache.get_or_create_many(clips[1:2], texts[1:2], make_many)
    assert codec.calls == 1


# ---------------------------------------------------------------- concurrent writers


def _race_writer(directory, marker, barrier, results):
    cache = PromptCache(directory, "race-codec", {"v": 1})

    def make(raw):
        time.sleep(0.3)  # both writers are inside make() before either publishes
        tokens = torch.full((8, 300), marker, dtype=torch.long)
        return VoicePrompt(tokens=tokens, ref_text=TEXT, ref_rms=marker, source_seconds=4.0)

    barrier.wait()
    prompt = cache.get_or_create(CLIP, TEXT, make)
    cache.flush()  # a forked child ends without joining its threads
    results.put((marker, int(prompt.tokens[0, 0])))


def test_two_processes_preparing_one_clip_leave_one_valid_entry(tmp_path):
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_race_writer, args=(tmp_path, m, barrier, results)) for m in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    outcomes = sorted(results.get(timeout=5) for _ in procs)
    assert outcomes == [(1, 1), (2, 2)]  # both raced through make(): each returned its own prompt
    entries = [p for p in tmp_path.rglob("*") if p.is_dir() and len(p.name) == 64]
    assert len(entries) == 1
    assert sorted(p.name for p in entries[0].iterdir()) == ["prompt.json", "prompt.safetensors"]
    umask = os.umask(0)
    os.umask(umask)
    for path in (entries[0], *entries[0].iterdir()):  # other users reuse it: modes as the umask makes them
        assert path.stat().st_mode & 0o777 == (0o777 if path.is_dir() else 0o666) & ~umask, path
    assert not [p for p in tmp_path.rglob(".tmp-*")]
    winner = VoicePrompt.load(entries[0] / "prompt")  # one writer's complete entry, never a mix
    assert winner.ref_rms in (1.0, 2.0) and (winner.tokens == int(winner.ref_rms)).all()
    reread = PromptCache(tmp_path, "race-codec", {"v": 1}).get_or_create(CLIP, TEXT, lambda raw: 1 / 0)
    assert torch.equal(reread.tokens, winner.tokens)
