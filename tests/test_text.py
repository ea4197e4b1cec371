import json
import random
from types import SimpleNamespace

import pytest

from engine.errors import InputError, TokenizerError
from engine.frontend.instruct import VALID_ITEMS, has_chinese
from engine.frontend.text import (
    NONVERBAL_TAGS,
    OMNIVOICE_SPECIAL_TOKENS,
    TextFrontend,
    _language_table,
    add_punctuation,
    combine_text,
    resolve_instruct,
    resolve_language,
)
from engine.tiny.tokenizer import write_tiny_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def fe(tok_dir):
    return TextFrontend(tok_dir / "tokenizer.json")


def _random_text(rng: random.Random, n: int) -> str:
    pieces = list("abcdefghij ABC   .,;!?你好世界。，（）\n\t") + ["\r\n", "  "]
    pieces += [f"[{t}]" for t in NONVERBAL_TAGS[:4]] + ["[notatag]", "[laughter"]
    return "".join(rng.choice(pieces) for _ in range(n))


# ---------------------------------------------------------------- prompt layout


def test_prompt_layout_with_reference(fe):
    instruct = "female, british accent"
    ids = fe.prompt_ids("Hello there", "This is me.", "en", instruct, denoise=True, has_ref=True)
    assert fe.decode(ids) == (
        "<|denoise|><|lang_start|>en<|lang_end|><|instruct_start|>female, british accent<|instruct_end|>"
        "<|text_start|>This is me. Hello there<|text_end|>"
    )
    # Token by token: special tokens are single ids, the pieces between them are encoded on their own.
    sp = {t: fe.encode(t, add_special_tokens=False)[0] for t in OMNIVOICE_SPECIAL_TOKENS}
    expected = [sp["<|denoise|>"], sp["<|lang_start|>"], *fe.encode("en", False), sp["<|lang_end|>"]]
    expected += [sp["<|instruct_start|>"], *fe.encode(instruct, False), sp["<|instruct_end|>"]]
    expected += [sp["<|text_start|>"], *fe.encode("This is me. Hello there", False), sp["<|text_end|>"]]
    assert ids == expected


def test_prompt_layout_without_reference(fe):
    # The denoise token needs a reference clip; no language or instruct is written as "None".
    for denoise in (True, False):
        ids = fe.prompt_ids("  Hi  ", None, None, None, denoise=denoise, has_ref=False)
        assert fe.decode(ids) == (
            "<|lang_start|>None<|lang_end|><|instruct_start|>None<|instruct_end|><|text_start|>Hi<|text_end|>"
        )
    ids = fe.prompt_ids("Hi", "Ref.", "Chinese", None, denoise=False, has_ref=True)
    assert fe.decode(ids).startswith("<|lang_start|>zh<|lang_end|>")


def test_nonverbal_tags_are_tokenized_on_their_own(fe):
    ids = fe.prompt_ids("Hello [laughter] world[sigh]!", None, None, None, False, False)
    ts, te = fe.encode("<|text_start|>", False), fe.encode("<|text_end|>", False)
    text_part = ids[ids.index(ts[0]) :]
    expected = ts + fe.encode("Hello ", False) + fe.encode("[laughter]", False) + fe.encode(" world", False)
    expected += fe.encode("[sigh]", False) + fe.encode("!", False) + te
    assert text_part == expected
    # Whole-string encoding would merge the space before the tag into one token with "[".
    naive = fe.encode("<|text_start|>Hello [laughter] world[sigh]!<|text_end|>", False)
    assert naive != text_part
    # An unknown bracketed word is plain text.
    ids = fe.prompt_ids("a [notatag] b", None, None, None, False, False)
    assert ids[ids.index(ts[0]) :] == fe.encode("<|text_start|>a [notatag] b<|text_end|>", False)


def test_empty_text_is_refused(fe):
    for text in ["", "   ", "\n\t"]:
        with pytest.raises(InputError, match="empty"):
            fe.prompt_ids(text, None, None, None, True, False)


def test_prompt_wants_resolved_instruct_and_known_language(fe):
    with pytest.raises(InputError, match="resolve_instruct"):
        fe.prompt_ids("hi", None, None, "Male,low pitch", True, False)
    with pytest.raises(InputError, match="Englsh"):
        fe.prompt_ids("hi", None, "Englsh", None, True, False)


# ---------------------------------------------------------------- tokenizer checks


def test_missing_special_tokens_named(tok_dir, tmp_path):
    data = json.loads((tok_dir / "tokenizer.json").read_text())
    dropped = ("<|denoise|>", "<|text_end|>")
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] not in dropped]
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(TokenizerError) as e:
        TextFrontend(tmp_path / "tokenizer.json")
    assert "<|denoise|>" in str(e.value) and "<|text_end|>" in str(e.value)
    assert "<|lang_start|>" not in str(e.value).split("lacks")[1].split("]")[0]


