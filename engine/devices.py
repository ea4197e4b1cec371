"""Torch's side of the engine settings: precision names as dtypes, device names as devices (apart from
engine.config so that the planner's worker processes read settings without importing torch)."""

from __future__ import annotations

import torch

from engine.errors import InputError

# Activation dtype of each unquantized precision name.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def building_on_meta() -> bool:
    """Whether modules built now land on the meta device (the loaders build there, then assign the file's
    weights), where some of torch's random inits and weight_norm run its reference ops, which import
    torch._dynamo: seconds, once a process."""
    return torch.empty(0).is_meta


def resolve_device(name: str) -> torch.device:
    """A device name (auto | cpu | cuda | cuda:N) as a torch.device; auto picks CUDA when there is one."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise InputError(f"device={name!r}: use auto, cpu, cuda or cuda:N.") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError(
            f"device={name!r} but torch {torch.__version__} sees no CUDA GPU: use device='cpu' or 'auto'."
        )
    return device


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """t on `device`. From the host to CUDA the copy goes through pinned memory and is queued on the current
    stream without waiting: a copy from pageable memory first waits for all the work queued there."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
