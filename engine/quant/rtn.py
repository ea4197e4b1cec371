"""A W4A4 copy of a model by round-to-nearest: for speed measurements and kernel tests, not for quality.

Each backbone Linear becomes a W4A4Linear with a rank-r low-rank branch (the SVD of W) and the residual
quantized round-to-nearest, no calibration; the layers then run exactly the kernels a GPTQ checkpoint's do.
"""

from __future__ import annotations

import copy

import torch

from engine.quant.format import STORE_DTYPE, W4A4Tensors, pack_int4
from engine.quant.gptq import quantize_rtn
from engine.quant.linear import W4A4Linear
from engine.quant.lowrank import lowrank_factors


def w4a4_copy(model: torch.nn.Module, rank: int = 16) -> torch.nn.Module:
    """The model with its backbone Linears (`llm.layers.*`) in W4A4, on their original devices."""
    quantized = copy.deepcopy(model)
    for name, module in list(quantized.named_modules()):
        if isinstance(module, torch.nn.Linear) and name.startswith("llm.layers."):
            w = module.weight.detach().float()
            up, down = lowrank_factors(w, rank)
            q, scales = quantize_rtn(w - up.float() @ down.float().T)
            layer = W4A4Linear.from_tensors(W4A4Tensors(pack_int4(q), scales.to(STORE_DTYPE), down, up))
            parent, child = name.rsplit(".", 1)
            setattr(quantized.get_submodule(parent), child, layer.to(w.device))
    return quantized
