"""W4A4 linear backends and the chooser.

Each backend has `name`, `can_use(device) -> (ok, reason)`, `prepare(layer) -> packed` (once, at load)
and `forward(x, packed) -> y`.

- `CudaW4A4Backend`: the csrc/ kernels (Hopper, sm_90a): activation quantization + low-rank down in one
  kernel, the wgmma GEMM (integers as e4m3 bytes on the FP8 tensor cores) + low-rank up in the other.
  `prepare` repacks the canonical layout once;
  `prepare_group` packs layers that read one input (q/k/v, gate/up) as one GEMM whose weights are stacked
  along N: one activation quantization computes every layer's low-rank input, and each layer's output
  rows read their own low-rank columns. `prepare_swiglu` packs gate and up with their rows interleaved, for
  the GEMM whose epilogue writes silu(gate) * up.
- `ReferenceW4A4Backend`: engine/w4a4/reference.py in plain torch, on any device.

The kernels' operand layouts are defined here in torch (`pack_operand` / `unpack_operand` for the packed
4-bit weights, `pack_activations` / `unpack_activations` for the e4m3 activation tiles) and in
csrc/w4a4_common.cuh; the tests hold the two to each other.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch

from engine.errors import BackendUnavailable, QuantError
from engine.kernels import ops
from engine.w4a4.format import GROUP_SIZE, unpack_int4
from engine.w4a4.reference import ReferenceW4A4Backend, layer_tensors

log = logging.getLogger(__name__)

# Both GEMM operands hold integers n as the e4m3 value n * 2^-9 (csrc/w4a4_common.cuh), so its fp16 sums
# are dot * 2^-18. Its fp16 fold multiplies them by scale ratios ra * rw with ra <= 1 and rw <= 2^15
# (kernel_weight_scales), so that each group adds at most 3584 * 2^-3 and the row factors carry 8 back.
DOT_SCALE = 2.0**18
WEIGHT_RATIO_SCALE = 2.0**15

# reshape of one 16 x 64 tile as (row split, k split) and the permutation to (gr, t, word, byte, step):
# row = 8 * ri + gr, k = 32 * s + 16 * ki + 4 * t + b, word = 2 * ki + ri
_PERM = (0, 3, 2, 6, 5, 1, 7, 4)
_INVERSE_PERM = tuple(_PERM.index(i) for i in range(8))


def e4m3_bytes(q: torch.Tensor) -> torch.Tensor:
    """Integers in [-15, 15] -> uint8: the e4m3 encoding of q * 2^-9, sign bit and magnitude (0..7 subnormal,
    8..15 the smallest normals)."""
    return torch.where(q < 0, 0x80 | -q.to(torch.int16), q.to(torch.int16)).to(torch.uint8)


def integers_of_e4m3(raw: torch.Tensor) -> torch.Tensor:
    """Inverse of e4m3_bytes: uint8 -> int8."""
    magnitude = (raw & 0x7F).to(torch.int8)
    return torch.where(raw >= 0x80, -magnitude, magnitude)


def pack_operand(q: torch.Tensor) -> torch.Tensor:
    """int values in [-8, 7], [rows, K] (rows % 16 == 0, K % 64 == 0) -> int32 [rows/16, K/64, 128].

    The GEMM's packed weights (csrc/w4a4_common.cuh): per 16 x 64 tile, lane (gr, t) holds the A-fragment
    registers of both 32-wide k-steps as nibbles, w coded as w for w >= 0 and 8 | (-w - 1) below.
    """
    rows, k = q.shape
    if rows % 16 or k % GROUP_SIZE:
        raise QuantError(f"pack_operand needs rows % 16 == 0 and K % 64 == 0, got {tuple(q.shape)}")
    t, g = rows // 16, k // GROUP_SIZE
    q16 = q.to(torch.int16)
    nib = torch.where(q16 < 0, 8 | (-q16 - 1), q16).to(torch.uint8)
    tiles = nib.reshape(t, 2, 8, g, 2, 2, 4, 4).permute(*_PERM).contiguous()
    packed = tiles[..., 0] | (tiles[..., 1] << 4)
    return packed.reshape(t, g, 512).view(torch.int32)


def unpack_operand(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_operand: int32 [rows/16, K/64, 128] -> int8 [rows, K]."""
    t, g, _ = packed.shape
    raw = packed.contiguous().view(torch.uint8).reshape(t, g, 8, 4, 2, 2, 4)
    codes = torch.stack((raw & 0xF, raw >> 4), dim=-1).to(torch.int8)
    values = torch.where(codes > 7, 7 - codes, codes)  # 8 | m -> -(m + 1)
    return values.permute(*_INVERSE_PERM).reshape(t * 16, g * GROUP_SIZE)


