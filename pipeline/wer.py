"""Word and character error rates of a transcript against the text that was synthesized.

Both texts are normalised first (`normalize`): case folded, apostrophes dropped ("don't" = "dont"), other
punctuation replaced by spaces ("well-known" = "well known"), runs of whitespace collapsed.
WER = word edit distance / reference words; CER = character edit distance / reference characters, over
the normalised strings with their single spaces. A rate over many rows is the sum of their edits over the
sum of their reference lengths, so that long rows weigh as they should. For languages written without
spaces WER counts a whole sentence as one word: read CER there.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

APOSTROPHES = frozenset("'\u2019\u02bc")


def normalize(text: str) -> str:
    """Lower case; apostrophes dropped, other punctuation (Unicode categories P*) as spaces; whitespace
    collapsed."""
    folded = unicodedata.normalize("NFKC", text).casefold()
    spaced = "".join(
        "" if ch in APOSTROPHES else " " if unicodedata.category(ch).startswith("P") else ch for ch in folded
    )
    return " ".join(spaced.split())


def edit_distance(ref: Sequence, hyp: Sequence) -> int:
    """Levenshtein distance (substitutions, deletions, insertions, each costing 1) between two sequences
    of hashable items."""
    if not ref or not hyp:
        return max(len(ref), len(hyp))
    codes: dict = {}
    r = np.array([codes.setdefault(x, len(codes)) for x in ref], dtype=np.int64)
    h = np.array([codes.setdefault(x, len(codes)) for x in hyp], dtype=np.int64)
    steps = np.arange(len(h) + 1, dtype=np.int64)
    row = steps.copy()  # distances from ref[:0] to every prefix of hyp
    for i, item in enumerate(r, start=1):
        # Without insertions: row[j] = min(above + 1, diagonal + cost). An insertion chain then gives
        # row[j] = min over k <= j of (row[k] + j - k), which a running minimum of row - steps computes.
        best = np.empty_like(row)
        best[0] = i
        best[1:] = np.minimum(row[1:] + 1, row[:-1] + (h != item))
        row = np.minimum.accumulate(best - steps) + steps
    return int(row[-1])


@dataclass(frozen=True)
class ErrorCounts:
    word_errors: int
    ref_words: int
    char_errors: int
    ref_chars: int

    @property
    def wer(self) -> float | None:
        return self.word_errors / self.ref_words if self.ref_words else None

    @property
    def cer(self) -> float | None:
        return self.char_errors / self.ref_chars if self.ref_chars else None


def error_counts(reference: str, transcript: str) -> ErrorCounts:
    ref, hyp = normalize(reference), normalize(transcript)
    return ErrorCounts(
        word_errors=edit_distance(ref.split(), hyp.split()),
        ref_words=len(ref.split()),
        char_errors=edit_distance(ref, hyp),
        ref_chars=len(ref),
    )


def pooled(counts: Sequence[ErrorCounts]) -> ErrorCounts:
    """The counts of many rows summed: its wer and cer are the rates over all of them."""
    return ErrorCounts(
        sum(c.word_errors for c in counts),
        sum(c.ref_words for c in counts),
        sum(c.char_errors for c in counts),
        sum(c.ref_chars for c in counts),
    )
