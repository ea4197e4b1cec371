import random
import re
from types import SimpleNamespace

import pytest

from engine.errors import InputError
from engine.frontend.chunking import (
    chunk_char_budget,
    chunk_text_punctuation,
    needs_chunking,
    plan_chunks,
)
from engine.frontend.duration import effective_speed, estimate_target_frames, frames_at_speed


def test_needs_chunking():
    assert not needs_chunking(750, 30.0, 25)
    assert needs_chunking(751, 30.0, 25)
    # The threshold in frames is truncated: int(1.05 * 25) = 26.
    assert not needs_chunking(26, 1.05, 25)
    assert needs_chunking(27, 1.05, 25)


def test_sentences_and_abbreviations():
    text = "Mr. Smith went home. He slept."
    assert chunk_text_punctuation(text, 10) == ["Mr. Smith went home.", "He slept."]
    assert chunk_text_punctuation(text, 100) == [text]
    # "Dr." and "No." do not end sentences; "etc." (not in the list) does, and so does the first
    # dot of "e.g." (only the whole word is an abbreviation).
    assert chunk_text_punctuation("See Dr. No. 5 today. Then etc. more e.g. this", 5) == [
        "See Dr. No. 5 today.",
        "Then etc.",
        "more e.",
        "g.",
        "this",
    ]


def test_punctuation_after_a_cut_joins_the_left_chunk():
    assert chunk_text_punctuation('Wait!!" she said. Ok', 3) == ['Wait!!"', "she said.", "Ok"]
    assert chunk_text_punctuation("你好，世界。今天很好！", 4) == ["你好，", "世界。", "今天很好！"]
    assert chunk_text_punctuation("你好，世界。今天很好！", 6) == ["你好，世界。", "今天很好！"]


def test_short_chunks_are_merged():
    # The short first chunk takes in the second; a short later chunk joins the previous one.
    assert chunk_text_punctuation("A. Then a longer sentence. And another one. K", 20, min_chunk_len=3) == [
        "A. Then a longer sentence.",
        "And another one. K",
    ]
    assert chunk_text_punctuation("A. Then a longer sentence.", 20) == ["A.", "Then a longer sentence."]
    assert chunk_text_punctuation("  ,  ", 2, min_chunk_len=3) == [","]
    assert chunk_text_punctuation("   ", 5) == []


def test_chunks_partition_the_text():
    rng = random.Random(0)
    alphabet = list("abcde fgh  .,;!?。，！\"')") + ["Mr.", "No.", "你", "好"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 200)))
        chunks = chunk_text_punctuation(text, rng.randint(0, 40), min_chunk_len=rng.choice([None, 3]))
        assert re.sub(r"\s", "", "".join(chunks)) == re.sub(r"\s", "", text)
        assert all(c == c.strip() and c for c in chunks)


def test_long_sentences_are_cut_between_words_only_when_asked():
    text = "one two three four five six. Seven"
    assert chunk_text_punctuation(text, 10) == ["one two three four five six.", "Seven"]
    cut = chunk_text_punctuation(text, 10, cut_long_sentences=True)
    assert cut == ["one two", "three", "four five", "six. Seven"]
    assert chunk_text_punctuation("abcdefghij", 4, cut_long_sentences=True) == ["abcd", "efgh", "ij"]


def test_chunks_are_cut_finer_until_they_fit():
    text = "A first sentence of some length. A second one, also long enough. And a third to end it all."
    upstream = plan_chunks(text, 400, None, None, 1.0, 15.0, 25)
    fitting = plan_chunks(text, 400, None, None, 1.0, 15.0, 25, fits=lambda cs: len(cs) >= 6)
    assert len(upstream) < 6 <= len(fitting)
    assert "".join(c.text for c in fitting).replace(" ", "") == text.replace(" ", "")
    # a sentence stretched so far that upstream's budget is under a character is still cut to fit
    stretched = "one two three four five six seven"
    assert len(plan_chunks(stretched, 10000, None, None, 0.01, 15.0, 25)) == 1
    assert len(plan_chunks(stretched, 10000, None, None, 0.01, 15.0, 25, fits=lambda cs: len(cs) > 1)) > 1


def test_chunk_char_budget():
    # 100 chars over 500 frames is 5 frames per char; 15 s at 25 fps is 375 frames -> 75 chars.
    assert chunk_char_budget("x" * 100, 500, 15.0, 25) == 75
    assert chunk_char_budget("x" * 3, 2500, 15.0, 25) == 0


