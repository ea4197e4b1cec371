"""Audio in and out: load reference clips, prepare them for the codec, post-process generated audio.

Everything here works on mono float32 numpy arrays at one sample rate. The numbers (RMS 0.1, the
silence thresholds and keep lengths, the fade and pad lengths, the 20 s trim rule) are upstream
OmniVoice's, so a prepared reference equals the official one sample for sample at the codec rate.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

from engine.config import GenerationConfig
from engine.errors import AudioError, ClipReadError, InputError
from engine.frontend.silence import (
    Pcm16,
    detect_leading_silence,
    detect_nonsilent,
    from_pcm16,
    split_on_silence,
    to_pcm16,
)

ClipSource = str | Path | bytes

# Upstream raises quiet references to this RMS and scales generated audio back by ref_rms / it.
TARGET_RMS = 0.1
SILENCE_THRESH_DB = -50.0
# remove_silence arguments (ms) upstream uses for references and for generated audio.
REFERENCE_SILENCE = {"mid_sil": 200, "lead_sil": 100, "trail_sil": 200}
OUTPUT_SILENCE = {"mid_sil": 500, "lead_sil": 100, "trail_sil": 100}
CROSS_FADE_SILENCE_S = 0.3
# Bump when reference preparation changes in a way that changes its output (prompt-cache key).
PREPROCESS_VERSION = 1
_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+://")  # s3://, gs://, file://, https:// ...


def clip_name(clip: ClipSource) -> str:
    return f"<{len(clip)} bytes of audio>" if isinstance(clip, bytes) else str(clip)


def read_clip_bytes(clip: ClipSource) -> bytes:
    """The clip's file content (what the prompt cache hashes), AudioError if it cannot be read."""
    if isinstance(clip, bytes):
        return clip
    if not isinstance(clip, str | Path):
        raise AudioError(f"reference clip {clip!r} is a {type(clip).__name__}: give a path or the bytes.")
    if isinstance(clip, str) and _URI.match(clip):
        raise AudioError(
            f"reference clip {clip} is a URI, and the engine reads local files: copy it to a local path "
            "first (`ovbatch submit` and `ovbatch quantize --calib` copy a manifest's remote clips)."
        )
    try:
        return Path(clip).read_bytes()
    except FileNotFoundError:
        raise ClipReadError(f"reference clip {clip} does not exist: check the path.") from None
    except IsADirectoryError:
        raise AudioError(f"reference clip {clip} is a folder: give an audio file in it.") from None
    except OSError as e:
        raise ClipReadError(
            f"reference clip {clip} cannot be read ({e.strerror}): check its permissions."
        ) from None


def too_long(name: str, seconds: float, max_seconds: float) -> AudioError:
    return AudioError(
        f"reference clip {name} is {seconds:.1f} s long, over the {max_seconds:g} s limit: "
        "cut it to 3-10 s of clean speech (and its transcript to match)."
    )


def decode(raw: bytes, name: str, max_seconds: float | None = None) -> tuple[np.ndarray, int]:
    """Decode any format libsndfile reads to mono float32 (channels averaged) and its sample rate."""
    if not raw:
        raise AudioError(f"reference clip {name} is empty (0 bytes): record or export the clip again.")
    try:
        info = sf.info(io.BytesIO(raw))
        if max_seconds is not None and info.duration > max_seconds:
            raise too_long(name, info.duration, max_seconds)
        data, rate = sf.read(io.BytesIO(raw), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError) as e:
        # libsndfile's message names the in-memory buffer (<_io.BytesIO object at 0x...>), not the clip
        detail = e.error_string.rstrip(".") if isinstance(e, sf.LibsndfileError) else str(e)
        raise AudioError(
            f"reference clip {name} is not a readable audio file ({detail}): "
            "use wav, flac, ogg or mp3 and check the file is not truncated."
        ) from None
    if data.shape[0] == 0:
        raise AudioError(f"reference clip {name} holds no samples: record or export the clip again.")
    mono = data[:, 0] if data.shape[1] == 1 else data.mean(axis=1, dtype=np.float32)
    return np.ascontiguousarray(mono), int(rate)


