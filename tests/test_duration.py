import math
import random
from types import SimpleNamespace

import pytest

from engine.errors import InputError
from engine.frontend.duration import (
    char_weight,
    effective_speed,
    estimate_frames,
    estimate_target_frames,
    text_weight,
)

# "Nice to meet you.": 13 letters, 3 spaces, 1 full stop -> 13 + 0.6 + 0.5.
FALLBACK_WEIGHT = 14.1
FALLBACK_FRAMES = 25


def _boost(frames: float) -> float:
    return frames if frames >= 50 else 50 * (frames / 50) ** (1 / 3)


@pytest.mark.parametrize(
    ("ch", "weight"),
    [
        ("a", 1.0), ("Z", 1.0), (" ", 0.2), (".", 0.5), ("，", 0.5), ("5", 3.5), ("٣", 3.5),
        ("你", 3.0), ("\U00020001", 3.0), ("ア", 2.2), ("あ", 2.2), ("한", 2.5), ("я", 1.0),
        ("α", 1.0), ("א", 1.5), ("ب", 1.5), ("ـ", 0.0), ("\u0301", 0.0), ("é", 1.0), ("ệ", 1.0),
        ("न", 1.8), ("ก", 1.5), ("ሀ", 3.0), ("🌍", 0.5), ("\u3000", 0.2), ("\n", 1.0), ("ꀀ", 3.0),
    ],
)  # fmt: skip
def test_char_weights(ch, weight):
    assert char_weight(ch) == weight


def test_text_weight():
    assert text_weight("Nice to meet you.") == pytest.approx(FALLBACK_WEIGHT)
    assert text_weight("你好，world!") == pytest.approx(3 + 3 + 0.5 + 5 + 0.5)
    assert text_weight("") == 0


def test_fallback_reference_estimates():
    # 35 letters, 8 spaces, 2 punctuation marks: 37.6 weight at 14.1/25 weight per frame -> 66.67 frames.
    text = "Hello world, this is a test of the estimator."
    assert estimate_target_frames(text, None, None) == int(37.6 / (FALLBACK_WEIGHT / FALLBACK_FRAMES))
    assert estimate_target_frames(text, None, None) == 66
    # Short texts get the power-curve boost: "Hi." is 2.5 weight -> 4.43 frames -> 22.3 frames.
    assert estimate_target_frames("Hi.", None, None) == int(_boost(2.5 / (FALLBACK_WEIGHT / 25))) == 22
    # An empty reference text or a missing frame count also falls back.
    assert estimate_target_frames(text, "", 100) == 66
    assert estimate_target_frames(text, "Some reference.", None) == 66


def test_with_reference():
    # "Hello world." weighs 10.7 and took 50 frames; "你好。" weighs 6.5 -> 30.37 frames -> boosted 42.3.
    assert estimate_frames("你好。", "Hello world.", 50) == pytest.approx(_boost(6.5 / (10.7 / 50)))
    assert estimate_target_frames("你好。", "Hello world.", 50) == 42
    long_text = "word " * 100  # 400 letters + 100 spaces = 420 weight
    assert estimate_target_frames(long_text, "Hello world.", 50) == int(420 / (10.7 / 50))
    assert estimate_frames("abc", "...", 0) == 0.0  # zero-length reference gives no estimate
    assert estimate_target_frames("abc", "\u0301", 10) == 1  # weightless reference text: at least 1 frame