def test_unreadable_tokenizer(tmp_path):
    with pytest.raises(TokenizerError, match="not found"):
        TextFrontend(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizers library"):
        TextFrontend(tmp_path / "tokenizer.json")


# ---------------------------------------------------------------- text cleaning


@pytest.mark.parametrize(
    ("text", "ref", "expected"),
    [
        ("Hello\nworld", None, "Helloworld"),  # line breaks are dropped, not replaced by spaces
        ("a\r\n\r\nb", None, "ab"),
        ("  a   b\t\tc  ", None, "a b c"),
        ("（括号）and (these)", None, "(括号)and (these)"),
        ("你 好 world 世界", None, "你好world世界"),
        ("text", "  ref text ", "ref text text"),
        ("text", "", "text"),
        ("ok ， 好", "参考。", "参考。 ok ，好"),  # only whitespace touching a CJK ideograph goes
        ("x\u3000y", None, "x\u3000y"),  # ideographic space is not a space/tab run
    ],
)
def test_combine_text(text, ref, expected):
    assert combine_text(text, ref) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Hello world", "Hello world."),
        ("  Hello world  ", "Hello world."),
        ("你好世界", "你好世界。"),
        ("mixed 你好 text", "mixed 你好 text。"),
        ("Done!", "Done!"),
        ("好了……", "好了……"),
        ("quote”", "quote”"),
        ("list、", "list、"),
        ("", ""),
        ("   ", ""),
        ("ends with digit 5", "ends with digit 5."),
    ],
)
def test_add_punctuation(text, expected):
    assert add_punctuation(text) == expected


# ---------------------------------------------------------------- languages


def test_languages_by_code_and_name():
    assert resolve_language("en") == "en"
    assert resolve_language("zh") == "zh"
    assert resolve_language("English") == "en"
    assert resolve_language("ENGLISH") == "en"
    assert resolve_language("chinese") == "zh"
    assert resolve_language("Western Frisian") == "fy"
    assert resolve_language(None) is None
    assert resolve_language("None") is None and resolve_language("NONE") is None


def test_every_table_row_resolves():
    import csv
    from importlib import resources

    with resources.files("engine.frontend").joinpath("languages.tsv").open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    assert len(rows) == 646
    for r in rows:
        assert resolve_language(r["language_id"]) == r["language_id"]
        assert resolve_language(r["language_name"]) == r["language_id"]
        assert resolve_language(r["language_name"].lower()) == r["language_id"]


@pytest.mark.parametrize(
    ("bad", "suggestion"),
    [
        ("Englsh", "English (en)"),
        ("EN", "English (en)"),
        ("chinse", "Chinese (zh)"),
        ("Japanes", "Japanese (ja)"),
    ],
)
def test_unknown_language_suggests(bad, suggestion):
    with pytest.raises(InputError) as e:
        resolve_language(bad)
    assert repr(bad) in str(e.value) and suggestion in str(e.value)


def test_language_suggestions_all_read_name_then_id():
    # 'eng' is close to ids (ng, en) and names alike: every suggestion is written "Name (id)"
    _, _, names = _language_table()
    with pytest.raises(InputError) as e:
        resolve_language("eng")
    suggestions = str(e.value).split("Did you mean: ")[1].split("?")[0].split(", ")
    assert len(suggestions) > 1
    assert all(s in {f"{name} ({code})" for code, name in names.items()} for s in suggestions), suggestions


def test_unknown_language_without_close_match():
    with pytest.raises(InputError, match="not recognized") as e:
        resolve_language("qqqqqqqqqq")
    assert "Did you mean" not in str(e.value)


def test_non_string_language_and_instruct_are_refused_by_value():
    with pytest.raises(InputError, match="language 5 is not a string"):
        resolve_language(5)
    with pytest.raises(InputError, match=r"instruct \['male'\] is not a string"):
        resolve_instruct(["male"], False)


# ---------------------------------------------------------------- instructs


def test_instruct_normalisation():
    assert resolve_instruct(None, False) is None
    assert resolve_instruct("  ", True) is None
    assert resolve_instruct("Male", False) == "male"
    assert resolve_instruct(" Female ,LOW PITCH,, ", False) == "female, low pitch"
    assert resolve_instruct("female，low pitch", False) == "female, low pitch"  # full-width comma in English
    assert resolve_instruct("男,低音调", True) == "男，低音调"  # half-width comma in Chinese
    assert resolve_instruct(",whisper,", False) == "whisper"


def test_instruct_language_unification():
    assert resolve_instruct("male, elderly", True) == "男，老年"  # Chinese text -> Chinese items
    assert resolve_instruct("男，老年", False) == "male, elderly"  # English text -> English items
    assert resolve_instruct("male, 四川话", False) == "男，四川话"  # a dialect forces Chinese
    # An accent forces English.
    assert resolve_instruct("女，british accent", True) == "female, british accent"
    assert resolve_instruct("chinese accent", True) == "chinese accent"


