"""How close e4m3 Linears come to bf16: step-0 logits cosine of FP8 variants (full size, random weights, CPU).

Issue 43 asks fp8 vs bf16 step-0 logits cosine >= 0.999. The engine's FP8 (per-token x per-channel scales,
DESIGN.md) measured 0.9955 on the H200. This bench asks on the CPU whether any scale layout, or which
Linears kept in bf16, would reach 0.999: the backbone's random full-size weights (the e2e benchmarks'),
8 requests (test_fp8's), bf16 activations as on the GPU. Variants:
- `fp8 (Fp8Linear)`: the engine's Fp8Linear on every backbone Linear (its torch reference numerics here);
- `e4m3 emulated`: each Linear's input and weight rounded to e4m3 with one scale per block (a token's
  `1 x K` and an output channel's `1 x K`: the contract; `1 x 128` and `128 x 128`: DeepSeek-V3's block
  scales; `1 x 32` both), then a bf16 GEMM (the dequantized values rounded to bf16: 4 more mantissa bits
  than e4m3's 3); with the contract's scales, also with some Linears left in bf16 (`in_bf16`).
Each: cosine of its logits against bf16's and fp32's (the mean over target rows), and how many of the
backbone's Linears (q/k/v and gate/up merged, as the engine runs them) are in e4m3. Random weights have no
outlier channels, where finer scales matter most on real ones: this measures e4m3's rounding alone.

    python bench/fp8_noise.py [--out bench/results/fp8-noise-cpu.json]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.environment import environment, write_result  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.fp8.reference import dequantize_rows, quantize_rows  # noqa: E402
from engine.generate.packing import GenItem, pack_items  # noqa: E402
from engine.loading import backbone_to_fp8, prepare_for_inference  # noqa: E402
from engine.model.linear import DenseLinear  # noqa: E402
from engine.model.omnivoice import OmniVoiceModel  # noqa: E402
from engine.tiny import tiny_state_dict  # noqa: E402

# (prompt tokens, reference frames, target frames) of each request: test_fp8's full-size case
REQUESTS = [(40, 120, 150), (30, 0, 100), (25, 80, 210), (50, 100, 90)] * 2
WHOLE_ROW = 0  # a block width: the whole row


def e4m3_blocks(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """t [M, K] rounded to e4m3 with one scale per rows x cols block, back in t's dtype: each block laid out
    as one row for the engine's own row-wise rounding (engine/fp8/reference.py)."""
    m, k = t.shape
    cols = cols or k
    blocks = t.reshape(m // rows, rows, k // cols, cols).transpose(1, 2).reshape(-1, rows * cols)
    rounded = dequantize_rows(*quantize_rows(blocks))
    return rounded.reshape(m // rows, k // cols, rows, cols).transpose(1, 2).reshape(m, k).to(t.dtype)


class E4m3Rounded(DenseLinear):
    """A dense Linear whose weight and each input are rounded to e4m3 in blocks (e4m3_blocks)."""

    def __init__(self, dense: DenseLinear, activation_cols: int, weight_block: tuple[int, int]):
        with torch.device("meta"):
            super().__init__(dense.in_features, dense.out_features, bias=dense.bias is not None)
        rounded = e4m3_blocks(dense.weight.detach(), *weight_block)
        self.weight = torch.nn.Parameter(rounded, requires_grad=False)
        self.bias = dense.bias
        self.splits, self.fused = dense.splits, dense.fused
        self.activation_cols = activation_cols

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        rounded = e4m3_blocks(x.reshape(-1, x.shape[-1]), 1, self.activation_cols).reshape(x.shape)
        return super().forward(rounded, residual)


def backbone_linears(model: OmniVoiceModel) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, DenseLinear) and n.startswith("llm.layers.")]


def replace_linears(
    model: OmniVoiceModel, make: Callable[[DenseLinear], torch.nn.Module], keep: Callable[[str], bool]
) -> int:
    """Each backbone Linear whose name keep() is false for replaced by make(it); how many were."""
    replaced = 0
    for name in backbone_linears(model):
        if not keep(name):
            parent, child = name.rsplit(".", 1)
            setattr(model.get_submodule(parent), child, make(model.get_submodule(name)))
            replaced += 1
    return replaced