def test_speed_and_duration_overrides():
    text = "Hello world, this is a test of the estimator."
    raw = 37.6 / (FALLBACK_WEIGHT / 25)
    assert estimate_target_frames(text, None, None, speed=2.0) == int(raw / 2) == 33
    assert estimate_target_frames(text, None, None, speed=0.5) == int(raw / 0.5)
    assert estimate_target_frames(text, None, None, speed=1.0) == 66
    # The boost applies before the speed division.
    boosted = _boost(2.5 / (FALLBACK_WEIGHT / 25))
    assert estimate_target_frames("Hi.", None, None, speed=2.0) == int(boosted / 2)
    # A duration replaces the estimate (and wins over speed).
    assert estimate_target_frames(text, None, None, duration=3.0) == 75
    assert estimate_target_frames(text, None, None, speed=2.0, duration=3.0) == 75
    assert estimate_target_frames(text, None, None, duration=3.0, frame_rate=50) == 150
    assert estimate_target_frames(text, None, None, duration=0.01) == 1
    assert effective_speed(text, None, None, duration=3.0) == pytest.approx(66 / 75)
    assert effective_speed(text, None, None, speed=1.5) == 1.5
    assert effective_speed(text, None, None) == 1.0


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, "fast", [2.0]])
def test_bad_speed_or_duration(bad):
    with pytest.raises(InputError, match="speed="):
        estimate_target_frames("hi", None, None, speed=bad)
    with pytest.raises(InputError, match="duration="):
        estimate_target_frames("hi", None, None, duration=bad)
    with pytest.raises(InputError, match="duration="):
        effective_speed("hi", None, None, duration=bad)


# ---------------------------------------------------------------- against upstream (omnivoice importable)


def _random_multiscript_text(rng: random.Random) -> str:
    ranges = [
        (0x20, 0x7E),
        (0xC0, 0x24F),
        (0x370, 0x3FF),
        (0x400, 0x4FF),
        (0x590, 0x6FF),
        (0x900, 0xDFF),
        (0xE00, 0xEFF),
        (0x1100, 0x11FF),
        (0x3040, 0x30FF),
        (0x4E00, 0x9FFF),
        (0xAC00, 0xD7AF),
        (0x1F300, 0x1F64F),
        (0x20000, 0x2A6DF),
        (0x0300, 0x036F),
        (0x2000, 0x206F),
        (0xFF00, 0xFFEF),
    ]
    out = []
    for _ in range(rng.randint(0, 60)):
        lo, hi = rng.choice(ranges)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


@pytest.fixture(scope="module")
def upstream():
    pytest.importorskip("omnivoice")
    import omnivoice.models.omnivoice as m
    from omnivoice.utils.duration import RuleDurationEstimator

    return SimpleNamespace(model=m, estimator=RuleDurationEstimator())


@pytest.mark.official
def test_upstream_rule_estimates(upstream):
    rng = random.Random(0)
    for _ in range(2000):
        text, ref = _random_multiscript_text(rng), _random_multiscript_text(rng)
        ref_frames = rng.choice([0, 1, 25, 77, 300.5])
        assert text_weight(text) == upstream.estimator.calculate_total_weight(text)
        expected = upstream.estimator.estimate_duration(text, ref, ref_frames)
        assert estimate_frames(text, ref, ref_frames) == expected


@pytest.mark.official
def test_upstream_speed_and_duration(upstream):
    """Our target frames and chunk speed equal what upstream's _preprocess_all puts in its task."""
    import torch

    cls = upstream.model.OmniVoice
    fake = SimpleNamespace(
        duration_estimator=upstream.estimator,
        audio_tokenizer=SimpleNamespace(config=SimpleNamespace(frame_rate=25)),
    )
    fake._ensure_list = lambda *a, **k: cls._ensure_list(fake, *a, **k)
    fake._estimate_target_tokens = lambda *a, **k: cls._estimate_target_tokens(fake, *a, **k)
    rng = random.Random(1)
    for _ in range(300):
        text = _random_multiscript_text(rng) + "x"
        with_ref = rng.random() < 0.5
        ref_text = _random_multiscript_text(rng) if with_ref else None
        ref_frames = rng.randint(1, 400) if with_ref else None
        speed = rng.choice([None, 0.5, 0.8, 1.0, 1.7, 3.0])
        duration = rng.choice([None, None, 0.3, 2.0, 12.34, 45.0])
        prompt = None
        if with_ref:
            prompt = upstream.model.VoiceClonePrompt(
                ref_audio_tokens=torch.zeros(8, ref_frames, dtype=torch.long), ref_text=ref_text, ref_rms=0.1
            )
        task = cls._preprocess_all(fake, text=text, voice_clone_prompt=prompt, speed=speed, duration=duration)
        assert estimate_target_frames(text, ref_text, ref_frames, speed, duration) == task.target_lens[0]
        expected_speed = task.speed[0] if task.speed else 1.0
        assert effective_speed(text, ref_text, ref_frames, speed, duration) == expected_speed