def test_instruct_errors():
    with pytest.raises(InputError, match="did you mean 'male'"):
        resolve_instruct("mail, low pitch", False)
    with pytest.raises(InputError, match="did you mean 'british accent'"):
        resolve_instruct("britsh accent", False)
    with pytest.raises(InputError, match="'robot voice' \\(unsupported\\)"):
        resolve_instruct("robot voice", False)
    with pytest.raises(InputError, match="dialect"):
        resolve_instruct("河南话, indian accent", False)
    with pytest.raises(InputError, match="'male' vs 'female'"):
        resolve_instruct("male, female", False)
    with pytest.raises(InputError, match="'男' vs '女'"):
        resolve_instruct("male, 女", True)  # a conflict seen after unification
    with pytest.raises(InputError, match="conflicting"):
        resolve_instruct("american accent, british accent", False)


def test_has_chinese():
    assert has_chinese("abc 中 def") and not has_chinese("abc") and not has_chinese(None)
    assert not has_chinese("ひらがな")


# ---------------------------------------------------------------- against upstream (omnivoice importable)


@pytest.fixture(scope="module")
def upstream():
    pytest.importorskip("omnivoice")
    import omnivoice.models.omnivoice as m
    import omnivoice.utils.text as t

    return SimpleNamespace(model=m, text=t)


@pytest.mark.official
def test_upstream_combine_text_and_add_punctuation(upstream):
    rng = random.Random(0)
    for _ in range(500):
        text, ref = _random_text(rng, rng.randint(1, 30)), rng.choice([None, "", _random_text(rng, 10)])
        assert combine_text(text, ref) == upstream.model._combine_text(text, ref)
        assert add_punctuation(text) == upstream.text.add_punctuation(text)


@pytest.mark.official
def test_upstream_language_resolution(upstream):
    from omnivoice.utils.lang_map import LANG_IDS, LANG_NAME_TO_ID

    queries = sorted(LANG_IDS) + list(LANG_NAME_TO_ID) + [n.upper() for n in LANG_NAME_TO_ID]
    queries += [None, "none", "None", "English"]
    for q in queries:
        assert resolve_language(q) == upstream.model._resolve_language(q), q
    for q in ["eng", "EN", "Englsh", "zh-CN"]:  # upstream warns and gives None; we refuse
        assert upstream.model._resolve_language(q) is None
        with pytest.raises(InputError):
            resolve_language(q)
    rng = random.Random(1)
    for name in rng.sample(sorted(LANG_NAME_TO_ID), 50):  # near misses: upstream warns and gives None
        bad = name[:-1] + "q" + name[-1] if len(name) > 2 else name + "qq"
        if upstream.model._resolve_language(bad) is None:
            with pytest.raises(InputError):
                resolve_language(bad)


@pytest.mark.official
def test_upstream_instruct_resolution(upstream):
    rng = random.Random(2)
    items = list(VALID_ITEMS) + ["Male", "FEMALE", "mail", "britsh accent", "robot"]
    for _ in range(1500):
        chosen = rng.sample(items, rng.randint(1, 4))
        sep = rng.choice([", ", ",", "，", " , ", "，  "])
        instruct = rng.choice(["", " ", ","]) + sep.join(chosen) + rng.choice(["", ",", " "])
        use_zh = rng.random() < 0.5
        try:
            expected = upstream.model._resolve_instruct(instruct, use_zh=use_zh)
        except ValueError:
            with pytest.raises(InputError):
                resolve_instruct(instruct, use_zh)
            continue
        assert resolve_instruct(instruct, use_zh) == expected, instruct


@pytest.mark.official
def test_upstream_prompt_ids(upstream, tok_dir, fe):
    import torch
    from transformers import AutoTokenizer

    fake = SimpleNamespace(
        text_tokenizer=AutoTokenizer.from_pretrained(str(tok_dir)),
        config=SimpleNamespace(num_audio_codebook=2, audio_mask_id=1024),
        device="cpu",
    )
    rng = random.Random(3)
    for _ in range(200):
        text = _random_text(rng, rng.randint(1, 40))
        if not text.strip():
            continue
        ref_text = rng.choice([None, _random_text(rng, 15)])
        has_ref = rng.random() < 0.5
        lang = rng.choice([None, "en", "zh", "de"])
        instruct = rng.choice([None, "female, low pitch", "男，河南话"])
        denoise = rng.random() < 0.5
        ref_tokens = torch.zeros(2, 3, dtype=torch.long) if has_ref else None
        out = upstream.model.OmniVoice._prepare_inference_inputs(
            fake,
            text,
            4,
            ref_text=ref_text,
            ref_audio_tokens=ref_tokens,
            lang=lang,
            instruct=instruct,
            denoise=denoise,
        )
        n_audio = int(out["audio_mask"].sum())
        expected = out["input_ids"][0, 0, : out["input_ids"].shape[-1] - n_audio].tolist()
        assert fe.prompt_ids(text, ref_text, lang, instruct, denoise, has_ref) == expected
