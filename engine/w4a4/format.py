"""The canonical W4A4 layout: int4 packing, group-64 scales, per-Linear tensors, metadata, safetensors I/O.

One quantized Linear (weight W [N, K] in the source checkpoint) is stored as:

    {name}.qweight    uint8   [N, K/2]   two int4 values per byte, low nibble = even k, values in [-8, 7]
    {name}.wscales    float16 [N, K/64]  one scale per output row and group of 64 inputs
    {name}.proj_down  float16 [K, r]     low-rank branch, applied to the (smoothed) input
    {name}.proj_up    float16 [N, r]
    {name}.smooth     float16 [K]        optional: the layer computes on x / smooth
    {name}.bias       (as in the source, when the Linear has one)

The metadata (QuantMeta) sits in config.json["quantization"] and, identically, in the safetensors header,
together with a checksum of the tensor data, so a truncated, corrupted or mixed-up file is refused at load.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.errors import QuantError
from engine.fsmodes import chmod_as_created

FORMAT_NAME = "ovbatch-w4a4"
# Version 2: source_hash is engine.checkpoint.checkpoint_fingerprint (sha256) of the source checkpoint.
# Version 1 recorded a blake2b hash there; its tensors are the same, so it is still read.
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
GROUP_SIZE = 64
QMIN, QMAX = -8, 7
# Storage dtype of scales and the low-rank/smoothing tensors. Quantizers round scales to it *before*
# choosing integer values, so what is stored is exactly what was optimised.
STORE_DTYPE = torch.float16
SUPPORTED_RANKS = (16, 32)
TENSOR_FIELDS = ("qweight", "wscales", "proj_down", "proj_up", "smooth", "bias")
HEADER_META_KEY = "ovbatch_quantization"
HEADER_CHECKSUM_KEY = "ovbatch_checksum"


def check_group_multiple(name: str, in_features: int, group_size: int = GROUP_SIZE) -> None:
    if in_features % group_size:
        raise QuantError(
            f"{name}: in_features={in_features} is not a multiple of the W4A4 group size {group_size}; "
            "W4A4 needs every quantized Linear's input size to be a multiple of it. Leave this layer "
            "in higher precision or pad its input dimension."
        )


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int values in [-8, 7], shape [N, K] (K even) -> uint8 [N, K/2]; low nibble holds the even k."""
    if q.dim() != 2 or q.shape[1] % 2:
        raise QuantError(f"pack_int4 needs a 2-D tensor with an even last dimension, got {tuple(q.shape)}.")
    if q.numel() and (int(q.min()) < QMIN or int(q.max()) > QMAX):
        raise QuantError(
            f"pack_int4: values must lie in [{QMIN}, {QMAX}], got [{int(q.min())}, {int(q.max())}]."
        )
    nib = (q.to(torch.int16) & 0xF).to(torch.uint8)
    return nib[:, 0::2] | (nib[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> int8 [N, K] with values in [-8, 7] (inverse of pack_int4)."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise QuantError(
            f"unpack_int4 needs a uint8 [N, K/2] tensor, got {packed.dtype} {tuple(packed.shape)}."
        )
    lo = (packed & 0xF).to(torch.int8)
    hi = (packed >> 4).to(torch.int8)
    both = torch.stack((lo, hi), dim=-1).reshape(packed.shape[0], packed.shape[1] * 2)
    return torch.where(both > QMAX, both - 16, both)


def weight_group_scales(w: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """Symmetric per-row, per-group scales max|w| / 7, rounded to STORE_DTYPE, returned as float32."""
    n, k = w.shape
    amax = w.float().reshape(n, k // group_size, group_size).abs().amax(-1)
    return (amax / QMAX).to(STORE_DTYPE).float()


def quantize_to_grid(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest of w [N, g*64] (or a column block) on the given per-element-broadcast scales."""
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w / safe).clamp_(QMIN, QMAX)
    return torch.where(scales > 0, q, torch.zeros_like(q))


@dataclass
class W4A4Tensors:
    """The canonical tensors of one quantized Linear (see the module docstring for shapes)."""

    qweight: torch.Tensor
    wscales: torch.Tensor
    proj_down: torch.Tensor
    proj_up: torch.Tensor
    smooth: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * 2

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def rank(self) -> int:
        return self.proj_down.shape[1]

    def validate(self, name: str = "layer") -> W4A4Tensors:
        n, k = self.out_features, self.in_features
        if self.qweight.dtype != torch.uint8:
            raise QuantError(f"{name}.qweight has dtype {self.qweight.dtype}; the format stores uint8.")
        check_group_multiple(name, k)
        expect = {
            "wscales": (n, k // GROUP_SIZE),
            "proj_down": (k, self.rank),
            "proj_up": (n, self.rank),
        }
        if self.smooth is not None:
            expect["smooth"] = (k,)
        if self.bias is not None:
            expect["bias"] = (n,)
        for key, shape in expect.items():
            got = tuple(getattr(self, key).shape)
            if got != shape:
                raise QuantError(
                    f"{name}.{key} has shape {got}, expected {shape} for a {n}x{k} layer of rank "
                    f"{self.rank}; "
                    "the file does not follow the ovbatch-w4a4 layout: re-run `ovbatch quantize`."
                )
        for key in ("wscales", "proj_down", "proj_up", "smooth", "bias"):
            t = getattr(self, key)
            if t is not None and not torch.isfinite(t).all():
                raise QuantError(
                    f"{name}.{key} holds NaN or inf values: the file is corrupt; re-run `ovbatch quantize`."
                )
        if (self.wscales < 0).any() or (self.smooth is not None and (self.smooth <= 0).any()):
            raise QuantError(
                f"{name}: negative scales or non-positive smoothing factors: the file is corrupt."
            )
        return self

    def to(self, device: torch.device | str) -> W4A4Tensors:
        return W4A4Tensors(
            **{k: (v.to(device) if v is not None else None) for k, v in self.items(all_fields=True)}
        )

    def items(self, all_fields: bool = False) -> Iterable[tuple[str, torch.Tensor | None]]:
        for key in TENSOR_FIELDS:
            value = getattr(self, key)
            if value is not None or all_fields:
                yield key, value

    def state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        """{prefix}.{field} -> tensor, contiguous, as written to the checkpoint."""
        return {f"{prefix}.{key}": value.contiguous() for key, value in self.items()}

    @classmethod
    def from_state(cls, prefix: str, state: Mapping[str, torch.Tensor]) -> W4A4Tensors:
        missing = [f for f in ("qweight", "wscales", "proj_down", "proj_up") if f"{prefix}.{f}" not in state]
        if missing:
            raise QuantError(
                f"W4A4 checkpoint lacks {', '.join(prefix + '.' + m for m in missing)}: the file is "
                "truncated or not an ovbatch-w4a4 checkpoint; re-run `ovbatch quantize`."
            )
        return cls(**{f: state.get(f"{prefix}.{f}") for f in TENSOR_FIELDS}).validate(prefix)


@dataclass(frozen=True)
class QuantMeta:
    """config.json["quantization"]: what a W4A4 checkpoint is and what it was made from."""

    rank: int
    source_hash: str
    group_size: int = GROUP_SIZE
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION
    layers: tuple[str, ...] = ()  # qualified names of the quantized Linears
    settings: dict[str, Any] = field(default_factory=dict)  # quantizer settings (calibration, GPTQ, ...)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layers"] = list(self.layers)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "config.json") -> QuantMeta:
        if not isinstance(d, Mapping):
            raise QuantError(f"{where}: 'quantization' must be an object, got {type(d).__name__}.")
        if d.get("format") != FORMAT_NAME:
            raise QuantError(
                f"{where}: quantization format {d.get('format')!r} is not {FORMAT_NAME!r}; this engine only "
                "loads checkpoints written by `ovbatch quantize`."
            )
        if d.get("version") not in READABLE_VERSIONS:
            raise QuantError(
                f"{where}: W4A4 format version {d.get('version')!r}, this engine reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}; "
                "re-quantize the source checkpoint with this version (`ovbatch quantize SOURCE --out DIR`)."
            )
        if d.get("group_size") != GROUP_SIZE:
            raise QuantError(
                f"{where}: group_size {d.get('group_size')!r} is unsupported; only {GROUP_SIZE} is."
            )
        if d.get("rank") not in SUPPORTED_RANKS:
            raise QuantError(f"{where}: rank {d.get('rank')!r} is unsupported; use one of {SUPPORTED_RANKS}.")
        if not isinstance(d.get("source_hash"), str) or not d["source_hash"]:
            raise QuantError(f"{where}: quantization.source_hash is missing; re-run `ovbatch quantize`.")
        return cls(
            rank=int(d["rank"]),
            source_hash=d["source_hash"],
            group_size=int(d["group_size"]),
            format=d["format"],
            version=int(d["version"]),
            layers=tuple(d.get("layers", ())),
            settings=dict(d.get("settings", {})),
        )


def tensors_checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    """blake2b over names, dtypes, shapes and bytes of every tensor (sorted by name)."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def write_w4a4_safetensors(path: str | Path, tensors: Mapping[str, torch.Tensor], meta: QuantMeta) -> None:
    """Write all tensors of a W4A4 checkpoint with the metadata and checksum in the header (atomic)."""
    path = Path(path)
    cpu = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    header = {
        "format": "pt",
        HEADER_META_KEY: json.dumps(meta.to_dict(), sort_keys=True),
        HEADER_CHECKSUM_KEY: tensors_checksum(cpu),
    }
    tmp = path.with_name(path.name + ".tmp")
    try:
        save_file(cpu, str(tmp), metadata=header)
        chmod_as_created(tmp)  # safetensors writes owner-only files
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_w4a4_safetensors(
    path: str | Path, expected: QuantMeta | None = None, device: str = "cpu"
) -> tuple[dict[str, torch.Tensor], QuantMeta]:
    """Read a W4A4 model.safetensors, verify header metadata (against `expected`) and the data checksum."""
    path = Path(path)
    redo = "re-run `ovbatch quantize` to rewrite the checkpoint."
    if not path.is_file():
        raise QuantError(f"{path} not found: a W4A4 checkpoint directory needs model.safetensors; {redo}")
    try:
        with safe_open(str(path), framework="pt", device=device) as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for truncated/garbled files
        raise QuantError(f"{path} is truncated or corrupt ({type(e).__name__}: {e}); {redo}") from None
    if HEADER_META_KEY not in header:
        raise QuantError(f"{path} has no W4A4 metadata in its header: it is not an ovbatch-w4a4 file; {redo}")
    try:
        meta = QuantMeta.from_dict(json.loads(header[HEADER_META_KEY]), where=str(path))
    except json.JSONDecodeError:
        raise QuantError(f"{path}: the W4A4 metadata in the header is not valid JSON; {redo}") from None
    if expected is not None:
        if meta.source_hash != expected.source_hash:
            raise QuantError(
                f"{path} was quantized from source {meta.source_hash}, but config.json says "
                f"{expected.source_hash}: the weights and config come from different runs; {redo}"
            )
        if meta.to_dict() != expected.to_dict():
            raise QuantError(f"{path}: header metadata differs from config.json['quantization']; {redo}")
    if tensors_checksum(tensors) != header.get(HEADER_CHECKSUM_KEY):
        raise QuantError(f"{path}: tensor data fails its checksum (the file is corrupt); {redo}")
    for name in meta.layers:
        down = tensors.get(f"{name}.proj_down")
        if down is not None and down.dim() == 2 and down.shape[1] != meta.rank:
            raise QuantError(
                f"{path}: {name}.proj_down has rank {down.shape[1]}, but the metadata says rank {meta.rank}; "
                f"{redo}"
            )
    return tensors, meta