def pack_activations(q: torch.Tensor) -> torch.Tensor:
    """int values in [-8, 7], [M_pad, K] (M_pad % 128 == 0, K % 64 == 0) -> int8 [M_pad/128, K/64, 8192].

    The quantize kernel's output and the GEMM's B operand as it lands in shared memory: the e4m3 byte of
    q * 2^-9, per 128-row block and K group byte (m, k) at (k // 16) * 2048 + 16 * m + k % 16.
    """
    rows, k = q.shape
    if rows % ops.ACT_BLOCK_ROWS or k % GROUP_SIZE:
        raise QuantError(f"pack_activations needs rows % 128 == 0 and K % 64 == 0, got {tuple(q.shape)}")
    blocks, groups = rows // ops.ACT_BLOCK_ROWS, k // GROUP_SIZE
    tiles = e4m3_bytes(q).view(torch.int8).reshape(blocks, ops.ACT_BLOCK_ROWS, groups, 4, 16)
    return tiles.permute(0, 2, 3, 1, 4).reshape(blocks, groups, -1).contiguous()


def unpack_activations(tiles: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_activations: int8 [M_pad/128, K/64, 8192] -> int8 q [M_pad, K]."""
    blocks, groups, _ = tiles.shape
    raw = tiles.reshape(blocks, groups, 4, ops.ACT_BLOCK_ROWS, 16).permute(0, 3, 1, 2, 4)
    return integers_of_e4m3(raw.reshape(blocks * ops.ACT_BLOCK_ROWS, groups * GROUP_SIZE).view(torch.uint8))


def activation_scale_positions(rows: int) -> torch.Tensor:
    """Where the quantize kernel stores each row's activation scale: in the GEMM fold's reading order
    within 32 rows (thread t reads rows 8j + 2t, 8j + 2t + 1 for j = 0..3 with one 16-byte load), as
    csrc/w4a4_common.cuh's activation_scale_position."""
    r = torch.arange(rows)
    return (r & ~31) + 8 * ((r >> 1) & 3) + 2 * ((r >> 3) & 3) + (r & 1)


def activation_scales_in_row_order(stored: torch.Tensor) -> torch.Tensor:
    """The quantize kernel's activation scale ratios [K/64, M_pad] (or row maxima [M_pad]) with columns back
    in row order."""
    return stored[..., activation_scale_positions(stored.shape[-1]).to(stored.device)]


def activation_scale_ratios(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 scales [M, K/64] -> (fp16 ratios scale / amax_row [M, K/64], amax_row float32 [M]): what the
    quantize kernel writes for the GEMM (0 for an all-zero row)."""
    amax = scales.amax(dim=1)
    inv = torch.where(amax > 0, 1 / amax, 0.0)
    return (scales * inv[:, None]).half(), amax


def kernel_weight_scales(wscales: torch.Tensor, n_pad: int) -> torch.Tensor:
    """[N, K/64] -> float32 [K/64 + 1, N_pad]: per group rw = fp16(ws / wmax_row * 2^15), then the row factor
    8 * wmax_row (csrc/w4a4_gemm.cu's fold; zero rows stay zero)."""
    ws = wscales.float()
    wmax = ws.amax(dim=1, keepdim=True)
    ratios = torch.where(wmax > 0, ws / wmax * WEIGHT_RATIO_SCALE, 0.0).half().float()
    rows = torch.cat([ratios, wmax * (DOT_SCALE / WEIGHT_RATIO_SCALE)], dim=1)
    return torch.nn.functional.pad(rows, (0, 0, 0, n_pad - rows.shape[0])).t().contiguous()


def fp16_rounded_once(x: torch.Tensor) -> torch.Tensor:
    """float64 -> fp16 correctly rounded. torch casts float64 to fp16 through float32 (two roundings);
    rounding to float32 by truncation with the last bit set when inexact ("round to odd") makes the second
    rounding the correct one."""
    f = x.float()
    f = torch.where(f.double().abs() > x.abs(), torch.nextafter(f, torch.zeros_like(f)), f)
    f = torch.where(f.double() != x, (f.view(torch.int32) | 1).view(torch.float32), f)
    return f.half()


def emulate_gemm_fold(
    qx: torch.Tensor,
    aratios: torch.Tensor,
    amax: torch.Tensor,
    qw: torch.Tensor,
    kscales: torch.Tensor,
    k_splits: int = 1,
) -> torch.Tensor:
    """The GEMM's quantized term rounding for rounding, before the low-rank branch: qx int [M, K] with
    aratios fp16 [M, K/64] and amax float32 [M] (activation_scale_ratios), qw int [N, K] with kscales
    float32 [K/64 + 1, N] (kernel_weight_scales) -> float32 [M, N].

    Per group, fp16 throughout: d = dot * 2^-18 (wgmma's sum), s = ra * rw (one rounding),
    acc = fma(d, s, acc) (one rounding); then acc * (amax_row * 8 wmax_row) in float32. Each fp16 step is its
    exact float64 value rounded once. With k_splits = S (the GEMM's choice on small grids: gemm_k_splits)
    split w of S folds groups w G / S .. (w + 1) G / S - 1 into its own acc, and the S sums are added in
    float32 in split order before the scaling."""
    groups = aratios.shape[1]
    dots = torch.einsum(
        "mgk,ngk->mng",
        qx.double().reshape(qx.shape[0], groups, GROUP_SIZE),
        qw.double().reshape(qw.shape[0], groups, GROUP_SIZE),
    )
    ra = aratios.double()
    rw = kscales[:groups].t().half().double()
    total = torch.zeros(dots.shape[:2], device=dots.device)
    for split in range(k_splits):
        acc = torch.zeros(dots.shape[:2], dtype=torch.float16, device=dots.device)
        for g in range(split * groups // k_splits, (split + 1) * groups // k_splits):
            d = fp16_rounded_once(dots[..., g] * 2.0**-18).double()
            s = fp16_rounded_once(ra[:, g, None] * rw[None, :, g]).double()
            acc = fp16_rounded_once(d * s + acc.double())
        total = total + acc.float()
    return total * (amax[:, None] * kscales[groups][None, :])


@dataclass
class CudaW4A4Packed:
    qweight: torch.Tensor  # int32 [N_pad/16, K/64, 128] (pack_operand: weights are wgmma's A operand)
    wscales: torch.Tensor  # float32 [K/64 + 1, N_pad]: scale ratios and row factors (kernel_weight_scales)
    proj_up: torch.Tensor  # float32 [N_pad, r]
    pd_t: dict[torch.dtype, torch.Tensor]  # [r, K] per activation dtype: (proj_down / smooth).T
    smooth: torch.Tensor | None  # float32 [2, K]: smooth, 1 / smooth
    bias: torch.Tensor | None  # float32 [N]
    in_features: int
    out_features: int
    kernel_out_features: int  # the GEMM's N: out_features rounded up to 64 rows (twice it with swiglu)
    splits: list[int]  # the output width of each layer stacked in this GEMM (one entry for a plain layer)
    swiglu: bool = False  # gate and up rows interleaved (swiglu_row_order); the output is silu(gate) * up

    @property
    def segment_starts(self) -> list[int]:
        """The first output column of each stacked layer after the first (the GEMM's `segment_starts`)."""
        return list(itertools.accumulate(self.splits[:-1]))


MAX_GROUP = 3  # layers in one grouped GEMM (csrc/w4a4_launch.h kMaxSegments)


def group_obstacle(tensors: list) -> str | None:
    """Why these layers' canonical tensors cannot run as one grouped GEMM, or None when they can."""
    first = tensors[0]
    if not 2 <= len(tensors) <= MAX_GROUP:
        return f"{len(tensors)} layers; a group has 2 to {MAX_GROUP}"
    for t in tensors:
        if (t.in_features, t.rank) != (first.in_features, first.rank):
            return "the layers differ in input width or rank"
        if t.out_features % 64:
            return f"an output width of {t.out_features} is not a multiple of 64"
        if (t.smooth is None) != (first.smooth is None) or (
            t.smooth is not None and not torch.equal(t.smooth, first.smooth)
        ):
            return "the layers smooth their input differently, so their activations quantize differently"
    return None


def swiglu_row_order(width: int) -> torch.Tensor:
    """The rows of cat(gate, up) [2 width, K] in the SwiGLU GEMM's order: for every 8 output columns, their
    8 gate rows then their 8 up rows, so that a thread of the epilogue holds a gate output and its up output
    (csrc/w4a4_gemm.cu: rows r and r + 8 of the warp's 16)."""
    columns = torch.arange(0, width, 8)[:, None] + torch.arange(8)
    return torch.stack((columns, columns + width), dim=1).reshape(-1)


def swiglu_obstacle(tensors: list) -> str | None:
    """Why (gate, up) cannot run as the SwiGLU GEMM, or None when they can."""
    obstacle = group_obstacle(tensors)
    if obstacle is not None:
        return obstacle
    if len(tensors) != 2 or tensors[0].out_features != tensors[1].out_features:
        return "gate and up must be two layers of one output width"
    if tensors[0].rank != 16:
        return f"rank {tensors[0].rank}; the SwiGLU GEMM takes rank 16 (both layers' 32 low-rank columns)"
    return None


class CudaW4A4Backend:
    name = "cuda-sm90"
    has_fused_rmsnorm = True  # forward_rmsnorm runs the norm inside activation quantization
    has_fused_residual = True  # forward(..., residual) adds it in the GEMM's epilogue

    def can_use(self, device) -> tuple[bool, str]:
        device = torch.device(device)
        if device.type != "cuda":
            return False, f"device is {device}; the W4A4 kernels need a CUDA GPU"
        if not torch.cuda.is_available():
            return False, f"torch {torch.__version__} sees no CUDA GPU"
        cap = torch.cuda.get_device_capability(device)
        if cap != (9, 0):
            name = torch.cuda.get_device_name(device)
            return False, f"{name} is sm_{cap[0]}{cap[1]}; the kernels are built for sm_90a (H100/H200)"
        try:
            ops.load()
        except BackendUnavailable as exc:
            return False, str(exc)
        return True, ""

    def prepare(self, layer) -> CudaW4A4Packed:
        return self._pack([layer_tensors(layer).validate()])

    def prepare_group(self, layers) -> CudaW4A4Packed | None:
        """One packed GEMM for layers that read one input, or None (logged) when they cannot share one."""
        return self._pack_unless(layers, group_obstacle, "W4A4 layers run one by one, not as one GEMM")

    def prepare_swiglu(self, layers) -> CudaW4A4Packed | None:
        """gate and up packed for the GEMM that writes silu(gate) * up, or None (logged) when it cannot."""
        fallback = "W4A4 gate/up run without the SwiGLU GEMM"
        return self._pack_unless(layers, swiglu_obstacle, fallback, swiglu=True)

    def _pack_unless(self, layers, obstacle_of, fallback: str, swiglu: bool = False) -> CudaW4A4Packed | None:
        """The layers packed as one GEMM, or None (`fallback: <obstacle>` logged) if obstacle_of names one."""
        tensors = [layer_tensors(layer).validate() for layer in layers]
        obstacle = obstacle_of(tensors)
        if obstacle is not None:
            log.info("%s: %s", fallback, obstacle)
            return None
        return self._pack(tensors, swiglu=swiglu)

    def _pack(self, tensors: list, swiglu: bool = False) -> CudaW4A4Packed:
        """The kernels' layout of one layer, or of a group stacked along N (group_obstacle is None), or of
        gate and up interleaved (swiglu_obstacle is None)."""
        first = tensors[0]
        device = first.qweight.device
        if device.type != "cuda":
            raise BackendUnavailable(
                f"{self.name}.prepare got a layer on {device}; move the layer to the GPU before preparing it."
            )
        widths = [t.out_features for t in tensors]
        n, k = sum(widths), first.in_features
        n_pad = ops.padded_rows(n, ops.BLOCK_N)
        n_run = ops.padded_rows(n, 64)
        # the rows in the GEMM's order: stacked, or interleaved for the SwiGLU GEMM
        order = swiglu_row_order(widths[0]).to(device) if swiglu else torch.arange(n, device=device)
        q = torch.cat([unpack_int4(t.qweight) for t in tensors])[order]
        q = torch.nn.functional.pad(q, (0, 0, 0, n_pad - n))
        pd = torch.cat([t.proj_down.float() for t in tensors], dim=1)
        smooth = None
        if first.smooth is not None:
            s = first.smooth.float()
            pd = pd / s[:, None]
            # the kernel divides by smooth through its reciprocal (correctly rounded, computed on the CPU)
            smooth = torch.stack((s, (torch.ones(s.shape) / s.cpu()).to(s.device))).contiguous()
        pd_t = pd.t().contiguous()
        # the SwiGLU GEMM's rows read both layers' low-rank columns: zeros in the other layer's
        ups = [t.proj_up.float() for t in tensors]
        proj_up = (torch.block_diag(*ups) if swiglu else torch.cat(ups))[order]
        bias = None
        if any(t.bias is not None for t in tensors):
            zeros = [torch.zeros(w, device=device) for w in widths]
            bias = torch.cat([t.bias.float() if t.bias is not None else z for t, z in zip(tensors, zeros)])
            bias = torch.nn.functional.pad(bias[order], (0, n_run - n))
        return CudaW4A4Packed(
            qweight=pack_operand(q),
            wscales=kernel_weight_scales(torch.cat([t.wscales for t in tensors])[order], n_pad),
            proj_up=torch.nn.functional.pad(proj_up, (0, 0, 0, n_pad - n)).contiguous(),
            pd_t={dt: pd_t.to(dt) for dt in (torch.bfloat16, torch.float16)},
            smooth=smooth,
            bias=bias,
            in_features=k,
            out_features=n // 2 if swiglu else n,
            kernel_out_features=n_run,
            splits=[n // 2] if swiglu else widths,
            swiglu=swiglu,
        )

    def forward(
        self, x: torch.Tensor, packed: CudaW4A4Packed, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The packed layer on x; with a residual (x's dtype, the output's shape): residual + that, added in
        the GEMM's epilogue with torch's rounding where the GEMM writes the whole output (else after it)."""
        x2 = self._rows(x, packed)
        p = packed
        fused_residual = residual is not None and self._takes_residual(residual, x, p)
        if p.segment_starts or p.swiglu or fused_residual:
            quantized = ops.load().quantize_act_lora_down(x2, p.smooth, p.pd_t[x.dtype])
            rows = residual.reshape(x2.shape[0], -1) if fused_residual else None
            y = self._gemm(quantized, x2.shape[0], x.shape[:-1], x.dtype, p, rows)
        else:
            y = ops.load().w4a4_linear(
                x2, p.smooth, p.pd_t[x.dtype], p.qweight, p.wscales, p.proj_up, p.bias, p.kernel_out_features
            )
            y = self._output(y, x.shape[:-1], packed)
        return y if residual is None or fused_residual else residual + y

    @staticmethod
    def _takes_residual(residual: torch.Tensor, x: torch.Tensor, p: CudaW4A4Packed) -> bool:
        """Whether the GEMM can add this residual: one plain layer whose output it writes whole, and rows it
        can read (contiguous, 16-byte aligned, x's dtype)."""
        return (
            not (p.segment_starts or p.swiglu)
            and p.kernel_out_features == p.out_features
            and residual.shape == (*x.shape[:-1], p.out_features)
            and residual.dtype == x.dtype
            and residual.is_contiguous()
            and residual.data_ptr() % 16 == 0
        )

    def forward_rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, packed: CudaW4A4Packed):
        """forward(RMSNorm(x)) with the norm computed inside the activation quantization kernel."""
        x2 = self._rows(x, packed)
        quantized = ops.load().rmsnorm_quantize_act_lora_down(
            x2, weight, eps, packed.smooth, packed.pd_t[x.dtype]
        )
        return self._gemm(quantized, x2.shape[0], x.shape[:-1], x.dtype, packed)

    def _rows(self, x: torch.Tensor, packed: CudaW4A4Packed) -> torch.Tensor:
        """x as [M, K] rows the kernels can read."""
        k = packed.in_features
        if x.shape[-1] != k:
            raise QuantError(f"W4A4 layer expects inputs with last dimension {k}, got {tuple(x.shape)}.")
        if x.dtype not in packed.pd_t:
            raise QuantError(
                f"{self.name} takes bfloat16 or float16 activations, got {x.dtype}; run the model in "
                "bf16/fp16 or choose the reference backend."
            )
        x2 = x.reshape(-1, k)
        if not x2.is_contiguous() or x2.data_ptr() % 16:
            x2 = x2.clone(memory_format=torch.contiguous_format)
        return x2

    def _gemm(self, quantized, m: int, lead, dtype, packed: CudaW4A4Packed, residual=None) -> torch.Tensor:
        qact, aratios, amax, lora = quantized
        p = packed
        n = p.kernel_out_features
        y = ops.load().gemm_lora_up(
            qact,
            aratios,
            amax,
            lora,
            p.qweight,
            p.wscales,
            p.proj_up,
            p.bias,
            m,
            n,
            dtype,
            p.segment_starts,
            p.swiglu,
            residual,
        )
        return self._output(y, lead, packed)

    @staticmethod
    def _output(y: torch.Tensor, lead, packed: CudaW4A4Packed) -> torch.Tensor:
        n = packed.out_features
        if y.shape[-1] != n:  # layers narrower than 64 rows (the tiny model's k/v projections)
            y = y[:, :n]
        return y.reshape(*lead, n)


BACKENDS = (CudaW4A4Backend, ReferenceW4A4Backend)


def w4a4_backend_report(device) -> list[tuple[str, bool, str]]:
    """(name, usable, reason) for every backend in priority order."""
    return [(cls.name, *cls().can_use(device)) for cls in BACKENDS]


def choose_w4a4_backend(device, prefer: str = "auto"):
    """The fastest usable backend for `device`; logs why each faster one was skipped.

    `prefer` (EngineConfig.w4a4_backend): "auto", "cuda-sm90" or "reference". Asking for a backend by name
    that cannot run here raises BackendUnavailable.
    """
    names = [cls.name for cls in BACKENDS]
    if prefer != "auto" and prefer not in names:
        raise BackendUnavailable(f"unknown W4A4 backend {prefer!r}; choose one of {['auto', *names]}")
    for cls in BACKENDS:
        if prefer != "auto" and cls.name != prefer:
            continue
        backend = cls()
        ok, reason = backend.can_use(device)
        if ok:
            log.info("W4A4 backend on %s: %s", device, backend.name)
            return backend
        if prefer != "auto":
            raise BackendUnavailable(f"W4A4 backend {prefer!r} cannot run on {device}: {reason}")
        log.warning("W4A4 backend %s skipped on %s: %s", backend.name, device, reason)
    raise BackendUnavailable(f"no W4A4 backend can run on {device}")  # unreachable: the reference always can
