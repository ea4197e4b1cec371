"""Train the tiny checkpoint's text tokenizer: a real byte-level BPE shaped like Qwen2/Qwen3's.

The official OmniVoice tokenizer is Qwen3's byte-level BPE with seven OmniVoice special tokens added
after the regular vocabulary. The tiny one has the same pipeline (NFC normalizer, Qwen2 split regex +
byte-level pre-tokenizer, byte-level decoder and post-processor), is trained on a small embedded
corpus and holds the same special tokens, so every text path of the engine runs against it.
Non-verbal tags such as "[laughter]" stay plain text, as upstream treats them.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer

from engine.frontend.text import OMNIVOICE_SPECIAL_TOKENS

# The pre-tokenization regex of Qwen2/Qwen3 tokenizers (a fact of their tokenizer.json).
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen's own special tokens that OmniVoice's tokenizer keeps (pad/eos); OmniVoice's seven follow them.
QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

TARGET_VOCAB_SIZE = 1024  # merges + byte alphabet, before the special tokens are appended

_CORPUS = """\
The lighthouse keeper wrote one line in her log every evening, whatever the weather did.
Some nights it was only the wind, the tide and the number of ships that passed the point.
On other nights she wrote about the gulls, the lamp, and the long silence after the storm.
When the supply boat came on Thursday, the captain read the log aloud and laughed at her jokes.
"You should print this," he said. "People would buy a book about weather and birds."
She told him that nobody reads about weather, and that the birds would want a share of the money.
Years later a student found the logs in a box, typed every page, and read them on the radio.
Listeners wrote letters asking whether the keeper was still alive, and where the island was.
The answer to the first question was yes; the answer to the second she kept to herself.
Good morning! Could you tell me how far it is to the station? About twenty minutes on foot.
Please speak a little more slowly, and say the number again: three, five, seven, nine.
I think the meeting starts at half past ten, but check the calendar before you leave.
Dr. Smith and Mr. Jones met Mrs. Brown at No. 12 Baker St. on Jan. 5, e.g. last winter.
What a surprise to see you here! Are you coming to the concert tonight, or staying in?
We measured the river twice a day for a whole year, and the water rose faster in spring.
Music, language and memory share a rhythm; a sentence is easier to remember when it sings.
The quick brown fox jumps over the lazy dog while the cat sleeps near the warm kitchen fire.
Voices differ in pitch, speed and colour, yet we recognise a friend after a single word.
A whisper can carry across a quiet room; a shout can vanish in a crowded market square.
Hello, world. Nice to meet you. Thank you very much, and see you tomorrow afternoon.
[laughter] That was funny. [sigh] It has been a long day. [confirmation-en] Right.
[question-en] Really? [question-ah] [question-oh] [question-ei] [question-yi] What do you mean?
[surprise-ah] [surprise-oh] [surprise-wa] [surprise-yo] Oh! [dissatisfaction-hnn] Hmm.
male, female, child, teenager, young adult, middle-aged, elderly, whisper,
very low pitch, low pitch, moderate pitch, high pitch, very high pitch,
american accent, british accent, australian accent, chinese accent, canadian accent,
indian accent, korean accent, portuguese accent, russian accent, japanese accent.
en zh ja ko de fr es it pt ru ar hi None English Chinese Japanese German French Spanish.
It's true, they're here, we've seen it, I'm sure, you'll see, he'd know. 1 2 3 4 5 6 7 8 9 0.
今天天气很好，我们一起去公园散步吧。你好，世界！欢迎来到这里，很高兴认识你。
他说：“这本书非常有意思，我已经读了三遍。”请问火车站怎么走？大约走二十分钟。
春天来了，河水慢慢上涨，孩子们在岸边唱歌，老人坐在树下喝茶聊天。
男，女，儿童，少年，青年，中年，老年，极低音调，低音调，中音调，高音调，极高音调，耳语。
河南话，陕西话，四川话，贵州话，云南话，桂林话，济南话，石家庄话，甘肃话，宁夏话，青岛话，东北话。
"""


def _untrained_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def build_tiny_tokenizer() -> Tokenizer:
    """The trained tokenizer with the special tokens appended after the BPE vocabulary."""
    tok = _untrained_tokenizer()
    trainer = BpeTrainer(
        vocab_size=TARGET_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    specials = QWEN_SPECIAL_TOKENS + OMNIVOICE_SPECIAL_TOKENS
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tok


def _tokenizer_config(tok: Tokenizer) -> dict:
    """The fields of the official tokenizer_config.json that change how text is tokenized."""
    specials = QWEN_SPECIAL_TOKENS + OMNIVOICE_SPECIAL_TOKENS
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t in specials
        },
        "additional_special_tokens": list(OMNIVOICE_SPECIAL_TOKENS),
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_tiny_tokenizer(out_dir: Path) -> int:
    """Write tokenizer.json and tokenizer_config.json into out_dir; return the vocabulary size.

    Training is deterministic: the same bytes are written on every run.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer()
    (out_dir / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    config = json.dumps(_tokenizer_config(tok), indent=2, ensure_ascii=False)
    (out_dir / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")
    return tok.get_vocab_size(with_added_tokens=True)
