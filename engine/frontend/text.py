"""Text side of a request: the tokenizer, OmniVoice's prompt layout, text cleaning, languages.

The prompt of one request is
    [<|denoise|>]<|lang_start|>{language id or None}<|lang_end|>
    <|instruct_start|>{instruct or None}<|instruct_end|>
    <|text_start|>{reference text + " " + text, cleaned}<|text_end|>
tokenized the way upstream's Hugging Face tokenizer call does it: the style part as one string with
the tokenizer's own special-token handling, the text part piece by piece with non-verbal tags such
as "[laughter]" tokenized on their own so their ids do not depend on the neighbouring text.
"""

from __future__ import annotations

import csv
import difflib
import re
from functools import cache
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer

from engine.errors import InputError, TokenizerError
from engine.frontend.instruct import has_chinese, resolve_instruct

__all__ = [
    "TextFrontend",
    "add_punctuation",
    "combine_text",
    "has_chinese",
    "resolve_instruct",
    "resolve_language",
]

# Special tokens of OmniVoice's prompt format, added to the Qwen3 tokenizer when the model was trained.
OMNIVOICE_SPECIAL_TOKENS = (
    "<|denoise|>",
    "<|lang_start|>",
    "<|lang_end|>",
    "<|instruct_start|>",
    "<|instruct_end|>",
    "<|text_start|>",
    "<|text_end|>",
)

# Non-verbal tags the model was trained with (upstream's list).
NONVERBAL_TAGS = (
    "laughter", "sigh", "confirmation-en", "question-en", "question-ah", "question-oh",
    "question-ei", "question-yi", "surprise-ah", "surprise-oh", "surprise-wa", "surprise-yo",
    "dissatisfaction-hnn",
)  # fmt: skip
_NONVERBAL_TAG = re.compile(r"\[(?:" + "|".join(re.escape(t) for t in NONVERBAL_TAGS) + r")\]")

_LINE_BREAKS = re.compile(r"[\r\n]+")
_SPACE_RUNS = re.compile(r"[ \t]+")
_SPACE_BY_CHINESE = re.compile(r"(?<=[\u4e00-\u9fff])\s+|\s+(?=[\u4e00-\u9fff])")

# A reference text ending in none of these gets a full stop (upstream's list; "……" is covered by "…").
_END_PUNCTUATION = frozenset(";:,.!?…)]}\"'“”‘’；：，。！？、）】")


def combine_text(text: str, ref_text: str | None = None) -> str:
    """The reference text joined to the text and cleaned as upstream does before tokenizing.

    Line breaks are dropped (not replaced by spaces), full-width parentheses become ASCII ones, runs of
    spaces and tabs become one space, and whitespace next to a Chinese character is removed.
    """
    joined = f"{ref_text.strip()} {text.strip()}" if ref_text else text.strip()
    joined = _LINE_BREAKS.sub("", joined)
    joined = joined.replace("（", "(").replace("）", ")")
    joined = _SPACE_RUNS.sub(" ", joined)
    return _SPACE_BY_CHINESE.sub("", joined)


def add_punctuation(text: str) -> str:
    """Strip text and end it with '。' (Chinese text) or '.' when it lacks closing punctuation."""
    text = text.strip()
    if not text or text[-1] in _END_PUNCTUATION:
        return text
    return text + ("。" if has_chinese(text) else ".")


@cache
def _language_table() -> tuple[frozenset[str], dict[str, str], dict[str, str]]:
    """(language ids, lower-case name -> id, id -> display name) from languages.tsv."""
    with resources.files("engine.frontend").joinpath("languages.tsv").open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    ids = frozenset(r["language_id"] for r in rows)
    by_name = {r["language_name"].lower(): r["language_id"] for r in rows}
    names = {r["language_id"]: r["language_name"] for r in rows}
    return ids, by_name, names


