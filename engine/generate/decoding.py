"""The step math of OmniVoice's iterative unmasking, vectorised over all requests of a batch.

Each step: classifier-free guidance on log-probabilities, MASK excluded, a token per (frame, codebook)
(greedy, or Gumbel-max over the top 10% classes at class temperature), a confidence score (max
log-prob minus a per-codebook penalty, Gumbel-perturbed at position temperature), and per request the
k most confident still-masked positions take their tokens, k following the time-shifted schedule.

Target positions of all requests are held flat: row n of the [N, C] tensors is a frame of one request,
requests one after another. Randomness is per request: each has its own generator seeded with its seed,
and every draw has a shape that depends only on that request, so a request's tokens do not depend on
which other requests share its batch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.config import GenerationConfig
from engine.devices import to_device
from engine.kernels.heads import fused_guided_argmax

TOP_CLASS_RATIO = 0.1  # class sampling keeps the top 10% of the audio vocabulary


def time_steps(num_step: int, t_shift: float) -> list[float]:
    """num_step + 1 times from 0 to 1, shifted towards 0 by t_shift (computed in float32, as upstream)."""
    t = torch.linspace(0.0, 1.0, num_step + 1)
    return (t_shift * t / (1 + (t_shift - 1) * t)).tolist()


def unmask_schedule(total: int, num_step: int, t_shift: float) -> list[int]:
    """How many of `total` masked positions each step unmasks; the last step takes the rest."""
    times = time_steps(num_step, t_shift)
    counts, remaining = [], total
    for step in range(num_step):
        n = (
            remaining
            if step == num_step - 1
            else min(math.ceil(total * (times[step + 1] - times[step])), remaining)
        )
        counts.append(n)
        remaining -= n
    return counts


def gumbel(uniforms: Tensor) -> Tensor:
    return -torch.log(-torch.log(uniforms + 1e-10) + 1e-10)


def top_class_count(vocab: int) -> int:
    return math.ceil(TOP_CLASS_RATIO * vocab)


class RequestNoise:
    """One request's random draws, from its own generator seeded with its seed.

    Position noise for all steps is drawn up front ([num_step, T, C]); class noise (only at class
    temperature > 0) is drawn step by step, [T, C, top classes], in step order.
    """

    def __init__(self, seed: int, target_len: int, num_codebooks: int, gen: GenerationConfig, device):
        self.generator = torch.Generator(device=device).manual_seed(int(seed))  # numpy integers too
        self.target_len, self.num_codebooks, self.device = target_len, num_codebooks, device
        self.position = None
        if gen.position_temperature > 0:
            shape = (gen.num_step, target_len, num_codebooks)
            self.position = torch.rand(shape, generator=self.generator, device=device)

    def class_uniforms(self, top: int) -> Tensor:
        shape = (self.target_len, self.num_codebooks, top)
        return torch.rand(shape, generator=self.generator, device=self.device)


def guided_log_probs(cond: Tensor, uncond: Tensor, guidance_scale: float, mask_id: int) -> Tensor:
    """log-softmax of c + g * (c - u) over the classes (c, u: log-softmaxes), MASK set to -inf."""
    c = F.log_softmax(cond, dim=-1)
    if guidance_scale != 0:
        c = F.log_softmax(c + guidance_scale * (c - F.log_softmax(uncond, dim=-1)), dim=-1)
    c[..., mask_id] = float("-inf")
    return c


def predict(
    log_probs: Tensor, class_temperature: float, class_uniforms: Tensor | None
) -> tuple[Tensor, Tensor]:
    """(tokens, confidence) per position: greedy or Gumbel-max over the top classes; max log-prob."""
    confidence = log_probs.max(dim=-1).values
    if class_temperature > 0:
        values, classes = log_probs.topk(class_uniforms.shape[-1], dim=-1)
        pick = (values / class_temperature + gumbel(class_uniforms)).argmax(dim=-1, keepdim=True)
        return classes.gather(-1, pick).squeeze(-1), confidence
    return log_probs.argmax(dim=-1), confidence


class BatchDecoder:
    """Decoding state of a batch: the target tokens [N, C] and the per-request schedules and noise."""

    def __init__(
        self,
        target_lens: list[int],
        seeds: list[int],
        num_codebooks: int,
        mask_id: int,
        gen: GenerationConfig,
        device: torch.device | str,
        fused: bool = True,
    ):
        """fused: the greedy step's vocabulary work may run in one kernel (engine/kernels/heads.py)."""
        self.gen, self.mask_id, self.target_lens, self.fused = gen, mask_id, list(target_lens), fused
        n_req, longest = len(target_lens), max(target_lens)
        self.tokens = torch.full((sum(target_lens), num_codebooks), mask_id, dtype=torch.long, device=device)
        self.noise = [RequestNoise(s, t, num_codebooks, gen, device) for s, t in zip(seeds, target_lens)]
        if gen.position_temperature > 0:
            self.position_uniforms = torch.cat([n.position for n in self.noise], dim=1)  # [steps, N, C]
        schedules = [unmask_schedule(t * num_codebooks, gen.num_step, gen.t_shift) for t in target_lens]
        # Made on the host and queued to the device: no step (nor this setup) waits for the device.
        self.counts = to_device(torch.tensor(schedules).T.contiguous(), device)  # [steps, B] long
        # Where the flat rows sit in a padded [B * Tmax, C] view (request b's frames, then padding).
        rows = [torch.arange(t) + b * longest for b, t in enumerate(target_lens)]
        self.padded_rows = to_device(torch.cat(rows), device)  # [N] of B * Tmax
        self.layer_penalty = gen.layer_penalty_factor * torch.arange(num_codebooks, device=device)
        self.padded_shape = (n_req, longest, num_codebooks)

    def step(self, step: int, cond_logits: Tensor, uncond_logits: Tensor) -> Tensor:
        """Unmask this step's positions given the target logits [N, C, V] (any float dtype; torch's path
        computes in float32); returns the tokens [N, C]."""
        gen = self.gen
        kernel = fused_guided_argmax(cond_logits, gen.class_temperature) if self.fused else None
        if kernel is not None:
            pred, confidence = kernel(cond_logits, uncond_logits, gen.guidance_scale, self.mask_id)
        else:
            log_probs = guided_log_probs(
                cond_logits.float(), uncond_logits.float(), gen.guidance_scale, self.mask_id
            )
            class_uniforms = None
            if gen.class_temperature > 0:
                top = top_class_count(log_probs.shape[-1])
                class_uniforms = torch.cat([n.class_uniforms(top) for n in self.noise])
            pred, confidence = predict(log_probs, gen.class_temperature, class_uniforms)
        scores = confidence - self.layer_penalty
        if gen.position_temperature > 0:
            scores = scores / gen.position_temperature + gumbel(self.position_uniforms[step])
        scores = scores.masked_fill(self.tokens != self.mask_id, float("-inf"))
        chosen = self._top_per_request(scores, self.counts[step])
        self.tokens = torch.where(chosen, pred, self.tokens)
        return self.tokens

    def _top_per_request(self, scores: Tensor, counts: Tensor) -> Tensor:
        """Bool [N, C]: each request's counts[b] highest-scoring positions."""
        n_req, longest, num_codebooks = self.padded_shape
        padded = scores.new_full((n_req * longest, num_codebooks), float("-inf"))
        padded.index_copy_(0, self.padded_rows, scores)
        order = padded.view(n_req, -1).argsort(dim=1, descending=True, stable=True)
        ranks_kept = torch.arange(order.shape[1], device=scores.device)[None, :] < counts[:, None]
        chosen = torch.zeros_like(ranks_kept).scatter_(1, order, ranks_kept)
        return chosen.view(n_req * longest, num_codebooks).index_select(0, self.padded_rows)

    def request_tokens(self) -> list[Tensor]:
        """Each request's tokens [C, target_len]."""
        return [t.T.contiguous() for t in self.tokens.split(self.target_lens)]
