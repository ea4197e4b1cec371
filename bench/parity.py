"""Parity of our engine with the official OmniVoice package (0.2.1) on the same config and weights.

Cases: one request and a batch of 4 of different lengths, with and without a reference. For each,
the official `OmniVoice._generate_iterative` runs in float32 (SDPA, padded batch, dense masks) at
position and class temperature 0; our Runner runs in float32 on the SDPA backend and in bfloat16 on
the fastest backend available. Reported per case and precision: the largest absolute difference and
the cosine of the step-0 target logits (cond and uncond), and the share of equal tokens after all steps.

    python bench/parity.py [--out bench/results/parity-<gpu>.json] [--size full|tiny]

tests/test_official_parity.py runs the same cases (tiny always, full size on CUDA) with thresholds.
Weights are random, drawn like the tiny checkpoint's (peaked head logits); the official text tokenizer
needs a download, so both sides get the same stand-in (about 4 characters a token).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.environment import environment, results_path, write_result  # noqa: E402
from engine.config import EngineConfig, GenerationConfig, ModelConfig  # noqa: E402
from engine.generate.loop import GenItem, Runner  # noqa: E402
from engine.loading import load_model  # noqa: E402
from engine.tiny import tiny_state_dict  # noqa: E402

FULL_DIMS = dict(
    hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    intermediate_size=3072, vocab_size=151676, rope_theta=1e6, rms_norm_eps=1e-6,
    max_position_embeddings=40960,
)  # fmt: skip
TINY_DIMS = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=192, vocab_size=1100, rope_theta=10000.0, rms_norm_eps=1e-6,
    max_position_embeddings=4096,
)  # fmt: skip
NUM_STEP = 32
REF_TEXT = "This is the reference transcript spoken by the speaker in the clip."
TEXTS = [
    "The quick brown fox jumps over the lazy dog while the orchestra plays on the hill.",
    "Short one.",
    "A somewhat longer sentence, with a comma, and [laughter] a non-verbal tag in the middle of it all.",
    "Numbers like twelve and forty two are spelled out here.",
]


@dataclass(frozen=True)
class Request:
    text: str
    ref_frames: int  # 0: no reference
    target_len: int


def cases(size: str) -> dict[str, list[Request]]:
    """One request and a batch of 4 of different lengths, with and without a reference."""
    scale = 1 if size == "tiny" else 4  # full size: a few seconds of audio per request
    lens = [t * scale for t in (30, 12, 41, 23)]
    refs = [r * scale for r in (25, 9, 17, 31)]
    return {
        "B1_ref": [Request(TEXTS[0], refs[0], lens[0])],
        "B1_noref": [Request(TEXTS[0], 0, lens[0])],
        "B4_ref": [Request(TEXTS[i], refs[i], lens[i]) for i in range(4)],
        "B4_noref": [Request(TEXTS[i], 0, lens[i]) for i in range(4)],
    }


class StandInTokenizer:
    """Deterministic text -> ids (about 4 characters a token), called as OmniVoice calls its tokenizer."""

    class Encoding:
        def __init__(self, ids):
            self.input_ids = ids

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __call__(self, text, return_tensors=None, add_special_tokens=True):
        ids = [(sum(map(ord, text[i : i + 4])) * 7919) % self.vocab_size for i in range(0, len(text), 4)] or [
            1
        ]
        return self.Encoding(torch.tensor([ids]) if return_tensors == "pt" else ids)


def build_official(size: str, seed: int, device: str):
    """The official model (float32, SDPA) with seeded weights drawn like the tiny checkpoint's."""
    from omnivoice.models.omnivoice import OmniVoice, OmniVoiceConfig
    from transformers import Qwen3Config

    dims = FULL_DIMS if size == "full" else TINY_DIMS
    llm = Qwen3Config(**dims, tie_word_embeddings=True)
    llm._attn_implementation = "sdpa"
    official = OmniVoice(OmniVoiceConfig(llm_config=llm))
    cfg = ModelConfig.from_dict(json.loads(official.config.to_json_string(use_diff=False)))
    missing, unexpected = official.load_state_dict(tiny_state_dict(cfg, seed=seed), strict=False)
    if missing != ["codebook_layer_offsets"] or unexpected:
        raise RuntimeError(
            f"official model keys differ from ours: missing {missing}, unexpected {unexpected}"
        )
    official.text_tokenizer = StandInTokenizer(dims["vocab_size"])
    return official.to(device=device, dtype=torch.float32).eval()