def resolve_language(name_or_code: str | None) -> str | None:
    """A language id from an id (exact case, e.g. 'en') or a name (any case, e.g. 'english').

    None or 'none' (any case) means language-agnostic and gives None. Upstream falls back to None for
    an unknown language with a warning; here an unknown language is an InputError naming the closest
    names and ids.
    """
    if name_or_code is None:
        return None
    if not isinstance(name_or_code, str):
        raise InputError(f"language {name_or_code!r} is not a string: pass an id such as 'en' or a name.")
    if name_or_code.lower() == "none":
        return None
    ids, by_name, names = _language_table()
    if name_or_code in ids:
        return name_or_code
    if name_or_code.lower() in by_name:
        return by_name[name_or_code.lower()]
    close = difflib.get_close_matches(name_or_code.lower(), [*by_name, *sorted(ids)], n=4, cutoff=0.6)
    suggestions = dict.fromkeys(
        f"{names[c]} ({c})" if c in ids else f"{names[by_name[c]]} ({by_name[c]})" for c in close
    )
    hint = f" Did you mean: {', '.join(suggestions)}?" if suggestions else ""
    raise InputError(
        f"language {name_or_code!r} is not recognized.{hint} Pass a language id exactly as listed "
        "(e.g. 'en', 'zh', 'ja', 'de'), a language name in any case (e.g. 'English', 'chinese'), or "
        "None for language-agnostic synthesis; the full list is engine/frontend/languages.tsv."
    )


class TextFrontend:
    """Tokenizer wrapper building OmniVoice prompts from a checkpoint's tokenizer.json.

    Special-token handling comes from tokenizer.json's post-processor, as in transformers' fast
    tokenizer for Qwen2/Qwen3 (whose post-processor adds nothing: no bos, no eos).
    """

    def __init__(self, tokenizer_json: Path):
        path = Path(tokenizer_json)
        if not path.is_file():
            raise TokenizerError(
                f"{path} not found: a checkpoint directory needs the text tokenizer's tokenizer.json "
                "(copy it from the official k2-fsa/OmniVoice checkpoint)."
            )
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:
            raise TokenizerError(
                f"{path} is not a tokenizer.json the tokenizers library can read ({e}): replace the file."
            ) from e
        added = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        missing = [t for t in OMNIVOICE_SPECIAL_TOKENS if t not in added]
        if missing:
            raise TokenizerError(
                f"{path} lacks the OmniVoice special tokens {missing}. Use the tokenizer.json shipped with "
                "an OmniVoice checkpoint, or add these tokens as special added tokens (all seven: "
                f"{', '.join(OMNIVOICE_SPECIAL_TOKENS)})."
            )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        """Text of ids, special tokens included (for inspection and tests)."""
        return self._tok.decode(ids, skip_special_tokens=False)

    def _encode_with_standalone_tags(self, text: str) -> list[int]:
        ids: list[int] = []
        start = 0
        for m in _NONVERBAL_TAG.finditer(text):
            for piece in (text[start : m.start()], m.group()):
                if piece:
                    ids += self.encode(piece, add_special_tokens=False)
            start = m.end()
        if start < len(text):
            ids += self.encode(text[start:], add_special_tokens=False)
        return ids

    def prompt_ids(
        self,
        text: str,
        ref_text: str | None,
        language: str | None,
        instruct: str | None,
        denoise: bool,
        has_ref: bool,
    ) -> list[int]:
        """Token ids of the style + text prompt, exactly as upstream builds them.

        language: an id or name (resolved with resolve_language). instruct: already normalised by
        resolve_instruct(instruct, use_zh=has_chinese(<whole text>)); it is not re-resolved here, as a
        chunk of a long text must keep the instruct resolved for the whole text. The <|denoise|> token
        is added only when denoise is on and a reference clip is given (has_ref).
        """
        if not text or not text.strip():
            raise InputError(f"text {text!r} is empty or whitespace only: give the words to speak.")
        language = resolve_language(language)
        instruct = instruct or None
        if instruct is not None and resolve_instruct(instruct, use_zh=has_chinese(instruct)) != instruct:
            raise InputError(
                f"instruct {instruct!r} is not normalised: pass resolve_instruct(instruct, "
                "use_zh=has_chinese(text)) to prompt_ids."
            )
        style = "<|denoise|>" if denoise and has_ref else ""
        style += f"<|lang_start|>{language or 'None'}<|lang_end|>"
        style += f"<|instruct_start|>{instruct or 'None'}<|instruct_end|>"
        wrapped = f"<|text_start|>{combine_text(text, ref_text)}<|text_end|>"
        return self.encode(style, add_special_tokens=True) + self._encode_with_standalone_tags(wrapped)
