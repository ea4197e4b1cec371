"""Long texts are chunked so that every chunk's generation fits the engine's token budget (the smaller of
max_batch_tokens and the largest bucket), and the planner sizes a chunked row by its largest chunk: a text
of max_text_chars characters is accepted and synthesized under the default engine settings (issue 44,
item 8)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.api import Engine, SynthRequest
from engine.config import EngineConfig, GenerationConfig
from engine.generate.packing import packed_tokens
from engine.tiny import ensure_tiny_checkpoint
from pipeline.manifest import ManifestRow
from pipeline.plan import make_plan
from pipeline.sizing import FrontendSizer

DATA = Path(__file__).parent / "data"
CLIP = str(DATA / "en_24k_mono.wav")
TRANSCRIPT = json.loads((DATA / "clips.json").read_text())["en_24k_mono.wav"]["transcript"]
SENTENCES = [
    "The harbour was quiet before dawn, and the boats rocked gently against the old stone pier.",
    "A fisherman counted his nets twice, because the weather had turned twice in one night.",
    "Nobody on the island remembered a winter as mild as this one, not even the oldest baker.",
    "By noon the market filled with voices, bargaining over apples, wool and freshly smoked fish.",
]


def _text(chars: int) -> str:
    text, i = "", 0
    while len(text) < chars:
        text += SENTENCES[i % len(SENTENCES)] + " "
        i += 1
    return text[: chars - 1].rstrip() + "."


def _engine(**settings) -> Engine:
    tiny = ensure_tiny_checkpoint()
    return Engine(
        EngineConfig(checkpoint=str(tiny), device="cpu", generation=GenerationConfig(num_step=1), **settings)
    )


def _budget(engine: Engine) -> int:
    return min(engine.cfg.max_batch_tokens, max(engine.cfg.buckets))


def _packed(sizes: list[tuple[int, int, int]]) -> list[int]:
    return [text + ref + 2 * target for text, ref, target in sizes]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return _engine()


def _plan(engine: Engine, row: ManifestRow):
    cfg = engine.cfg
    size = FrontendSizer(engine.requests, [row], workers=1)(row)
    return make_plan(
        [row], [], {row.id: size}, {"v": {row.id: "key"}}, cfg.buckets, cfg.max_batch_tokens, 65536, 64
    )


@pytest.mark.parametrize("clip", [True, False])
def test_a_text_of_max_text_chars_is_planned_by_its_largest_chunk(engine, clip):
    text = _text(engine.cfg.max_text_chars)
    row = ManifestRow(0, "long", text, CLIP if clip else None, TRANSCRIPT if clip else None)
    plan = _plan(engine, row)
    assert not plan.rejected, plan.rejected[0].reason
    (planned,) = plan.shards[0].rows
    prepared = engine.prepare(SynthRequest(text=text, ref_audio=row.ref_audio, ref_text=row.ref_text))
    packed = _packed(engine.requests.chunk_sizes(prepared))
    assert len(packed) > 1 and planned.packed_tokens == max(packed) <= _budget(engine)
    assert plan.shards[0].tokens == sum(packed)  # a shard is still cut by the work of all its chunks


def test_a_text_of_max_text_chars_is_synthesized_in_chunks(engine):
    req = SynthRequest(text=_text(engine.cfg.max_text_chars), seed=3)
    prepared = engine.prepare(req)
    (out,) = engine.synthesize([req])
    assert out.target_frames == sum(c.target_frames for c in prepared.chunks)
    assert len(out.audio) > out.target_frames * engine.codec.hop_length // 2


@pytest.mark.parametrize("clip", [True, False])
def test_every_chunk_fits_a_small_budget_even_a_sentence_without_punctuation(clip):
    engine = _engine(buckets=(256, 512), max_batch_tokens=1024)
    words = " ".join(s.rstrip(".").replace(",", "") for s in SENTENCES * 3)  # one sentence, no stops
    ref = {"ref_audio": CLIP, "ref_text": TRANSCRIPT} if clip else {}
    for text in (_text(1500), words):
        prepared = engine.prepare(SynthRequest(text=text, **ref))
        assert max(_packed(engine.requests.chunk_sizes(prepared))) <= 512
        assert "".join(c.text for c in prepared.chunks).replace(" ", "") == text.replace(" ", "")


def test_a_request_says_whether_the_token_budget_cut_it(engine):
    """Only a cut the budget (a run setting) forced is flagged: a long text's cut by its length is not."""
    small = _engine(buckets=(256, 512), max_batch_tokens=1024)
    by_length = engine.prepare(SynthRequest(text=_text(engine.cfg.max_text_chars)))
    assert len(by_length.chunks) > 1 and not by_length.cut_to_budget
    for text in (_text(1500), _text(300)):  # a long text cut finer, a short one cut at all
        assert small.prepare(SynthRequest(text=text, ref_audio=CLIP, ref_text=TRANSCRIPT)).cut_to_budget
    assert not small.prepare(SynthRequest(text="Hello.", ref_audio=CLIP, ref_text=TRANSCRIPT)).cut_to_budget


def test_a_row_whose_chunks_cannot_fit_is_rejected_with_the_numbers():
    engine = _engine(buckets=(64,), max_batch_tokens=64)  # less than the reference clip alone
    plan = _plan(engine, ManifestRow(0, "long", _text(400), CLIP, TRANSCRIPT))
    (rejected,) = plan.rejected
    assert "row's largest text chunk needs" in rejected.reason and "engine limit of 64" in rejected.reason


def test_the_engine_cuts_its_batches_to_the_token_budget(monkeypatch):
    """Requests that each fit the budget but not together: every generation the engine runs holds at most
    the budget (the largest bucket here, under max_batch_tokens), as the planner's batches do."""
    engine = _engine(buckets=(256, 512), max_batch_tokens=4096)
    packed_batches = []
    pack = engine.runner.pack
    monkeypatch.setattr(
        engine.runner,
        "pack",
        lambda items: (packed_batches.append(sum(map(packed_tokens, items))), pack(items))[1],
    )
    engine.synthesize([SynthRequest(text=SENTENCES[i % 4], seed=i) for i in range(8)])
    assert sum(packed_batches) > _budget(engine) >= max(packed_batches)
