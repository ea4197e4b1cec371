"""Long texts: split at punctuation into chunks of about one chunk duration each, as upstream does.

A text whose target exceeds the threshold (30 s by default) is cut into sentences at punctuation
(not after abbreviations such as "Mr."), sentences are merged greedily up to a character budget
derived from the text's frames per character, and chunks under 3 characters join a neighbour.
Each chunk is then generated on its own; without a reference clip, the first chunk's audio serves as
the reference of all later chunks. Where a chunk would not fit the engine's token budget, the text is
cut again with half the characters per chunk, sentences longer than that cut between words (or inside a
word when one is longer), until every chunk fits or chunks are down to a few characters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.errors import InputError
from engine.frontend.duration import frames_at_speed

SPLIT_PUNCTUATION = frozenset(".,;:!?。，；：！？")
CLOSING_MARKS = frozenset("\"'“”‘’）]》>」】")
MIN_CHUNK_CHARS = 3

# A "." after these words does not end a sentence (upstream's list).
ABBREVIATIONS = frozenset(
    "Mr. Mrs. Ms. Dr. Prof. Sr. Jr. Rev. Fr. Hon. Pres. Gov. Capt. Gen. Sen. Rep. Col. Maj. Lt. Cmdr. "
    "Sgt. Cpl. Co. Corp. Inc. Ltd. Est. Dept. St. Ave. Blvd. Rd. Mt. Ft. No. Jan. Feb. Mar. Apr. Aug. "
    "Sep. Sept. Oct. Nov. Dec. i.e. e.g. vs. Vs. Etc. approx. fig. def.".split()
)


def needs_chunking(target_frames: int, threshold_s: float, frame_rate: float) -> bool:
    """True when the target is longer than threshold_s seconds (upstream's integer threshold)."""
    return target_frames > int(threshold_s * frame_rate)


def _ends_with_abbreviation(chars: list[str]) -> bool:
    words = "".join(chars).split()
    return bool(words) and words[-1] in ABBREVIATIONS


def _sentences(text: str) -> list[list[str]]:
    """Characters grouped into sentences; punctuation and closing marks after a cut join the left side."""
    sentences: list[list[str]] = []
    current: list[str] = []
    for ch in text:
        if not current and sentences and (ch in SPLIT_PUNCTUATION or ch in CLOSING_MARKS):
            sentences[-1].append(ch)
            continue
        current.append(ch)
        if ch in SPLIT_PUNCTUATION and not (ch == "." and _ends_with_abbreviation(current)):
            sentences.append(current)
            current = []
    if current:
        sentences.append(current)
    return sentences


def _words(chars: list[str]) -> list[list[str]]:
    """Characters grouped into words, each with the whitespace that follows it."""
    words: list[list[str]] = []
    for ch in chars:
        if not words or (words[-1][-1].isspace() and not ch.isspace()):
            words.append([])
        words[-1].append(ch)
    return words


def _cut_between_words(sentence: list[str], chunk_len: int) -> list[list[str]]:
    """A sentence as pieces of at most chunk_len (>= 1) characters, cut after whitespace where the words
    allow and inside a word longer than chunk_len."""
    pieces: list[list[str]] = []
    current: list[str] = []
    for word in _words(sentence):
        if current and len(current) + len(word) > chunk_len:
            pieces.append(current)
            current = []
        while len(word) > chunk_len:
            pieces.append(word[:chunk_len])
            word = word[chunk_len:]
        current += word
    if current:
        pieces.append(current)
    return pieces


def chunk_text_punctuation(
    text: str, chunk_len: int, min_chunk_len: int | None = None, cut_long_sentences: bool = False
) -> list[str]:
    """Split text at punctuation into chunks of at most chunk_len characters where sentences allow.

    A sentence longer than chunk_len stays whole (upstream's rule), unless cut_long_sentences: then it
    is cut between words. With min_chunk_len, a chunk shorter than it joins the previous chunk (the
    first chunk, when short, takes in the second). Chunks are stripped and empty ones dropped.
    """
    sentences = _sentences(text)
    if cut_long_sentences:
        sentences = [piece for s in sentences for piece in _cut_between_words(s, max(1, chunk_len))]
    merged: list[list[str]] = []
    current: list[str] = []
    for sentence in sentences:
        if len(current) + len(sentence) <= chunk_len:
            current.extend(sentence)
        else:
            if current:
                merged.append(current)
            current = sentence
    if current:
        merged.append(current)

    if min_chunk_len is not None:
        first_is_short = bool(merged) and len(merged[0]) < min_chunk_len
        joined: list[list[str]] = []
        for i, chunk in enumerate(merged):
            if (i == 1 and first_is_short) or (joined and len(chunk) < min_chunk_len):
                joined[-1].extend(chunk)
            else:
                joined.append(chunk)
        merged = joined

    return [s for s in ("".join(c).strip() for c in merged) if s]


def chunk_char_budget(text: str, target_frames: int, chunk_duration_s: float, frame_rate: float) -> int:
    """Characters per chunk so that a chunk lasts about chunk_duration_s at the text's frames per char."""
    frames_per_char = target_frames / len(text)
    return int(chunk_duration_s * frame_rate / frames_per_char)


@dataclass(frozen=True)
class Chunk:
    text: str
    target_frames: int
    # True: generated with the first chunk's audio and text as reference (requests without a clip).
    first_chunk_is_ref: bool


def plan_chunks(
    text: str,
    target_frames: int,
    ref_text: str | None,
    ref_frames: int | None,
    speed: float,
    chunk_duration_s: float,
    frame_rate: float,
    fits: Callable[[list[Chunk]], bool] = lambda chunks: True,
) -> list[Chunk]:
    """Chunks of a long text with their target frames, as upstream's chunked generation sizes them.

    target_frames: the whole text's target (after duration/speed overrides). speed: effective_speed()
    of the request. With a reference clip every chunk uses it; without one the first chunk is made
    without reference and every later chunk uses the first chunk (text and frames) as reference.
    fits(chunks) says whether every chunk fits the engine's token budget; while it does not, the text
    is cut again with half the characters per chunk, long sentences between words. The last cut is
    returned even if it does not fit (chunks of a few characters): the caller judges it.
    """
    chars = chunk_char_budget(text, target_frames, chunk_duration_s, frame_rate)
    texts = chunk_text_punctuation(text, chars, MIN_CHUNK_CHARS)
    if not texts:
        raise InputError(f"text {text!r} is empty or whitespace only: give the words to speak.")
    chunks = _sized_chunks(texts, ref_text, ref_frames, speed)
    cut = False
    while not fits(chunks) and not (cut and chars == MIN_CHUNK_CHARS):
        chars, cut = max(MIN_CHUNK_CHARS, chars // 2), True  # shorter chunks would join their neighbours
        texts = chunk_text_punctuation(text, chars, MIN_CHUNK_CHARS, cut_long_sentences=True)
        chunks = _sized_chunks(texts, ref_text, ref_frames, speed)
    return chunks


def _sized_chunks(
    texts: list[str], ref_text: str | None, ref_frames: int | None, speed: float
) -> list[Chunk]:
    """The chunks of `texts` (not empty) with their target frames (plan_chunks says their references)."""
    has_ref = ref_frames is not None
    first = Chunk(texts[0], frames_at_speed(texts[0], ref_text, ref_frames, speed), False)
    if has_ref:
        ref_text_later, ref_frames_later = ref_text, ref_frames
    else:
        ref_text_later, ref_frames_later = first.text, first.target_frames
    later = [
        Chunk(t, frames_at_speed(t, ref_text_later, ref_frames_later, speed), not has_ref) for t in texts[1:]
    ]
    return [first, *later]
