"""How many audio frames to generate for a text: upstream's rule-based estimate and its overrides.

Each character has a phonetic weight relative to one Latin letter (script by Unicode block, with
punctuation, spaces, digits and combining marks weighed apart). The reference clip gives the speaking
rate (weight per frame); the target text's weight at that rate is the estimate, boosted by a
power curve below 50 frames so very short texts are not cut short. A fixed duration replaces the
estimate; a speed factor divides it.
"""

from __future__ import annotations

import bisect
import math
import numbers
import unicodedata
from functools import lru_cache

from engine.errors import InputError

# Relative speaking time per character, by script class (upstream's table).
WEIGHTS = {
    "cjk": 3.0,
    "hangul": 2.5,
    "kana": 2.2,
    "ethiopic": 3.0,
    "yi": 3.0,
    "indic": 1.8,
    "thai_lao": 1.5,
    "khmer_myanmar": 1.8,
    "arabic": 1.5,
    "hebrew": 1.5,
    "latin": 1.0,
    "cyrillic": 1.0,
    "greek": 1.0,
    "armenian": 1.0,
    "georgian": 1.0,
    "punctuation": 0.5,
    "space": 0.2,
    "digit": 3.5,
    "mark": 0.0,
    "default": 1.0,
}

# Unicode blocks as (last code point, script class), ascending (upstream's table).
_BLOCKS = (
    (0x02AF, "latin"), (0x03FF, "greek"), (0x052F, "cyrillic"), (0x058F, "armenian"),
    (0x05FF, "hebrew"), (0x077F, "arabic"), (0x089F, "arabic"), (0x08FF, "arabic"),
    (0x097F, "indic"), (0x09FF, "indic"), (0x0A7F, "indic"), (0x0AFF, "indic"),
    (0x0B7F, "indic"), (0x0BFF, "indic"), (0x0C7F, "indic"), (0x0CFF, "indic"),
    (0x0D7F, "indic"), (0x0DFF, "indic"), (0x0EFF, "thai_lao"), (0x0FFF, "indic"),
    (0x109F, "khmer_myanmar"), (0x10FF, "georgian"), (0x11FF, "hangul"), (0x137F, "ethiopic"),
    (0x139F, "ethiopic"), (0x13FF, "default"), (0x167F, "default"), (0x169F, "default"),
    (0x16FF, "default"), (0x171F, "default"), (0x173F, "default"), (0x175F, "default"),
    (0x177F, "default"), (0x17FF, "khmer_myanmar"), (0x18AF, "default"), (0x18FF, "default"),
    (0x194F, "indic"), (0x19DF, "indic"), (0x19FF, "khmer_myanmar"), (0x1A1F, "indic"),
    (0x1AAF, "indic"), (0x1B7F, "indic"), (0x1BBF, "indic"), (0x1BFF, "indic"),
    (0x1C4F, "indic"), (0x1C7F, "indic"), (0x1C8F, "cyrillic"), (0x1CBF, "georgian"),
    (0x1CCF, "indic"), (0x1CFF, "indic"), (0x1D7F, "latin"), (0x1DBF, "latin"),
    (0x1DFF, "default"), (0x1EFF, "latin"), (0x309F, "kana"), (0x30FF, "kana"),
    (0x312F, "cjk"), (0x318F, "hangul"), (0x9FFF, "cjk"), (0xA4CF, "yi"),
    (0xA4FF, "default"), (0xA63F, "default"), (0xA69F, "cyrillic"), (0xA6FF, "default"),
    (0xA7FF, "latin"), (0xA82F, "indic"), (0xA87F, "default"), (0xA8DF, "indic"),
    (0xA8FF, "indic"), (0xA92F, "indic"), (0xA95F, "indic"), (0xA97F, "hangul"),
    (0xA9DF, "indic"), (0xA9FF, "khmer_myanmar"), (0xAA5F, "indic"), (0xAA7F, "khmer_myanmar"),
    (0xAADF, "indic"), (0xAAFF, "indic"), (0xAB2F, "ethiopic"), (0xAB6F, "latin"),
    (0xABBF, "default"), (0xABFF, "indic"), (0xD7AF, "hangul"), (0xFAFF, "cjk"),
    (0xFDFF, "arabic"), (0xFE6F, "default"), (0xFEFF, "arabic"), (0xFFEF, "latin"),
)  # fmt: skip
_BLOCK_ENDS = [end for end, _ in _BLOCKS]
_SUPPLEMENTARY_CJK_START = 0x20000  # code points above it (CJK Ext B and later) weigh as CJK