def test_plan_with_reference():
    text = " ".join(f"Sentence number {i} is here." for i in range(40))
    total = estimate_target_frames(text, "Hello world.", 50)
    plan = plan_chunks(text, total, "Hello world.", 50, 1.0, 15.0, 25)
    assert len(plan) > 1 and not any(c.first_chunk_is_ref for c in plan)
    budget = chunk_char_budget(text, total, 15.0, 25)
    assert all(len(c.text) <= budget for c in plan)
    assert [c.target_frames for c in plan] == [frames_at_speed(c.text, "Hello world.", 50) for c in plan]


def test_plan_without_reference_uses_first_chunk():
    text = " ".join(f"Sentence number {i} is here." for i in range(40))
    total = estimate_target_frames(text, None, None, speed=1.5)
    plan = plan_chunks(text, total, None, None, 1.5, 15.0, 25)
    first = plan[0]
    assert not first.first_chunk_is_ref
    assert first.target_frames == frames_at_speed(first.text, None, None, 1.5)
    for c in plan[1:]:
        assert c.first_chunk_is_ref
        assert c.target_frames == frames_at_speed(c.text, first.text, first.target_frames, 1.5)


def test_plan_of_blank_text():
    with pytest.raises(InputError, match="empty"):
        plan_chunks("   ", 800, None, None, 1.0, 15.0, 25)


# ---------------------------------------------------------------- against upstream (omnivoice importable)


@pytest.fixture(scope="module")
def upstream():
    pytest.importorskip("omnivoice")
    import omnivoice.models.omnivoice as m
    import omnivoice.utils.text as t
    from omnivoice.utils.duration import RuleDurationEstimator

    return SimpleNamespace(model=m, text=t, estimator=RuleDurationEstimator())


def _random_text(rng: random.Random) -> str:
    pieces = list("abcdefg hij  .,;:!?。，；：！？\"'“”‘’）]》>」】") + ["Mr.", "e.g.", "Dr. ", "你好", "\n"]
    return "".join(rng.choice(pieces) for _ in range(rng.randint(0, 300)))


@pytest.mark.official
def test_upstream_chunk_text_punctuation(upstream):
    rng = random.Random(1)
    for _ in range(1000):
        text, chunk_len, min_len = _random_text(rng), rng.randint(0, 60), rng.choice([None, 1, 3, 8])
        expected = upstream.text.chunk_text_punctuation(text, chunk_len, min_chunk_len=min_len)
        assert chunk_text_punctuation(text, chunk_len, min_chunk_len=min_len) == expected


@pytest.mark.official
@pytest.mark.parametrize("with_ref", [True, False])
def test_upstream_chunked_generation_plan(upstream, with_ref):
    """Chunk texts and target frames equal the sub-tasks upstream's _generate_chunked generates."""
    import torch

    cls = upstream.model.OmniVoice
    fake = SimpleNamespace(
        duration_estimator=upstream.estimator,
        audio_tokenizer=SimpleNamespace(config=SimpleNamespace(frame_rate=25)),
    )
    fake._estimate_target_tokens = lambda *a, **k: cls._estimate_target_tokens(fake, *a, **k)
    fake._ensure_list = lambda *a, **k: cls._ensure_list(fake, *a, **k)
    calls = []

    def fake_generate(sub_task, gen_config):
        calls.append(sub_task)
        return [torch.zeros(8, n, dtype=torch.long) for n in sub_task.target_lens]

    fake._generate_iterative = fake_generate
    gen = SimpleNamespace(audio_chunk_duration=15.0)
    rng = random.Random(2 + with_ref)
    for _ in range(30):
        text = " ".join(
            rng.choice(["One two three.", "Four, five six!", "你好世界。", "Mr. X came?"])
            for _ in range(rng.randint(30, 90))
        )
        ref_text, ref_frames = ("Hello world.", rng.randint(20, 200)) if with_ref else (None, None)
        speed = rng.choice([None, 0.7, 1.3])
        duration = rng.choice([None, 40.0, 95.5])
        prompt = None
        if with_ref:
            tokens = torch.zeros(8, ref_frames, dtype=torch.long)
            prompt = upstream.model.VoiceClonePrompt(tokens, ref_text, 0.1)
        task = cls._preprocess_all(fake, text=text, voice_clone_prompt=prompt, speed=speed, duration=duration)
        calls.clear()
        cls._generate_chunked(fake, task, gen)
        upstream_chunks = [(c.texts[0], c.target_lens[0], c.ref_texts[0]) for c in calls]
        assert len(upstream_chunks) > 1

        total = estimate_target_frames(text, ref_text, ref_frames, speed, duration)
        eff = effective_speed(text, ref_text, ref_frames, speed, duration)
        plan = plan_chunks(text, total, ref_text, ref_frames, eff, 15.0, 25)
        ours = [(c.text, c.target_frames, plan[0].text if c.first_chunk_is_ref else ref_text) for c in plan]
        assert ours == upstream_chunks