def layer_of(name: str) -> int:
    return int(name.split(".")[2])  # llm.layers.<i>.<module>.<linear>


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "fp8-noise-cpu.json")
    args = parser.parse_args()
    cfg = ModelConfig()
    model = OmniVoiceModel(cfg)
    model.load_state_dict(tiny_state_dict(cfg))
    model = prepare_for_inference(model.eval().requires_grad_(False))  # q/k/v and gate/up merged, as run
    g = torch.Generator().manual_seed(5)
    items = [
        GenItem(
            torch.randint(0, 1000, (text,), generator=g).tolist(),
            torch.randint(0, 1024, (cfg.num_audio_codebook, ref), generator=g) if ref else None,
            target,
            1000 + i,
        )
        for i, (text, ref, target) in enumerate(REQUESTS)
    ]
    batch = pack_items(items, cfg.num_audio_codebook, cfg.audio_mask_id)

    def logits(model: OmniVoiceModel) -> torch.Tensor:
        with torch.inference_mode():
            return model(batch, float32=False).float()

    def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
        return round(F.cosine_similarity(a, b, dim=-1).mean().item(), 5)

    reference = logits(model)
    bf16 = model.to(torch.bfloat16)
    base = logits(bf16)
    linears = len(backbone_linears(bf16))
    entries = []

    def measure(variant: str, scales: str, in_bf16: str, model: OmniVoiceModel, e4m3_linears: int) -> None:
        start = time.perf_counter()
        out = logits(model)
        entries.append(
            {
                "variant": variant,
                "scales": scales,
                "in_bf16": in_bf16,
                "e4m3_linears": e4m3_linears,
                "cos_vs_bf16": cosine(out, base),
                "cos_vs_fp32": cosine(out, reference),
            }
        )
        print(entries[-1], f"{time.perf_counter() - start:.0f} s", flush=True)

    contract = "token 1 x K, channel 1 x K"
    measure("bf16", "-", "all", bf16, 0)
    measure("fp8 (Fp8Linear)", contract, "none", backbone_to_fp8(copy.deepcopy(bf16)), linears)
    for activation_cols, weight_block in ((WHOLE_ROW, (1, WHOLE_ROW)), (128, (128, 128)), (32, (1, 32))):
        model = copy.deepcopy(bf16)
        n = replace_linears(
            model, lambda d, a=activation_cols, w=weight_block: E4m3Rounded(d, a, w), lambda _: False
        )
        scales = f"token 1 x {activation_cols or 'K'}, weight {weight_block[0]} x {weight_block[1] or 'K'}"
        measure("e4m3 emulated", scales.replace("weight 1 x K", "channel 1 x K"), "none", model, n)
    kept = {
        "qkv_proj": lambda n: n.endswith(".qkv_proj"),
        "o_proj": lambda n: n.endswith(".o_proj"),
        "gate_up_proj": lambda n: n.endswith(".gate_up_proj"),
        "down_proj": lambda n: n.endswith(".down_proj"),
        "qkv_proj, o_proj": lambda n: ".self_attn." in n,
        "layers 0-13": lambda n: layer_of(n) < cfg.llm.num_hidden_layers // 2,
        "layers 14-27": lambda n: layer_of(n) >= cfg.llm.num_hidden_layers // 2,
    }
    for what, keep in kept.items():  # emulated: an Fp8Linear hands down_proj its input quantized
        model = copy.deepcopy(bf16)
        n = replace_linears(model, lambda d: E4m3Rounded(d, WHOLE_ROW, (1, WHOLE_ROW)), keep)
        measure("e4m3 emulated", contract, what, model, n)
    write_result(
        args.out,
        {
            "bench": "fp8_noise",
            "environment": environment(),
            "size": "full",
            "weights": "random (tiny_state_dict of the full-size config)",
            "packed_tokens": int(batch.input_ids.shape[-1]),
            "backbone_linears": linears,
            "entries": entries,
        },
    )


if __name__ == "__main__":
    main()
