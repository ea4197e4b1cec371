"""Error text for one-line messages and result rows."""


def first_line_of(text: str, limit: int = 300) -> str:
    """The first non-empty line of `text`, at most `limit` characters."""
    lines = text.strip().splitlines()
    return lines[0][:limit] if lines else ""


def first_line(e: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message (at most `limit` characters), or its type's name."""
    return first_line_of(str(e), limit) or type(e).__name__
