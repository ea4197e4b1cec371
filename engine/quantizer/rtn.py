"""A W4A4 copy of a model by round-to-nearest: for speed measurements and kernel tests, not for quality.

Each backbone Linear becomes a W4A4Linear with a rank-r low-rank branch (the SVD of W) and the residual
quantized round-to-nearest, no calibration; the layers then run exactly the kernels a GPTQ checkpoint's do.
A merged Linear (q/k/v, gate/up) is quantized member by member and merged again as a W4A4 group.
"""

from __future__ import annotations

import copy

import torch

from engine.model import DenseLinear, merge_linears
from engine.quantizer.gptq import quantize_rtn
from engine.quantizer.lowrank import lowrank_factors
from engine.w4a4.format import STORE_DTYPE, W4A4Tensors, pack_int4
from engine.w4a4.linear import W4A4Linear


def rtn_tensors(weight: torch.Tensor, bias: torch.Tensor | None, rank: int) -> W4A4Tensors:
    """The canonical W4A4 tensors of one Linear: rank-r SVD branch, round-to-nearest residual."""
    w = weight.detach().float()
    up, down = lowrank_factors(w, rank)
    q, scales = quantize_rtn(w - up.float() @ down.float().T)
    b = None if bias is None else bias.detach().float()
    return W4A4Tensors(pack_int4(q), scales.to(STORE_DTYPE), down, up, bias=b)


def w4a4_copy(model: torch.nn.Module, rank: int = 16) -> torch.nn.Module:
    """The model with its backbone Linears (`llm.layers.*`) in W4A4, biases kept, on their original
    devices, each with the fast-path flags of the Linear it replaces."""
    quantized = copy.deepcopy(model)
    for name, module in list(quantized.named_modules()):
        if not (isinstance(module, DenseLinear) and name.startswith("llm.layers.")):
            continue
        rows = module.weight.split(module.splits)
        biases = module.bias.split(module.splits) if module.bias is not None else [None] * len(rows)
        members = []
        for w, b in zip(rows, biases):
            member = W4A4Linear.from_tensors(rtn_tensors(w, b, rank)).to(w.device)
            member.fused = module.fused
            members.append(member)
        layer = members[0] if len(members) == 1 else merge_linears(members)
        parent, child = name.rsplit(".", 1)
        setattr(quantized.get_submodule(parent), child, layer)
    return quantized
