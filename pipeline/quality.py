"""Report metrics that need a model, per variant and row (the configured `compare.*` models):

  transcript   what a transformers speech-recognition model hears in the wav; WER/CER against the row's
               text follow from it (pipeline.wer)
  speaker_sim  cosine between x-vector speaker embeddings of the wav and of the row's reference clip

Both run in batches (rows of similar length together) on compare.device. Their results are kept in
report/quality.parquet with the row's key and the model's name, so that a report written again measures
only the rows it has not measured with the same model (an ok row's wav is never rewritten). Delete that
file to measure everything again, e.g. after replacing a model directory in place.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import soundfile as sf

from engine.errors import InputError, OVBatchError
from pipeline.atomic import write_parquet_atomic
from pipeline.config import CompareConfig
from pipeline.messages import first_line
from pipeline.store import JobDir
from pipeline.wer import error_counts

log = logging.getLogger(__name__)

# Longer clips are chunked for speech recognition; speaker embeddings use their first this many seconds
# (attention over a whole 10-minute output would not fit, and the voice is known long before).
CHUNK_SECONDS = 30
SPEAKER_SECONDS = 30.0
QUALITY_FILE = "quality.parquet"
QUALITY_SCHEMA = pa.schema(
    [
        ("variant", pa.string()),
        ("id", pa.string()),
        ("row_key", pa.string()),
        ("asr_model", pa.string()),
        ("transcript", pa.string()),
        ("speaker_model", pa.string()),
        ("speaker_sim", pa.float64()),
        ("problem", pa.string()),
        # From the transcript and the row's text, each time (pipeline.wer)
        ("wer", pa.float64()),
        ("cer", pa.float64()),
        ("word_errors", pa.int64()),
        ("ref_words", pa.int64()),
        ("char_errors", pa.int64()),
        ("ref_chars", pa.int64()),
    ]
)


class ModelLoadError(OVBatchError):
    """A configured compare model cannot be loaded."""


def compare_device(cmp: CompareConfig) -> Any:
    from engine.devices import resolve_device

    try:
        return resolve_device(cmp.device)
    except InputError as e:
        raise InputError(f"compare.{e}") from None


def _load_error(key: str, name: str, e: BaseException) -> ModelLoadError:
    return ModelLoadError(
        f"compare.{key}={name!r} cannot be loaded ({type(e).__name__}: {first_line(e)}): give a directory "
        "written by save_pretrained, or a hub id this machine has cached or can download."
    )


def _length_order(audios: Sequence[np.ndarray]) -> list[int]:
    """Indices longest first: a batch then holds clips of similar length (little padding)."""
    return sorted(range(len(audios)), key=lambda i: -len(audios[i]))


@dataclass
class NoTranscript:
    """A clip the speech model refused, and why (the row is tried again by the next report)."""

    reason: str


class Transcriber:
    """A transformers automatic-speech-recognition pipeline (Whisper, wav2vec 2 CTC, ...)."""

    def __init__(self, name: str, device: Any, batch_size: int):
        import torch
        from transformers import pipeline

        dtype = torch.float16 if device.type == "cuda" else torch.float32
        try:
            self.pipe = pipeline("automatic-speech-recognition", model=name, device=device, dtype=dtype)
        except Exception as e:  # noqa: BLE001 - missing files, unknown architecture, no network: all say why
            raise _load_error("asr_model", name, e) from None
        if self.pipe.tokenizer is not None and self.pipe.tokenizer.pad_token is None:
            self.pipe.tokenizer.pad_token = self.pipe.tokenizer.eos_token  # batching pads the label side
        self.name = name
        self.batch_size = batch_size
        self.rate = int(self.pipe.feature_extractor.sampling_rate)
        generation = getattr(self.pipe.model, "generation_config", None)
        self.languages = set(getattr(generation, "lang_to_id", None) or {})  # Whisper's "<|en|>", ...

    def _language(self, code: str | None) -> str | None:
        """The row's language when the model takes one (Whisper's own codes); None lets it detect."""
        return code if code and f"<|{code}|>" in self.languages else None

    def transcribe(
        self, audios: Sequence[np.ndarray], languages: Sequence[str | None]
    ) -> list[str | NoTranscript]:
        """Transcripts of mono clips at self.rate, in order; for a clip the model refuses, why."""
        groups: dict[tuple[str | None, bool], list[int]] = {}
        for i in _length_order(audios):
            long = len(audios[i]) > CHUNK_SECONDS * self.rate
            groups.setdefault((self._language(languages[i]), long), []).append(i)
        texts: list[str | NoTranscript] = [""] * len(audios)
        for (language, long), members in groups.items():
            kwargs: dict[str, Any] = {"batch_size": self.batch_size}
            if language is not None:
                kwargs["generate_kwargs"] = {"language": language, "task": "transcribe"}
            if long:
                kwargs["chunk_length_s"] = CHUNK_SECONDS
            for i, text in zip(
                members, self._run([np.asarray(audios[i], np.float32) for i in members], kwargs)
            ):
                texts[i] = text
        return texts

    def _run(self, clips: list[np.ndarray], kwargs: dict[str, Any]) -> list[str | NoTranscript]:
        try:
            out = self.pipe(clips, **kwargs)
        except (
            RuntimeError
        ) as e:  # a CTC model refuses a clip shorter than its convolutions, and its batch with it
            if len(clips) > 1:
                return [text for clip in clips for text in self._run([clip], kwargs)]
            return [NoTranscript(f"the speech model cannot transcribe it ({first_line(e)})")]
        return [o["text"].strip() for o in out]


class SpeakerEmbedder:
    """A transformers audio x-vector model (WavLMForXVector, Wav2Vec2ForXVector, ...)."""

    def __init__(self, name: str, device: Any, batch_size: int):
        from transformers import AutoFeatureExtractor, AutoModelForAudioXVector

        try:
            self.extractor = AutoFeatureExtractor.from_pretrained(name)
            self.model = AutoModelForAudioXVector.from_pretrained(name).to(device).eval()
        except Exception as e:  # noqa: BLE001 - see Transcriber
            raise _load_error("speaker_model", name, e) from None
        self.name = name
        self.device = device
        self.batch_size = batch_size
        self.rate = int(self.extractor.sampling_rate)

    def embed(self, audios: Sequence[np.ndarray]) -> list[np.ndarray | str]:
        """Unit-length embeddings of mono clips at self.rate (their first SPEAKER_SECONDS), in order; for a
        clip the model gives none, why. An x-vector pools statistics over the clip's frames: a clip of a few
        frames fails alone (shorter than the model's kernels) and gives NaN in a padded batch."""
        limit = int(SPEAKER_SECONDS * self.rate)
        clips = [np.asarray(a[:limit], np.float32) for a in audios]
        order = _length_order(clips)
        out: list[np.ndarray | str] = [""] * len(clips)
        for start in range(0, len(order), self.batch_size):
            members = order[start : start + self.batch_size]
            for i, e in zip(members, self._embed_batch([clips[i] for i in members]), strict=True):
                out[i] = e
        return out

    def _embed_batch(self, clips: list[np.ndarray]) -> list[np.ndarray | str]:
        import torch

        try:
            inputs = self.extractor(clips, sampling_rate=self.rate, padding=True, return_tensors="pt")
            with torch.inference_mode():
                emb = self.model(**inputs.to(self.device)).embeddings.float()
        except RuntimeError as e:  # one clip too short fails its whole batch: the others go on their own
            if len(clips) > 1:
                return [e for clip in clips for e in self._embed_batch([clip])]
            return [f"the speaker model cannot embed it ({first_line(e)})"]
        emb = torch.nn.functional.normalize(emb, dim=-1).cpu().numpy()
        return [
            e
            if np.isfinite(e).all() and e.any()
            else "the speaker model's embedding of it is NaN, infinite or zero"
            for e in emb
        ]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    return float(np.dot(a, b) / (na * nb)) if na > 0 and nb > 0 else math.nan


@dataclass
class Quality:
    """Per (variant, id): the stored record; `notes`: what was not measured, and why."""

    rows: dict[tuple[str, str], dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    asr_model: str | None = None
    speaker_model: str | None = None


def _read_mono(path: Any, rate: int) -> np.ndarray:
    from engine.frontend.audio import resample

    audio, sr = sf.read(path, dtype="float32", always_2d=True)
    if audio.shape[0] == 0:
        raise ValueError("it holds no samples")
    return resample(audio.mean(axis=1), int(sr), rate)


def _read_reference(clip: str, rate: int) -> np.ndarray:
    from engine.frontend.audio import decode, read_clip_bytes, resample

    audio, sr = decode(read_clip_bytes(clip), clip)
    return resample(audio, sr, rate)


def _load_cache(job: JobDir) -> dict[tuple[str, str], dict[str, Any]]:
    path = job.report_dir / QUALITY_FILE
    if not path.is_file():
        return {}
    try:
        rows = pq.read_table(path).cast(QUALITY_SCHEMA).to_pylist()
    except (pa.ArrowException, OSError) as e:
        log.warning("%s is unreadable (%s): measuring every row again", path, first_line(e))
        return {}
    return {(r["variant"], r["id"]): r for r in rows}


def _add_problem(record: dict[str, Any], text: str) -> None:
    record["problem"] = "; ".join(p for p in (record.get("problem"), text) if p)


ASR_FIELDS = ("asr_model", "transcript", "wer", "cer", "word_errors", "ref_words", "char_errors", "ref_chars")
SPEAKER_FIELDS = ("speaker_model", "speaker_sim")


def measure(job: JobDir, cmp: CompareConfig, ok_rows: list[dict[str, Any]]) -> Quality:
    """Transcripts and speaker similarity of the ok result rows (all variants), as configured in `cmp`,
    reusing what report/quality.parquet holds. A model that cannot be loaded or run leaves its metric out
    with a note; a row whose wav or reference cannot be read gets a `problem` instead.

    The file keeps each row's latest measurement of either kind, whatever its model; the rows returned
    show only what the configured models measured."""
    quality = Quality({}, asr_model=cmp.asr_model, speaker_model=cmp.speaker_model)
    if cmp.asr_model is None and cmp.speaker_model is None:
        return quality
    cache = _load_cache(job)
    records = {}
    for r in ok_rows:
        old = cache.get((r["variant"], r["id"]))
        same_row = old is not None and old["row_key"] == r["row_key"]
        records[(r["variant"], r["id"])] = {
            **(old if same_row else dict.fromkeys(QUALITY_SCHEMA.names)),
            "variant": r["variant"],
            "id": r["id"],
            "row_key": r["row_key"],
            "problem": None,
        }
    batch = _Batch(job, records, {(r["variant"], r["id"]): job.path / r["wav_path"] for r in ok_rows})
    if cmp.asr_model and batch.todo("asr_model", cmp.asr_model):
        _run(
            quality,
            "speech recognition",
            lambda: batch.transcribe(Transcriber(cmp.asr_model, compare_device(cmp), cmp.batch_size)),
        )
    if cmp.speaker_model and batch.todo("speaker_model", cmp.speaker_model):
        _run(
            quality,
            "speaker similarity",
            lambda: batch.similarity(SpeakerEmbedder(cmp.speaker_model, compare_device(cmp), cmp.batch_size)),
        )
    batch.score_transcripts()
    if records:
        table = pa.Table.from_pylist(list(records.values()), schema=QUALITY_SCHEMA)
        write_parquet_atomic(job.report_dir / QUALITY_FILE, table)
    quality.rows = {key: _configured(rec, cmp) for key, rec in records.items()}
    return quality


def _configured(record: dict[str, Any], cmp: CompareConfig) -> dict[str, Any]:
    """The record without measurements of models other than the configured ones."""
    view = dict(record)
    for model, fields in ((cmp.asr_model, ASR_FIELDS), (cmp.speaker_model, SPEAKER_FIELDS)):
        if model is None or record[fields[0]] != model:
            view.update(dict.fromkeys(fields))
    return view


def _run(quality: Quality, what: str, work: Callable[[], None]) -> None:
    try:
        work()
        return
    except (ModelLoadError, InputError) as e:
        note = f"{what} not measured: {e}"
    except Exception as e:  # noqa: BLE001 - an optional metric must not cost the job its report
        log.exception("%s failed", what)
        note = f"{what} failed ({type(e).__name__}: {first_line(e)}); see the log"
    log.warning(note)
    quality.notes.append(note)


def _read_all(
    items: Sequence[Any], read: Callable[[Any], np.ndarray]
) -> tuple[list[Any], list[np.ndarray], dict[Any, str]]:
    """(items read, their audio, item -> why it could not be read)."""
    kept, audios, failed = [], [], {}
    for item in items:
        try:
            audios.append(read(item))
        except (sf.SoundFileError, OSError, ValueError, OVBatchError) as e:
            failed[item] = first_line(e)
            continue
        kept.append(item)
    return kept, audios, failed


def _number(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


class _Batch:
    """The rows of one report that still need a metric, and where their audio is."""

    def __init__(self, job: JobDir, records: dict[tuple[str, str], dict[str, Any]], wavs: dict):
        self.records = records
        self.wavs = wavs
        self.manifest = job.read_rows()

    def todo(self, model_key: str, model: str) -> list[tuple[str, str]]:
        """The rows not yet measured with `model`: a speaker_sim that is not a number counts as not measured
        (quality.parquet files written before short clips were named could hold NaN)."""
        return [
            k
            for k, rec in self.records.items()
            if rec[model_key] != model or (model_key == "speaker_model" and not _number(rec["speaker_sim"]))
        ]

    def _wavs(self, keys: list[tuple[str, str]], rate: int) -> tuple[list[tuple[str, str]], list[np.ndarray]]:
        kept, audios, failed = _read_all(keys, lambda k: _read_mono(self.wavs[k], rate))
        for key, why in failed.items():
            _add_problem(self.records[key], f"the wav cannot be read ({why})")
        return kept, audios

    def transcribe(self, model: Transcriber) -> None:
        keys, audios = self._wavs(self.todo("asr_model", model.name), model.rate)
        languages = [self.manifest[i].language if i in self.manifest else None for _, i in keys]
        for key, audio, text in zip(keys, audios, model.transcribe(audios, languages), strict=True):
            if isinstance(text, NoTranscript):
                seconds = len(audio) / model.rate
                _add_problem(
                    self.records[key], f"no transcript: {text.reason}; the wav holds {seconds:.2f} s"
                )
                continue
            self.records[key].update(asr_model=model.name, transcript=text)

    def score_transcripts(self) -> None:
        for (_, row_id), rec in self.records.items():
            if rec["transcript"] is None or row_id not in self.manifest:
                continue
            counts = error_counts(self.manifest[row_id].text, rec["transcript"])
            rec.update(wer=counts.wer, cer=counts.cer, **asdict(counts))

    def similarity(self, model: SpeakerEmbedder) -> None:
        keys = self.todo("speaker_model", model.name)
        clip_of = {k: self.manifest[k[1]].ref_audio if k[1] in self.manifest else None for k in keys}
        clips, ref_audio, bad_clips = _read_all(
            sorted({c for c in clip_of.values() if c}), lambda c: _read_reference(c, model.rate)
        )
        references, unembedded = {}, {}
        for clip, emb in zip(clips, model.embed(ref_audio), strict=True):
            (unembedded if isinstance(emb, str) else references)[clip] = emb
        for key in keys:
            clip = clip_of[key]
            if clip is None:
                _add_problem(self.records[key], "no reference clip to compare the voice with")
            elif clip in bad_clips:
                _add_problem(self.records[key], f"the reference clip cannot be read ({bad_clips[clip]})")
            elif clip in unembedded:
                _add_problem(
                    self.records[key], f"no speaker similarity: for the reference clip, {unembedded[clip]}"
                )
        keys, audios = self._wavs([k for k in keys if clip_of[k] in references], model.rate)
        for key, audio, emb in zip(keys, audios, model.embed(audios), strict=True):
            if isinstance(emb, str):  # left unmeasured (tried again next time), named
                seconds = len(audio) / model.rate
                _add_problem(
                    self.records[key], f"no speaker similarity: {emb}; the wav holds {seconds:.2f} s"
                )
                continue
            similarity = cosine(emb, references[clip_of[key]])
            self.records[key].update(speaker_model=model.name, speaker_sim=similarity)
