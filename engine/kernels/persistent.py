"""What the persistent Triton GEMMs (engine/kernels/swiglu.py, qkv_rope.py) share: the weights they take
(bf16/fp16 on a Hopper GPU), and one program per multiprocessor, each walking output tiles GROUP row tiles
at a time, so that the weight tiles a group reads stay in L2 (the usual grouped order)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

OUT_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def takes(weight: torch.Tensor) -> bool:
    """A contiguous bf16/fp16 weight on a Hopper GPU whose rows the tensor copy engine can address."""
    return (
        weight.is_cuda
        and weight.dtype in OUT_TYPES
        and torch.cuda.get_device_capability(weight.device)[0] == 9
        and weight.is_contiguous()
        and weight.shape[-1] % 8 == 0
    )


@triton.jit
def tile_origin(tile, tiles_m, tiles_n, BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr):
    """The first row and column of output tile number `tile` in the grouped order."""
    per_group = GROUP * tiles_n
    first = (tile // per_group) * GROUP
    rows_in_group = tl.minimum(tiles_m - first, GROUP)
    return (first + tile % rows_in_group) * BM, ((tile % per_group) // rows_in_group) * BN


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# Off CUDA (Triton's interpreter, tests/test_triton_interpret.py) a few programs, so that each walks several
# tiles as on a GPU.
INTERPRETER_PROGRAMS = 3


def programs(device: torch.device, tiles: int) -> int:
    """How many persistent programs to launch for `tiles` output tiles: one per multiprocessor."""
    return min(_multiprocessors(device) if device.type == "cuda" else INTERPRETER_PROGRAMS, tiles)


def launch(kernel, device: torch.device, tiles: int, *args, **meta) -> None:
    """Run a persistent kernel over `tiles` output tiles: `args`, then the number of programs launched."""
    launched = programs(device, tiles)
    kernel[(launched,)](*args, launched, **meta)
