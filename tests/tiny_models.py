"""Randomly initialised tiny models of the transformers classes the report's quality metrics load (a
Whisper speech recogniser with a byte-level tokenizer, a WavLM x-vector model), written with
save_pretrained to a folder, so that tests exercise the real loading and batching without a download."""

from __future__ import annotations

from pathlib import Path

import torch


def _byte_symbols() -> list[str]:
    """The 256 printable stand-ins a byte-level BPE uses for the bytes 0-255, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    extra = iter(range(256, 512))
    return [chr(b if b in printable else next(extra)) for b in range(256)]


def tiny_whisper(folder: Path) -> Path:
    from transformers import (
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
        WhisperTokenizer,
    )
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    symbols = _byte_symbols()
    tokenizer = WhisperTokenizer(
        vocab={s: i for i, s in enumerate(symbols)}, merges=[], pad_token="<|endoftext|>"
    )
    languages = [f"<|{code}|>" for code in LANGUAGES]
    control = ["<|startoftranscript|>", *languages, "<|translate|>", "<|transcribe|>", "<|startoflm|>"]
    control += ["<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": control})
    ids = tokenizer.convert_tokens_to_ids
    end, start = ids("<|endoftext|>"), ids("<|startoftranscript|>")
    config = WhisperConfig(
        vocab_size=len(tokenizer),
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_mel_bins=80,
        max_target_positions=64,
        pad_token_id=end,
        bos_token_id=end,
        eos_token_id=end,
        decoder_start_token_id=start,
    )
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        decoder_start_token_id=start,
        bos_token_id=end,
        eos_token_id=end,
        pad_token_id=end,
        max_length=12,
        num_beams=1,
        # As the real checkpoints do: no control token inside a transcript and no empty one, so that the
        # random model always writes some text and the decoding path is exercised.
        suppress_tokens=list(range(start, len(tokenizer))),
        begin_suppress_tokens=[end],
        no_timestamps_token_id=ids("<|notimestamps|>"),
        lang_to_id={t: ids(t) for t in languages},
        task_to_id={"transcribe": ids("<|transcribe|>"), "translate": ids("<|translate|>")},
        is_multilingual=True,
    )
    model.save_pretrained(folder)
    WhisperProcessor(
        feature_extractor=WhisperFeatureExtractor(feature_size=80), tokenizer=tokenizer
    ).save_pretrained(folder)
    return folder


def tiny_wavlm_xvector(folder: Path) -> Path:
    from transformers import Wav2Vec2FeatureExtractor, WavLMConfig, WavLMForXVector

    config = WavLMConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(5, 4),
        conv_kernel=(10, 8),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
        num_buckets=32,
        max_bucket_distance=64,
        tdnn_dim=(16, 16),
        tdnn_kernel=(3, 1),
        tdnn_dilation=(1, 1),
        xvector_output_dim=8,
    )
    torch.manual_seed(0)
    WavLMForXVector(config).save_pretrained(folder)
    extractor = Wav2Vec2FeatureExtractor(
        feature_size=1, sampling_rate=16000, padding_value=0.0, do_normalize=True, return_attention_mask=True
    )
    extractor.save_pretrained(folder)
    return folder
