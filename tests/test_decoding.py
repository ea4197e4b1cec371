"""Vectorised decoding equals a per-request loop written like upstream's; batch neighbours change nothing."""

import math

import pytest
import torch
from dense_reference import upstream_style_step

from engine.config import GenerationConfig
from engine.errors import InputError
from engine.generate.decoding import BatchDecoder, RequestNoise, unmask_schedule

C, V, MASK = 8, 1025, 1024


def upstream_schedule(total, num_step, t_shift):
    t = torch.linspace(0.0, 1.0, num_step + 1)
    t = (t_shift * t / (1 + (t_shift - 1) * t)).tolist()
    out, rem = [], total
    for s in range(num_step):
        n = rem if s == num_step - 1 else min(math.ceil(total * (t[s + 1] - t[s])), rem)
        out.append(n)
        rem -= n
    return out


def random_logits(target_lens, num_step, seed):
    g = torch.Generator().manual_seed(seed)
    return [
        (3 * torch.randn(num_step, t, C, V, generator=g), 3 * torch.randn(num_step, t, C, V, generator=g))
        for t in target_lens
    ]


def run_batch(target_lens, seeds, gen, logits):
    dec = BatchDecoder(target_lens, seeds, C, MASK, gen, "cpu")
    for step in range(gen.num_step):
        cond = torch.cat([c[step] for c, _ in logits])
        uncond = torch.cat([u[step] for _, u in logits])
        dec.step(step, cond, uncond)
    return dec.request_tokens()


def run_reference(target_len, seed, gen, logits):
    cond, uncond = logits
    noise = RequestNoise(seed, target_len, C, gen, "cpu")
    tokens = torch.full((C, target_len), MASK)
    for step, k in enumerate(unmask_schedule(target_len * C, gen.num_step, gen.t_shift)):
        cond_s, uncond_s = cond[step].transpose(0, 1), uncond[step].transpose(0, 1)
        tokens = upstream_style_step(tokens, cond_s, uncond_s, k, gen, MASK, noise, step)
    return tokens


@pytest.mark.parametrize("total,steps,shift", [(1200, 32, 0.1), (8, 32, 0.1), (77, 10, 0.5), (800, 16, 1.0)])
def test_schedule_matches_upstream_arithmetic(total, steps, shift):
    sched = unmask_schedule(total, steps, shift)
    assert sched == upstream_schedule(total, steps, shift)
    assert sum(sched) == total and min(sched) >= 0


def test_greedy_batch_equals_per_request_loop():
    gen = GenerationConfig(num_step=8, position_temperature=0.0, class_temperature=0.0)
    lens = [5, 13, 1, 9]
    logits = random_logits(lens, gen.num_step, seed=0)
    got = run_batch(lens, [0, 1, 2, 3], gen, logits)
    for i, t in enumerate(lens):
        want = run_reference(t, i, gen, logits[i])
        assert torch.equal(got[i], want), i
        assert (got[i] != MASK).all()


@pytest.mark.parametrize("pos_t,cls_t", [(5.0, 0.0), (5.0, 0.8), (0.0, 1.0)])
def test_sampled_single_request_equals_loop_with_same_generator(pos_t, cls_t):
    gen = GenerationConfig(num_step=6, position_temperature=pos_t, class_temperature=cls_t)
    logits = random_logits([11], gen.num_step, seed=1)
    got = run_batch([11], [42], gen, logits)[0]
    assert torch.equal(got, run_reference(11, 42, gen, logits[0]))
    other_seed = run_batch([11], [43], gen, logits)[0]
    assert not torch.equal(got, other_seed)  # the noise really is in play


def test_batch_neighbours_do_not_change_a_request():
    gen = GenerationConfig(num_step=8, position_temperature=5.0, class_temperature=1.0)
    lens = [7, 12, 3, 9, 15, 4, 10, 6]
    logits = random_logits(lens, gen.num_step, seed=2)
    seeds = [100 + i for i in range(8)]
    together = run_batch(lens, seeds, gen, logits)
    for i in (0, 4, 7):
        alone = run_batch([lens[i]], [seeds[i]], gen, [logits[i]])[0]
        assert torch.equal(alone, together[i]), i


def test_each_step_unmasks_exactly_the_scheduled_count():
    gen = GenerationConfig(num_step=5, position_temperature=5.0, class_temperature=0.5)
    lens = [6, 2, 9]
    logits = random_logits(lens, gen.num_step, seed=3)
    dec = BatchDecoder(lens, [1, 2, 3], C, MASK, gen, "cpu")
    for step in range(gen.num_step):
        before = [(t != MASK).sum().item() for t in dec.request_tokens()]
        dec.step(step, torch.cat([c[step] for c, _ in logits]), torch.cat([u[step] for _, u in logits]))
        after = [(t != MASK).sum().item() for t in dec.request_tokens()]
        want = [unmask_schedule(t * C, gen.num_step, gen.t_shift)[step] for t in lens]
        assert [a - b for a, b in zip(after, before)] == want


def test_flat_rows_sit_where_a_padded_view_holds_each_requests_frames():
    """padded_rows (made on the host, no device sync) are the positions of the frames in a
    [B * longest] view, request after request: what the mask of frames < length selects."""
    g = torch.Generator().manual_seed(7)
    for _ in range(5):
        lens = torch.randint(1, 40, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
        dec = BatchDecoder(lens, list(range(len(lens))), C, MASK, GenerationConfig(num_step=2), "cpu")
        mask = torch.arange(max(lens))[None, :] < torch.tensor(lens)[:, None]
        assert torch.equal(dec.padded_rows, mask.flatten().nonzero().squeeze(1))


@pytest.mark.parametrize(
    "setting, want",
    [
        ({"t_shift": 0.0}, "t_shift=0.0: give a positive number"),
        ({"t_shift": -1.0}, "t_shift=-1.0: give a positive number"),
        ({"t_shift": float("nan")}, "t_shift=nan"),
        ({"guidance_scale": float("inf")}, "guidance_scale=inf: give a finite number"),
        ({"position_temperature": -0.5}, "position_temperature=-0.5: give a number >= 0"),
        ({"class_temperature": float("nan")}, "class_temperature=nan"),
        ({"pad_duration": -0.1}, "pad_duration=-0.1: give seconds >= 0"),
    ],
)
def test_generation_settings_that_break_decoding_are_refused_by_name(setting, want):
    """t_shift = -1 overflowed inside the schedule, 0 unmasked every position at the last step, NaN raised a
    ValueError there; an infinite guidance turned the log-probabilities into NaN."""
    with pytest.raises(InputError, match=rf"generation\.{want}"):
        GenerationConfig(**setting)
