"""Silence detection with pydub's semantics, in numpy, on 16-bit mono PCM.

Upstream OmniVoice trims silence through pydub. To reproduce its output sample for sample without the
dependency, this module keeps pydub's conventions:
  * audio is 16-bit PCM; loudness is audioop's RMS, which truncates to an integer;
  * positions are milliseconds; a segment's length is round(1000 * frames / rate) ms and the slice
    [a, b) ms covers samples int(a * rate / 1000) .. int(b * rate / 1000), both ends clamped to the
    length in ms, the end zero-padded when that rounds past the last sample;
  * `detect_silence` slides a window of `min_silence_len` ms every `seek_step` ms (plus one final
    window at the very end) and merges overlapping silent windows; `split_on_silence` keeps
    `keep_silence` ms on each side of every non-silent range, splitting shorter gaps evenly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

FULL_SCALE = 32768.0


def to_pcm16(audio: np.ndarray) -> np.ndarray:
    """float32 in [-1, 1] -> int16 by scale, clip and truncation toward zero (upstream's conversion)."""
    scaled = audio.astype(np.float32, copy=False) * np.float32(FULL_SCALE)
    return scaled.clip(-32768, 32767).astype(np.int16)


def from_pcm16(pcm: np.ndarray) -> np.ndarray:
    return pcm.astype(np.float32) / np.float32(FULL_SCALE)


@dataclass(frozen=True)
class Pcm16:
    """Mono 16-bit samples addressed in milliseconds, as a pydub AudioSegment is."""

    samples: np.ndarray  # int16 [n]
    rate: int

    def __len__(self) -> int:
        return round(1000 * (float(len(self.samples)) / self.rate))

    def sample_index(self, ms) -> np.ndarray | int:
        """Sample offset of a position in ms (vectorised); pydub truncates ms * rate / 1000."""
        pos = np.asarray(ms, dtype=np.float64) * (self.rate / 1000.0)
        return pos.astype(np.int64) if pos.ndim else int(pos)

    def slice(self, start_ms: int, end_ms: int | None = None) -> Pcm16:
        length = len(self)
        end_ms = length if end_ms is None else end_ms
        start = self.sample_index(min(start_ms, length))
        end = self.sample_index(min(end_ms, length))
        data = self.samples[start:end]
        missing = (end - start) - len(data)
        if missing > 0:
            data = np.concatenate([data, np.zeros(missing, dtype=np.int16)])
        return Pcm16(data, self.rate)

    def reversed(self) -> Pcm16:
        return Pcm16(self.samples[::-1].copy(), self.rate)

    @staticmethod
    def concat(parts: list[Pcm16], rate: int) -> Pcm16:
        if not parts:
            return Pcm16(np.zeros(0, dtype=np.int16), rate)
        return Pcm16(np.concatenate([p.samples for p in parts]), rate)

    def window_rms(self, starts_ms: np.ndarray, lengths_ms: np.ndarray | int) -> np.ndarray:
        """audioop.rms of each slice [start, start + length) ms: floor(sqrt(mean(x^2))), 0 when empty."""
        length = len(self)
        starts_ms = np.asarray(starts_ms, dtype=np.int64)
        ends_ms = np.minimum(starts_ms + lengths_ms, length)
        starts_ms = np.minimum(starts_ms, length)
        a, b = self.sample_index(starts_ms), self.sample_index(ends_ms)
        squares = np.concatenate([[0], np.cumsum(self.samples.astype(np.int64) ** 2)])
        n = len(self.samples)
        sums = (squares[np.minimum(b, n)] - squares[np.minimum(a, n)]).astype(np.float64)
        counts = (b - a).astype(np.float64)  # zero padding counts as samples, as in pydub
        with np.errstate(divide="ignore", invalid="ignore"):
            rms = np.floor(np.sqrt(sums / counts))
        return np.where(counts > 0, rms, 0).astype(np.int64)


def _rms_ceiling(silence_thresh_db: float) -> int:
    """Largest integer RMS that detect_silence calls silent (rms <= db_to_float(thresh) * full scale)."""
    return math.floor(10 ** (float(silence_thresh_db) / 20) * FULL_SCALE)


def _dbfs_floor(silence_thresh_db: float) -> int:
    """Smallest integer RMS whose dBFS is not below the threshold (detect_leading_silence's test)."""
    for rms in range(1, int(FULL_SCALE) + 1):
        if 20 * math.log(rms / FULL_SCALE, 10) >= silence_thresh_db:
            return rms
    return int(FULL_SCALE) + 1


def detect_silence(
    seg: Pcm16, min_silence_len: int, silence_thresh: float, seek_step: int = 1
) -> list[list[int]]:
    """Silent ranges [start_ms, end_ms]: runs of windows of min_silence_len ms whose RMS is at or
    under the threshold; windows overlapping the previous silent run join it."""
    seg_len = len(seg)
    if seg_len < min_silence_len:
        return []
    last_start = seg_len - min_silence_len
    starts = list(range(0, last_start + 1, seek_step))
    if last_start % seek_step:
        starts.append(last_start)
    starts = np.asarray(starts, dtype=np.int64)
    silent = starts[seg.window_rms(starts, min_silence_len) <= _rms_ceiling(silence_thresh)].tolist()
    if not silent:
        return []
    ranges = []
    run_start = prev = silent[0]
    for start in silent[1:]:
        if start != prev + seek_step and start > prev + min_silence_len:
            ranges.append([run_start, prev + min_silence_len])
            run_start = start
        prev = start
    ranges.append([run_start, prev + min_silence_len])
    return ranges


def detect_nonsilent(
    seg: Pcm16, min_silence_len: int, silence_thresh: float, seek_step: int = 1
) -> list[list[int]]:
    """The complement of detect_silence within [0, len(seg)] ms."""
    silent = detect_silence(seg, min_silence_len, silence_thresh, seek_step)
    seg_len = len(seg)
    if not silent:
        return [[0, seg_len]]
    if silent[0] == [0, seg_len]:
        return []
    ranges, prev_end = [], 0
    for start, end in silent:
        ranges.append([prev_end, start])
        prev_end = end
    if silent[-1][1] != seg_len:
        ranges.append([prev_end, seg_len])
    if ranges[0] == [0, 0]:
        ranges.pop(0)
    return ranges


def split_on_silence(
    seg: Pcm16, min_silence_len: int, silence_thresh: float, keep_silence: int, seek_step: int = 1
) -> list[Pcm16]:
    """Non-silent pieces, each widened by keep_silence ms; overlapping widenings meet halfway."""
    ranges = [
        [start - keep_silence, end + keep_silence]
        for start, end in detect_nonsilent(seg, min_silence_len, silence_thresh, seek_step)
    ]
    for left, right in zip(ranges, ranges[1:]):
        if right[0] < left[1]:
            left[1] = right[0] = (left[1] + right[0]) // 2
    seg_len = len(seg)
    return [seg.slice(max(start, 0), min(end, seg_len)) for start, end in ranges]


def detect_leading_silence(seg: Pcm16, silence_threshold: float, chunk_size: int = 10) -> int:
    """Milliseconds of leading silence: the first chunk_size-ms chunk whose dBFS reaches the threshold."""
    seg_len = len(seg)
    starts = np.arange(0, seg_len, chunk_size, dtype=np.int64)
    loud = np.nonzero(seg.window_rms(starts, chunk_size) >= _dbfs_floor(silence_threshold))[0]
    return int(starts[loud[0]]) if len(loud) else seg_len
