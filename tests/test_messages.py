"""One-line error text for the terminal and the results files."""

from pipeline.messages import first_line, first_line_of


def test_first_line_of_keeps_a_short_line_and_skips_blank_ones():
    assert first_line_of("\n\n  bad row: fix it\nTraceback ...") == "bad row: fix it"
    assert first_line_of("   ") == ""


def test_a_cut_line_says_it_was_cut():
    text = "x" * 50
    assert first_line_of(text, 50) == text
    assert first_line_of(text + "y", 50) == "x" * 47 + "..."


def test_an_exception_without_a_message_is_named_by_its_type():
    assert first_line(KeyError()) == "KeyError"
    assert first_line(ValueError("bad value\nmore")) == "bad value"
