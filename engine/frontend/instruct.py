"""Voice-design instruct strings: validation and normalisation with upstream's rules and outputs.

An instruct is a comma-separated list of speaker attributes ("female, low pitch, british accent" or
"女，低音调，河南话"). Items are matched case-insensitively, unified to one language (Chinese when the
text to speak is Chinese or a dialect is named, English when an accent is named) and checked for
conflicts: at most one item per category.
"""

from __future__ import annotations

import difflib
import re

from engine.errors import InputError

# Attribute categories (facts of the OmniVoice model's training labels). Paired categories map each
# English item to its Chinese equivalent; accents exist only in English, dialects only in Chinese.
_PAIRED_CATEGORIES: tuple[dict[str, str], ...] = (
    {"male": "男", "female": "女"},
    {"child": "儿童", "teenager": "少年", "young adult": "青年", "middle-aged": "中年", "elderly": "老年"},
    {
        "very low pitch": "极低音调",
        "low pitch": "低音调",
        "moderate pitch": "中音调",
        "high pitch": "高音调",
        "very high pitch": "极高音调",
    },
    {"whisper": "耳语"},
)
_ACCENTS = frozenset(
    f"{origin} accent"
    for origin in (
        "american", "british", "australian", "chinese", "canadian",
        "indian", "korean", "portuguese", "russian", "japanese",
    )
)  # fmt: skip
_DIALECTS = frozenset(
    f"{place}话"
    for place in (
        "河南", "陕西", "四川", "贵州", "云南", "桂林", "济南", "石家庄", "甘肃", "宁夏", "青岛", "东北",
    )
)  # fmt: skip

_EN_TO_ZH = {en: zh for cat in _PAIRED_CATEGORIES for en, zh in cat.items()}
_ZH_TO_EN = {zh: en for en, zh in _EN_TO_ZH.items()}
_EXCLUSIVE_GROUPS: tuple[frozenset[str], ...] = tuple(
    frozenset(cat) | frozenset(cat.values()) for cat in _PAIRED_CATEGORIES
) + (_ACCENTS, _DIALECTS)
VALID_ITEMS: tuple[str, ...] = tuple(sorted(set(_EN_TO_ZH) | set(_ZH_TO_EN) | _ACCENTS | _DIALECTS))

_CHINESE_CHAR = re.compile(r"[\u4e00-\u9fff]")
_ITEM_SEPARATOR = re.compile(r"\s*[,，]\s*")


def has_chinese(text: str | None) -> bool:
    """True when text holds a CJK unified ideograph (upstream's test for 'Chinese text')."""
    return bool(text) and _CHINESE_CHAR.search(text) is not None


def _unknown_items_message(instruct: str, unknown: list[tuple[str, str]]) -> str:
    lines = []
    for raw, item in unknown:
        close = difflib.get_close_matches(item, VALID_ITEMS, n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        lines.append(f"  '{raw}' (unsupported{hint})")
    english = ", ".join(i for i in VALID_ITEMS if not has_chinese(i))
    chinese = "，".join(i for i in VALID_ITEMS if has_chinese(i))
    return (
        f"instruct {instruct!r} has unsupported items:\n" + "\n".join(lines) + "\n"
        f"Valid English items: {english}\nValid Chinese items: {chinese}\n"
        "Use only English items separated by ', ' (e.g. 'male, indian accent') or only Chinese items "
        "separated by '，' (e.g. '男，河南话')."
    )


def resolve_instruct(instruct: str | None, use_zh: bool) -> str | None:
    """Normalise a voice-design instruct; None (or blank) means no instruct.

    use_zh: the text to speak is Chinese (see has_chinese); items are then written in Chinese unless
    an accent forces English. Raises InputError for unknown items (with the closest valid item),
    a dialect mixed with an accent, or two items of one category.
    """
    if instruct is not None and not isinstance(instruct, str):
        raise InputError(f"instruct {instruct!r} is not a string: pass comma-separated items, e.g. 'male'.")
    if instruct is None or not instruct.strip():
        return None
    stripped = instruct.strip()
    raw_items = [x for x in _ITEM_SEPARATOR.split(stripped) if x]

    items: list[str] = []
    unknown: list[tuple[str, str]] = []
    for raw in raw_items:
        item = raw.strip().lower()
        if item in _EN_TO_ZH or item in _ZH_TO_EN or item in _ACCENTS or item in _DIALECTS:
            items.append(item)
        else:
            unknown.append((raw, item))
    if unknown:
        raise InputError(_unknown_items_message(stripped, unknown))

    has_dialect = any(i in _DIALECTS for i in items)
    has_accent = any(i in _ACCENTS for i in items)
    if has_dialect and has_accent:
        raise InputError(
            f"instruct {stripped!r} mixes a Chinese dialect with an English accent: dialects are for "
            "Chinese speech, accents for English speech. Keep only one of them."
        )
    if has_dialect or has_accent:
        use_zh = has_dialect

    translate = _EN_TO_ZH if use_zh else _ZH_TO_EN
    items = [translate.get(i, i) for i in items]

    conflicts = [hits for group in _EXCLUSIVE_GROUPS if len(hits := [i for i in items if i in group]) > 1]
    if conflicts:
        described = "; ".join(" vs ".join(f"'{i}'" for i in hits) for hits in conflicts)
        raise InputError(
            f"instruct {stripped!r} has conflicting items: {described}. Each category (gender, age, "
            "pitch, style, accent, dialect) allows at most one item; drop the extra ones."
        )

    separator = "，" if any(has_chinese(i) for i in items) else ", "
    return separator.join(items)