def save_official_checkpoint(official, out_dir: Path) -> Path:
    """The official model as a checkpoint directory (its config.json and state dict, buffers included)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(official.config.to_json_string(use_diff=False))
    state = {k: v.detach().cpu().contiguous() for k, v in official.state_dict().items()}
    save_file(state, str(out_dir / "model.safetensors"))
    return out_dir


def official_inputs(official, requests: list[Request], seed: int):
    """The official GenerationTask, our GenItems with the same prompt ids, and each cond length."""
    from omnivoice.models.omnivoice import GenerationTask

    g = torch.Generator().manual_seed(seed)
    refs = [
        torch.randint(0, 1024, (8, r.ref_frames), generator=g) if r.ref_frames else None for r in requests
    ]
    ref_texts = [REF_TEXT if r.ref_frames else None for r in requests]
    task = GenerationTask(
        batch_size=len(requests), texts=[r.text for r in requests],
        target_lens=[r.target_len for r in requests],
        langs=["en"] * len(requests), instructs=[None] * len(requests), ref_texts=ref_texts,
        ref_audio_tokens=refs, ref_rms=[0.1] * len(requests),
    )  # fmt: skip
    items, cond_lens = [], []
    for i, r in enumerate(requests):
        inp = official._prepare_inference_inputs(
            r.text, r.target_len, ref_texts[i], refs[i], "en", None, True
        )
        n_text = int((~inp["audio_mask"][0]).sum())
        prompt_ids = inp["input_ids"][0, 0, :n_text].tolist()
        items.append(GenItem(prompt_ids=prompt_ids, ref_tokens=refs[i], target_len=r.target_len, seed=i))
        cond_lens.append(inp["input_ids"].shape[-1])
    return task, items, cond_lens


def first_logits(module, run, *args):
    """run(*args)'s result and the logits of the module's first forward call during it."""
    seen = []

    def hook(_module, _args, output):
        if not seen:
            seen.append((output.logits if hasattr(output, "logits") else output).float().clone())

    handle = module.register_forward_hook(hook)
    try:
        result = run(*args)
    finally:
        handle.remove()
    return result, seen[0]


def official_targets(logits: torch.Tensor, requests: list[Request], cond_lens: list[int]) -> torch.Tensor:
    """[2N, C, V]: cond target logits of every request, then uncond, from the official [2B, C, L, V]."""
    b = len(requests)
    cond = [logits[i, :, cond_lens[i] - r.target_len : cond_lens[i]] for i, r in enumerate(requests)]
    uncond = [logits[b + i, :, : r.target_len] for i, r in enumerate(requests)]
    return torch.cat([t.transpose(0, 1) for t in cond + uncond])


def compare(ours_logits, ours_tokens, ref_logits, ref_tokens) -> dict:
    n = ref_logits.shape[0]
    a, b = ours_logits[:n].double().cpu(), ref_logits.double().cpu()
    same = sum(int((x.cpu() == y.cpu()).sum()) for x, y in zip(ours_tokens, ref_tokens))
    total = sum(y.numel() for y in ref_tokens)
    return {
        "max_abs_logit_diff": float((a - b).abs().max()),
        "logits_cosine": float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)),
        "token_agreement": same / total,
    }


def run_parity(size: str, device: str, seed: int = 0) -> dict[str, dict]:
    """Every case at one size: {case/precision: metrics}."""
    from omnivoice.models.omnivoice import OmniVoiceGenerationConfig

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    official = build_official(size, seed, device)
    official_gen = OmniVoiceGenerationConfig(
        num_step=NUM_STEP, position_temperature=0.0, class_temperature=0.0
    )
    gen = GenerationConfig(num_step=NUM_STEP, position_temperature=0.0, class_temperature=0.0)
    fast_dtype = torch.bfloat16
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = save_official_checkpoint(official, Path(tmp) / "ckpt")
        ours = {
            "fp32": load_model(ckpt, device=device, dtype=torch.float32, attention="sdpa")[1],
            "bf16": load_model(ckpt, device=device, dtype=fast_dtype, attention="auto")[1],
        }
    for name, requests in cases(size).items():
        task, items, cond_lens = official_inputs(official, requests, seed)
        with torch.inference_mode():
            ref_tokens, ref_all = first_logits(official, official._generate_iterative, task, official_gen)
        ref_logits = official_targets(ref_all, requests, cond_lens)
        for precision, model in ours.items():
            dtype = torch.float32 if precision == "fp32" else fast_dtype
            runner = Runner(model, EngineConfig(cuda_graphs=False), device, dtype)
            tokens, logits = first_logits(model, runner.generate, items, gen)
            metrics = compare(logits, tokens, ref_logits, ref_tokens)
            backend = model.attention_backend(torch.device(device), dtype).name
            results[f"{size}/{name}/{precision}"] = {"dtype": precision, "backend": backend, **metrics}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=results_path("parity"))
    parser.add_argument("--size", choices=["full", "tiny"], default="full")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = run_parity(args.size, device, args.seed)
    for case, metrics in results.items():
        print(case, json.dumps(metrics), flush=True)
    report = {
        "environment": environment("transformers", "omnivoice"),
        "device": device,
        "num_step": NUM_STEP,
        "cases": results,
    }
    write_result(Path(args.out), report)


if __name__ == "__main__":
    main()
