"""Error text for one-line messages and result rows."""


def first_line(e: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message (at most `limit` characters), or its type's name."""
    lines = str(e).strip().splitlines()
    return lines[0][:limit] if lines else type(e).__name__
