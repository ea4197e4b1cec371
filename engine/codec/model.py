"""Codec: our HiggsAudioV2 audio tokenizer, loading the official weights by their names.

Encode: 24 kHz audio -> acoustic latents (DAC encoder) + semantic latents (HuBERT on 16 kHz, then a conv
encoder), concatenated, projected by `fc`, residual-vector-quantized -> codes [C, F].
Decode: codes -> summed codewords -> `fc2` -> DAC decoder -> audio [F * hop].
Batches are right-padded and every conv is length-aware, so each item's result equals its solo result.
The reference is transformers' HiggsAudioV2TokenizerModel, which the official OmniVoice runs: our modules
compute what it computes, operation for operation (tests/test_codec.py, tests/test_codec_modules.py),
without importing transformers.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.checkpoint import files_fingerprint, owned_copy
from engine.codec.acoustic import AcousticDecoder, AcousticEncoder, Snake
from engine.codec.checkpoint import check_codec_config, read_codec_config, read_codec_weights
from engine.codec.config import CodecConfig
from engine.codec.hubert import Hubert
from engine.codec.lengths import conv_output_lengths, pad_stack
from engine.codec.quantizer import ResidualVectorQuantizer
from engine.codec.semantic import SemanticEncoder, semantic_features
from engine.devices import to_device
from engine.errors import InputError

# Padded audio one encode batch may hold: bounds its activations (HuBERT's first conv writes 512 channels
# at a fifth of 16 kHz: about 1.6 GB in float32 for this much; the whole full-size encode peaked 8.4 GiB
# above the loaded codec on the CPU, ~35 MB a padded second; a job's two preparing threads encode at once).
ENCODE_BATCH_SECONDS = 240.0


class Codec(nn.Module):
    def __init__(self, cfg: CodecConfig):
        super().__init__()
        check_codec_config(cfg, "codec config")
        self.config = cfg
        self.sample_rate: int = cfg.sample_rate
        self.hop_length: int = cfg.hop_length
        self.frame_rate: float = float(cfg.frame_rate)
        self.num_codebooks: int = cfg.num_quantizers
        self.codebook_size: int = cfg.codebook_size
        # Built in the reference's order: under a fixed seed the random init draws the reference's weights.
        self.acoustic_encoder = AcousticEncoder(cfg.acoustic_model_config)
        self.acoustic_decoder = AcousticDecoder(cfg.acoustic_model_config)
        self.encoder_semantic = SemanticEncoder(cfg)
        self.semantic_model = Hubert(cfg.semantic_model_config)
        self.fc = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.fc2 = nn.Linear(cfg.hidden_size, cfg.acoustic_model_config.hidden_size)
        self.quantizer = ResidualVectorQuantizer(cfg)
        self._identity: str | None = None
        self.eval()

    @classmethod
    def from_dir(
        cls,
        path: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        cache_dir: str | Path | None = None,
        fused: bool = False,
    ) -> Codec:
        """Load `<checkpoint>/audio_tokenizer/` (config.json + model.safetensors, the official names).
        cache_dir: where the files' fingerprint is kept (engine.checkpoint.files_fingerprint). fused: the
        Snake activations may run on the CUDA extension's kernel (torch's ops in torch's order; the
        engine's fused_kernels)."""
        path = Path(path)
        cfg = read_codec_config(path / "config.json")
        with torch.device("meta"):
            codec = cls(cfg)
        expected = {name: t.shape for name, t in codec.state_dict().items()}
        weights = read_codec_weights(path / "model.safetensors", expected, cfg)
        files = files_fingerprint([path / "config.json", path / "model.safetensors"], cache_dir)
        codec._identity = _identity(cfg, dtype, f"files:{files}")
        owned = {name: owned_copy(t, device, dtype) for name, t in weights.items()}
        codec.load_state_dict(owned, strict=True, assign=True)  # every tensor: nothing left to move
        codec.use_fused_kernels(fused)
        return codec.eval()

    def use_fused_kernels(self, fused: bool) -> None:
        """Whether the Snake activations run on the CUDA extension's kernel (where it applies)."""
        for module in self.modules():
            if isinstance(module, Snake):
                module.fused = fused

    @property
    def identity(self) -> str:
        """sha256 of the config, the compute dtype and the weights: equal identities encode alike.
        from_dir names the weights by its files' fingerprint (cached on disk: no weight is hashed at a
        load of unchanged files); a codec built from a config hashes its current tensors. The two
        namings differ, so a loaded codec and one built with the same tensors have different identities."""
        if self._identity is not None:
            return self._identity
        return _identity(self.config, self.fc.weight.dtype, f"tensors:{_tensors_digest(self.state_dict())}")

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    # ----------------------------------------------------------------------------------------- encode

    @torch.inference_mode()
    def encode(
        self, wavs: list[torch.Tensor], device: torch.device | str | None = None
    ) -> list[torch.Tensor]:
        """Mono float clips [T] at sample_rate -> codes [num_codebooks, F] (int64, on `device`, by default
        the codec's; moved there in one copy per encode batch).

        F is the number of HuBERT frames at the codec rate (T / hop for T a multiple of hop_length, which
        is how OmniVoice trims its references). Clips run longest first in right-padded batches of at most
        ENCODE_BATCH_SECONDS of padded audio; each clip's codes are its codes alone. Codes from the device
        to the host come back without a wait but for the last batch's, so that the host launches a batch
        while the device runs the one before."""
        if not wavs:
            return []
        self._check_wavs(wavs)
        target = torch.device(device) if device is not None else self.device
        budget = ENCODE_BATCH_SECONDS * self.sample_rate
        order = sorted(range(len(wavs)), key=lambda i: -wavs[i].shape[-1])
        codes: list[torch.Tensor | None] = [None] * len(wavs)
        while order:
            size = max(1, int(budget // wavs[order[0]].shape[-1]))  # clips of the longest one's length
            group, order = order[:size], order[size:]
            batch, frames = self._encode_batch([wavs[i] for i in group])
            if order and target.type == "cpu" and batch.is_cuda:
                # the last batch's copy waits for the stream, and so for this one too
                host = torch.empty(batch.shape, dtype=batch.dtype, pin_memory=True)
                batch = host.copy_(batch, non_blocking=True)
            else:
                batch = batch.to(target)
            for i, clip_codes, f in zip(group, batch, frames, strict=True):
                codes[i] = clip_codes[:, :f]
        return codes

    def _encode_batch(self, wavs: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
        """Codes [B, num_codebooks, max F] of right-padded clips, and each clip's F."""
        lengths = [w.shape[-1] for w in wavs]
        signal = self._padded_on_device(wavs)
        e_semantic, frames = self.encoder_semantic(
            *semantic_features(self.semantic_model, signal, lengths, self.config)
        )
        e_acoustic, acoustic_frames = self.acoustic_encoder(*self._acoustic_inputs(signal, lengths, frames))
        assert acoustic_frames == frames, (acoustic_frames, frames)
        latents = torch.cat([e_acoustic, e_semantic], dim=1)
        latents = self.fc(latents.transpose(1, 2)).transpose(1, 2)
        return self.quantizer.encode(latents), frames

    def _padded_on_device(self, wavs: list[torch.Tensor]) -> torch.Tensor:
        """The clips right-padded with zeros into [B, max T], in the codec's dtype on its device. Clips from
        the host are padded there and go over in one copy, which the host does not wait for (a copy per clip
        would wait its turn on a device shared with the generation)."""
        on_host = all(w.device.type == "cpu" for w in wavs)
        pin = on_host and self.device.type == "cuda"
        batch = torch.zeros(
            len(wavs),
            max(w.shape[-1] for w in wavs),
            dtype=self.fc.weight.dtype,
            device="cpu" if on_host else self.device,
            pin_memory=pin,
        )
        for row, wav in zip(batch, wavs, strict=True):
            row[: wav.shape[-1]].copy_(wav)
        return batch.to(self.device, non_blocking=pin)

    def _acoustic_inputs(
        self, signal: torch.Tensor, lengths: list[int], frames: list[int]
    ) -> tuple[torch.Tensor, list[int]]:
        """The DAC encoder's padded batch and lengths, as the reference: each clip as is where the encoder
        yields as many frames as HuBERT does, else padded by half a hop on both sides (rows picked from the
        batch shifted by half a hop). With frame rates that agree (check_codec_config) one of the two
        matches for every length; _encode_batch asserts it."""
        dac = lengths
        for conv in self.acoustic_encoder.modules():
            if isinstance(conv, nn.Conv1d):
                dac = conv_output_lengths(conv, dac)
        shifted = [n != f for n, f in zip(dac, frames, strict=True)]
        if not any(shifted):
            return signal[:, None], lengths
        half = self.hop_length // 2
        lengths = [n + 2 * half if s else n for n, s in zip(lengths, shifted, strict=True)]
        both = F.pad(signal, (half, half))
        if not all(shifted):
            picked = to_device(torch.tensor(shifted), signal.device)[:, None]
            both = torch.where(picked, both, F.pad(signal, (0, 2 * half)))
        return both[:, None, : max(lengths)], lengths

    def _check_wavs(self, wavs: list[torch.Tensor]) -> None:
        for index, wav in enumerate(wavs):
            if not isinstance(wav, torch.Tensor) or wav.dim() != 1 or not wav.is_floating_point():
                raise InputError(
                    f"wavs[{index}] is {type(wav).__name__} {getattr(wav, 'dtype', '')} "
                    f"{tuple(getattr(wav, 'shape', ()))}; pass a mono float tensor [T] at "
                    f"{self.sample_rate} Hz (downmix stereo first)."
                )
            if wav.shape[0] < self.hop_length:
                raise InputError(
                    f"wavs[{index}] has {wav.shape[0]} samples, fewer than one frame ({self.hop_length} "
                    f"samples at {self.sample_rate} Hz); pass a longer clip."
                )
        # one answer for the whole list: for clips on the device the host waits once
        finite = torch.stack([torch.isfinite(w).all().to(wavs[0].device) for w in wavs]).tolist()
        if not all(finite):
            bad = finite.index(False)
            raise InputError(f"wavs[{bad}] contains NaN or infinite samples; clean the audio first.")

    # ----------------------------------------------------------------------------------------- decode

    @torch.inference_mode()
    def decode(self, codes: list[torch.Tensor], trusted: bool = False) -> list[torch.Tensor]:
        """Codes [num_codebooks, F] -> float32 audio [F * hop_length] at sample_rate, on the codec device.
        trusted: int64 codes on the codec's device known to be in range (the engine's sampler makes them),
        not checked: the range check reads the codes back to the host, which waits for the device."""
        if not codes:
            return []
        if not trusted:
            codes = self._checked_codes(codes)
        frames = [c.shape[1] for c in codes]
        vectors = self.quantizer.decode(pad_stack(codes))
        latents = self.fc2(vectors.transpose(1, 2)).transpose(1, 2)
        audio, samples = self.acoustic_decoder(latents, frames)
        return [audio[i, 0, :n].float() for i, n in enumerate(samples)]

    def _checked_codes(self, codes: list[torch.Tensor]) -> list[torch.Tensor]:
        for index, c in enumerate(codes):
            if (
                not isinstance(c, torch.Tensor)
                or c.dim() != 2
                or c.dtype.is_floating_point
                or c.dtype.is_complex
                or c.dtype == torch.bool
            ):
                raise InputError(
                    f"codes[{index}] is {type(c).__name__} {getattr(c, 'dtype', '')} "
                    f"{tuple(getattr(c, 'shape', ()))}; pass integer codes [{self.num_codebooks}, frames]."
                )
            if c.shape[0] != self.num_codebooks:
                raise InputError(
                    f"codes[{index}] has {c.shape[0]} codebooks (shape {tuple(c.shape)}); this codec has "
                    f"{self.num_codebooks}: pass [{self.num_codebooks}, frames]."
                )
            if c.shape[1] == 0:
                raise InputError(f"codes[{index}] has no frames (shape {tuple(c.shape)}); pass at least one.")
        codes = [c.to(self.device, torch.long) for c in codes]
        bounds = torch.stack([torch.stack([c.min(), c.max()]) for c in codes]).tolist()
        for index, (low, high) in enumerate(bounds):
            if low < 0 or high >= self.codebook_size:
                raise InputError(
                    f"codes[{index}] holds id {low if low < 0 else high}, outside the codebook range "
                    f"0..{self.codebook_size - 1}; drop mask/padding ids (e.g. 1024) before decoding."
                )
        return codes


def _identity(cfg: CodecConfig, dtype: torch.dtype, weights: str) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps(cfg.to_dict(), sort_keys=True).encode())
    digest.update(str(dtype).encode())
    digest.update(weights.encode())
    return digest.hexdigest()


def _tensors_digest(weights: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(weights):
        tensor = weights[name].detach().to("cpu")
        tensor = (tensor.float() if tensor.is_floating_point() else tensor).contiguous()
        digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()