BOOST_BELOW_FRAMES = 50.0
BOOST_STRENGTH = 3.0

# Used when a request has no reference clip: this text takes 25 frames (upstream's choice).
FALLBACK_REF_TEXT = "Nice to meet you."
FALLBACK_REF_FRAMES = 25


@lru_cache(maxsize=4096)
def char_weight(ch: str) -> float:
    """Speaking time of one character relative to a Latin letter."""
    code = ord(ch)
    if 0x41 <= code <= 0x5A or 0x61 <= code <= 0x7A:
        return WEIGHTS["latin"]
    if code == 0x20:
        return WEIGHTS["space"]
    if code == 0x0640:  # Arabic tatweel only stretches the line
        return WEIGHTS["mark"]
    category = unicodedata.category(ch)
    if category[0] == "M":
        return WEIGHTS["mark"]
    if category[0] in "PS":
        return WEIGHTS["punctuation"]
    if category[0] == "Z":
        return WEIGHTS["space"]
    if category[0] == "N":
        return WEIGHTS["digit"]
    i = bisect.bisect_left(_BLOCK_ENDS, code)
    if i < len(_BLOCKS):
        return WEIGHTS[_BLOCKS[i][1]]
    return WEIGHTS["cjk"] if code > _SUPPLEMENTARY_CJK_START else WEIGHTS["default"]


def text_weight(text: str) -> float:
    return sum(char_weight(c) for c in text)


def estimate_frames(target_text: str, ref_text: str, ref_frames: float) -> float:
    """Rule-based frame estimate (a float) of target_text spoken at the reference's rate."""
    if ref_frames <= 0 or not ref_text:
        return 0.0
    ref_weight = text_weight(ref_text)
    if ref_weight == 0:
        return 0.0
    weight_per_frame = ref_weight / ref_frames
    frames = text_weight(target_text) / weight_per_frame
    if frames < BOOST_BELOW_FRAMES:
        return BOOST_BELOW_FRAMES * (frames / BOOST_BELOW_FRAMES) ** (1.0 / BOOST_STRENGTH)
    return frames


def _check_positive(name: str, value: float | None) -> None:
    if value is not None and not (isinstance(value, numbers.Real) and math.isfinite(value) and value > 0):
        raise InputError(f"{name}={value!r}: must be a finite number > 0 (or left unset).")


def frames_at_speed(text: str, ref_text: str | None, ref_frames: int | None, speed: float = 1.0) -> int:
    """Integer target frames at a speed factor; no reference means the fallback reference."""
    if ref_frames is None or not ref_text:
        ref_text, ref_frames = FALLBACK_REF_TEXT, FALLBACK_REF_FRAMES
    frames = estimate_frames(text, ref_text, ref_frames)
    if speed > 0 and speed != 1.0:
        frames = frames / speed
    return max(1, int(frames))


def estimate_target_frames(
    text: str,
    ref_text: str | None,
    ref_frames: int | None,
    speed: float | None = None,
    duration: float | None = None,
    frame_rate: float = 25,
) -> int:
    """Frames to generate for text: duration (seconds) when given, else the estimate divided by speed."""
    _check_positive("speed", speed)
    _check_positive("duration", duration)
    if duration is not None:
        return max(1, int(duration * frame_rate))
    return frames_at_speed(text, ref_text, ref_frames, 1.0 if speed is None else speed)


def effective_speed(
    text: str,
    ref_text: str | None,
    ref_frames: int | None,
    speed: float | None = None,
    duration: float | None = None,
    frame_rate: float = 25,
) -> float:
    """The speed factor that chunks of a long text are estimated with.

    With a fixed duration it is (estimate at speed 1) / (duration frames), so every chunk is
    stretched like the whole text; otherwise it is the requested speed (1.0 when unset).
    """
    if duration is None:
        _check_positive("speed", speed)
        return 1.0 if speed is None else speed
    target = estimate_target_frames(text, ref_text, ref_frames, speed, duration, frame_rate)
    return frames_at_speed(text, ref_text, ref_frames) / target
