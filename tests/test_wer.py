"""WER/CER arithmetic on known strings: the normaliser, the edit distance, pooled rates."""

import itertools
import random

import pytest

from pipeline.wer import ErrorCounts, edit_distance, error_counts, normalize, pooled


def _distance_by_table(a, b) -> int:
    """The textbook full-table Levenshtein distance, to check the vectorised one against."""
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i, j in itertools.product(range(1, len(a) + 1), range(1, len(b) + 1)):
        d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
    return d[-1][-1]


@pytest.mark.parametrize(
    ("text", "normal"),
    [
        ("The cat sat on the mat.", "the cat sat on the mat"),
        ("  Hello,   WORLD!! ", "hello world"),
        ("Don't stop \u2014 it's well-known.", "dont stop its well known"),
        ("\u00abÇa va?\u00bb dit-il.", "ça va dit il"),
        ("...", ""),
    ],
)
def test_normalize_lowercases_and_strips_punctuation(text: str, normal: str):
    assert normalize(text) == normal


@pytest.mark.parametrize(
    ("reference", "transcript", "word_errors", "ref_words", "char_errors", "ref_chars"),
    [
        # one substitution of six words; "the" -> "a" is three character edits of 22 characters
        ("The cat sat on the mat.", "the cat sat on a mat", 1, 6, 3, 22),
        # an insertion: "there " is six characters
        ("Hello world", "hello there world", 1, 2, 6, 11),
        # a deletion: "very " is five characters
        ("Thank you very much.", "thank you much", 1, 4, 5, 19),
        # nothing heard: every word and character deleted
        ("Good night.", "", 2, 2, 10, 10),
        # punctuation and case differences are not errors
        ("Well-known, isn't it?", "well known isnt it", 0, 4, 0, 18),
        # more words heard than said: WER above 1
        ("Yes.", "no no no", 3, 1, 8, 3),
    ],
)
def test_error_counts_on_known_strings(reference, transcript, word_errors, ref_words, char_errors, ref_chars):
    counts = error_counts(reference, transcript)
    assert counts == ErrorCounts(word_errors, ref_words, char_errors, ref_chars)
    assert counts.wer == pytest.approx(word_errors / ref_words)
    assert counts.cer == pytest.approx(char_errors / ref_chars)


def test_golden_rates():
    c = error_counts("The cat sat on the mat.", "the cat sat on a mat")
    assert c.wer == pytest.approx(1 / 6) and c.cer == pytest.approx(3 / 22)
    assert error_counts("Hello world", "Hello world!").wer == 0.0


def test_pooled_rates_weigh_rows_by_their_length():
    short = error_counts("Yes.", "no")  # 1 error in 1 word
    long = error_counts(
        "one two three four five six seven eight nine", "one two three four five six seven eight nine"
    )
    total = pooled([short, long])
    assert total.wer == pytest.approx(1 / 10)  # not the mean of the row rates (0.5)
    assert pooled([]).wer is None and error_counts("...", "x").wer is None


def test_edit_distance_matches_the_full_table():
    rng = random.Random(0)
    for _ in range(500):
        a = [rng.choice("abc") for _ in range(rng.randint(0, 8))]
        b = [rng.choice("abc") for _ in range(rng.randint(0, 8))]
        assert edit_distance(a, b) == _distance_by_table(a, b), (a, b)
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance(["a", "b"], ["a", "b"]) == 0


def test_edit_distance_of_long_texts_is_quick():
    import time

    t0 = time.perf_counter()
    assert edit_distance("x" * 4000, "y" * 2000 + "x" * 2000) == 2000
    assert time.perf_counter() - t0 < 10  # a pure-Python table would take minutes