def resample(audio: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    if from_rate == to_rate:
        return audio
    return soxr.resample(audio.astype(np.float32, copy=False), from_rate, to_rate, quality="HQ")


def rms(audio: np.ndarray) -> float:
    return float(np.sqrt(np.mean(audio**2)))


def remove_silence(
    audio: np.ndarray,
    rate: int,
    mid_sil: int,
    lead_sil: int,
    trail_sil: int,
    silence_thresh: float = SILENCE_THRESH_DB,
) -> np.ndarray:
    """Shorten inner silences over mid_sil ms to mid_sil ms per side, keep lead_sil / trail_sil ms at the
    edges (pydub semantics: the result is 16-bit quantized, as upstream's). Needs rate >= 11025 Hz:
    upstream joins the pieces onto an empty 11.025 kHz pydub segment, which resamples lower rates."""
    if rate < 11025:
        raise InputError(
            f"remove_silence needs a rate of at least 11025 Hz, got {rate}: resample the audio first."
        )
    seg = Pcm16(to_pcm16(audio), rate)
    if mid_sil > 0:
        pieces = split_on_silence(seg, mid_sil, silence_thresh, keep_silence=mid_sil, seek_step=10)
        seg = Pcm16.concat(pieces, rate)
    start = max(0, detect_leading_silence(seg, silence_thresh) - lead_sil)
    seg = seg.slice(start).reversed()
    start = max(0, detect_leading_silence(seg, silence_thresh) - trail_sil)
    return from_pcm16(seg.slice(start).reversed().samples)


def trim_long_audio(
    audio: np.ndarray,
    rate: int,
    max_duration: float = 15.0,
    min_duration: float = 3.0,
    trim_threshold: float = 20.0,
) -> np.ndarray:
    """Audio longer than trim_threshold s is cut at the latest pause that starts by max_duration s
    (or at max_duration s when that pause would leave under min_duration s)."""
    if len(audio) / rate <= trim_threshold:
        return audio
    seg = Pcm16(to_pcm16(audio), rate)
    nonsilent = detect_nonsilent(seg, min_silence_len=100, silence_thresh=-40, seek_step=10)
    if not nonsilent:
        return audio
    max_ms, min_ms = int(max_duration * 1000), int(min_duration * 1000)
    split = 0
    for start, end in nonsilent:
        if split < start <= max_ms:
            split = start
        if end > max_ms:
            break
    if split < min_ms:
        split = min(max_ms, len(seg))
    return from_pcm16(seg.slice(0, split).samples)


def fade_and_pad(audio: np.ndarray, rate: int, pad_duration: float, fade_duration: float) -> np.ndarray:
    """Linear fade-in/out of fade_duration s (at most half the clip each), then pad_duration s of zeros
    on both sides."""
    if len(audio) == 0:
        return audio
    out = audio.astype(np.float32, copy=True)
    fade = min(int(fade_duration * rate), len(out) // 2)
    if fade > 0:
        out[:fade] *= np.linspace(0, 1, fade, dtype=np.float32)
        out[-fade:] *= np.linspace(1, 0, fade, dtype=np.float32)
    pad = int(pad_duration * rate)
    if pad > 0:
        zeros = np.zeros(pad, dtype=out.dtype)
        out = np.concatenate([zeros, out, zeros])
    return out


def cross_fade_chunks(chunks: list[np.ndarray], rate: int, silence_duration: float = CROSS_FADE_SILENCE_S):
    """Join chunks: each boundary fades the left side out and the right side in over a third of
    silence_duration, with a third of it of silence between them."""
    if len(chunks) == 1:
        return chunks[0]
    fade = int(silence_duration * rate) // 3
    merged = chunks[0].astype(np.float32, copy=True)
    for chunk in chunks[1:]:
        n_out = min(fade, len(merged))
        if n_out > 0:
            merged[-n_out:] *= np.linspace(1, 0, n_out, dtype=np.float32)
        incoming = chunk.astype(np.float32, copy=True)
        n_in = min(fade, len(incoming))
        if n_in > 0:
            incoming[:n_in] *= np.linspace(0, 1, n_in, dtype=np.float32)
        merged = np.concatenate([merged, np.zeros(fade, dtype=np.float32), incoming])
    return merged


@dataclass(frozen=True)
class ReferenceSettings:
    """How reference clips are checked and prepared."""

    preprocess: bool = True  # upstream's preprocess_prompt: silence removal (and trimming without transcript)
    min_seconds: float = 0.5  # shorter after preparation: rejected
    max_seconds: float = 60.0  # longer as given: rejected before decoding
    silence_floor_rms: float = 1e-4  # quieter (-80 dBFS) as given: rejected as silent

    def fingerprint(self, rate: int, hop: int) -> dict:
        """What determines a prepared reference's samples (part of the prompt-cache key)."""
        return {"version": PREPROCESS_VERSION, "preprocess": self.preprocess, "rate": rate, "hop": hop}


@dataclass
class PreparedReference:
    audio: np.ndarray  # float32 [n * hop] at the codec rate, ready to encode
    rms: float  # RMS of the clip as loaded (before raising it), drives the output volume
    source_seconds: float  # the clip's length as given, before resampling and trimming


def prepare_reference(
    clip: ClipSource,
    rate: int,
    hop: int,
    settings: ReferenceSettings = ReferenceSettings(),
    has_transcript: bool = True,
    raw: bytes | None = None,
) -> PreparedReference:
    """Load, resample, raise quiet clips to RMS 0.1, remove silence, align to whole hops (upstream's
    create_voice_clone_prompt). `raw` passes the clip's bytes when the caller has read them already."""
    name = clip_name(clip)
    raw = read_clip_bytes(clip) if raw is None else raw
    audio, clip_rate = decode(raw, name, settings.max_seconds)
    source_seconds = len(audio) / clip_rate
    if not np.isfinite(audio).all():
        raise AudioError(f"reference clip {name} holds NaN or infinite samples: export it again as PCM.")
    audio = resample(audio, clip_rate, rate)
    level = rms(audio)
    if not level >= settings.silence_floor_rms:
        raise AudioError(
            f"reference clip {name} is silent (RMS {level:.2g}, under {settings.silence_floor_rms:g}): "
            "pass a clip with audible speech."
        )
    if level < TARGET_RMS:
        audio = audio * TARGET_RMS / level
    if settings.preprocess:
        if not has_transcript:
            audio = trim_long_audio(audio, rate)
        audio = remove_silence(audio, rate, **REFERENCE_SILENCE)
    audio = audio[: len(audio) - len(audio) % hop]
    seconds = len(audio) / rate
    if seconds < settings.min_seconds:
        raise AudioError(
            f"reference clip {name} holds {seconds:.2f} s of sound after silence trimming, under "
            f"{settings.min_seconds:g} s: pass a clip with at least a few seconds of speech."
        )
    return PreparedReference(audio=audio, rms=level, source_seconds=source_seconds)


def postprocess_output(
    audio: np.ndarray, rate: int, ref_rms: float | None, gen: GenerationConfig
) -> np.ndarray:
    """Generated audio -> final waveform (upstream's _post_process_audio): optional silence removal,
    volume matched to a quiet reference (or peak 0.5 without one), fades and padding."""
    if gen.postprocess_output:
        audio = remove_silence(audio, rate, **OUTPUT_SILENCE)
    if ref_rms is not None and ref_rms < TARGET_RMS:
        audio = audio * ref_rms / TARGET_RMS
    elif ref_rms is None:
        peak = np.abs(audio).max() if len(audio) else 0.0
        if peak > 1e-6:
            audio = audio / peak * 0.5
    return fade_and_pad(audio, rate, gen.pad_duration, gen.fade_duration)
