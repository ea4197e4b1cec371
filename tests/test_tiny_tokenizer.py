import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from engine.frontend.text import NONVERBAL_TAGS, OMNIVOICE_SPECIAL_TOKENS, TextFrontend
from engine.tiny.tokenizer import QWEN_SPECIAL_TOKENS, write_tiny_tokenizer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(d)
    return d


def _digest(d: Path) -> str:
    files = (d / "tokenizer.json", d / "tokenizer_config.json")
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()


def test_same_bytes_in_another_process(tiny_dir, tmp_path):
    # Rust hash maps are seeded per process: determinism has to hold across processes.
    code = (
        "import sys; from pathlib import Path; "
        "from engine.tiny.tokenizer import write_tiny_tokenizer as w; w(Path(sys.argv[1]))"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, cwd=Path(__file__).parents[1])
    assert _digest(tmp_path) == _digest(tiny_dir)


def test_vocab_and_special_tokens(tiny_dir, tmp_path):
    n = write_tiny_tokenizer(tmp_path)
    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    assert n == tok.get_vocab_size(with_added_tokens=True)
    assert 512 <= n <= 1100
    added = {t.content: (i, t.special) for i, t in tok.get_added_tokens_decoder().items()}
    regular = tok.get_vocab_size(with_added_tokens=False)
    for t in QWEN_SPECIAL_TOKENS + OMNIVOICE_SPECIAL_TOKENS:
        i, special = added[t]
        assert special and i >= regular  # appended after the BPE vocabulary, as in the official one
    # Non-verbal tags are plain text, as in upstream.
    assert not any(f"[{tag}]" in added for tag in NONVERBAL_TAGS)


def test_byte_level_round_trip(tiny_dir):
    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    texts = ["Hello, world!  Two  spaces\nnew line", "你好，世界！今天天气很好。"]
    texts += ["emoji 🌍 and ü é", "[laughter] ok"]
    for text in texts:
        ids = tok.encode(text).ids
        assert tok.decode(ids) == text
    # Frequent Chinese characters became whole tokens (3 UTF-8 bytes merged).
    assert len(tok.encode("你好").ids) <= 2
    # Regular English is compressed below one token per byte.
    text = "The lighthouse keeper wrote one line in her log every evening."
    assert len(tok.encode(text).ids) < len(text) / 2


def test_tokenizer_config(tiny_dir):
    cfg = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    assert cfg["bos_token"] is None and "add_bos_token" not in cfg  # nothing is added around a text
    assert cfg["model_max_length"] == 131072
    assert cfg["tokenizer_class"] == "Qwen2Tokenizer"
    assert set(cfg["additional_special_tokens"]) == set(OMNIVOICE_SPECIAL_TOKENS)
    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    for i, entry in cfg["added_tokens_decoder"].items():
        assert tok.token_to_id(entry["content"]) == int(i)


def test_text_frontend_accepts_it(tiny_dir):
    fe = TextFrontend(tiny_dir / "tokenizer.json")
    assert fe.vocab_size == write_tiny_tokenizer(tiny_dir)


def test_transformers_tokenizes_identically(tiny_dir):
    # Upstream loads the tokenizer with transformers' AutoTokenizer; the ids must be the same.
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_dir))
    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    texts = [
        "<|denoise|><|lang_start|>en<|lang_end|><|instruct_start|>None<|instruct_end|>",
        "<|text_start|>It's 12.5 o'clock, [sigh] 你好！<|text_end|>",
        "  leading and trailing  ",
        "line\r\nbreaks\n\n and\ttabs",
    ]
    for text in texts:
        assert hf(text).input_ids == tok.encode(text).ids
        assert hf(text, add_special_tokens=False).input_ids == tok.encode(text, add_special_tokens=False).ids
