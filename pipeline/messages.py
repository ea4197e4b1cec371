"""Error text for one-line messages and result rows."""


def first_line_of(text: str, limit: int = 300) -> str:
    """The first non-empty line of `text`, at most `limit` characters; a cut line ends in "...", so that
    no one reads a cut-off word as the advice."""
    lines = text.strip().splitlines()
    if not lines:
        return ""
    line = lines[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."


def first_line(e: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message (at most `limit` characters), or its type's name."""
    return first_line_of(str(e), limit) or type(e).__name__
