"""The one greedy cut that makes batches everywhere (shards in the job's plan, batches in a shard, the
engine's and the quantizer's batches); even_batches, the same cut under the smallest budget that needs
no more batches; bucket_batches, batches that fill their CUDA-graph buckets (a shard's batches in the
job). Plain Python (no torch), so a planner imports it cheaply."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def greedy_batches(
    items: Sequence[T], tokens: Callable[[T], int], budget: int, max_items: int | None = None
) -> list[list[T]]:
    """The one way batches are cut (shards in the plan, batches in a shard, the engine's and the
    quantizer's batches): greedy runs of consecutive items while their tokens fit `budget` (and their
    count `max_items`); an item over the budget on its own makes a run of one."""
    runs: list[list[T]] = []
    current: list[T] = []
    total = 0
    for item in items:
        n = tokens(item)
        if current and (total + n > budget or (max_items is not None and len(current) >= max_items)):
            runs.append(current)
            current, total = [], 0
        current.append(item)
        total += n
    if current:
        runs.append(current)
    return runs


def even_batches(items: Sequence[T], tokens: Callable[[T], int], budget: int) -> list[list[T]]:
    """As many batches as greedy_batches needs under `budget`, but of about equal tokens: each run closes
    near its share of what is left (the remaining tokens over the remaining runs), so no small remainder
    runs after full ones (a one-row tail batch pays a whole step's fixed costs for little work). Falls back
    to the greedy cut where that would take more batches or leave a smaller one."""
    greedy = greedy_batches(items, tokens, budget)
    if len(greedy) < 2:
        return greedy
    sizes = [tokens(item) for item in items]
    runs: list[list[T]] = []
    left, i = sum(sizes), 0
    while i < len(items):
        share = left / max(len(greedy) - len(runs), 1)
        run, total = [items[i]], sizes[i]
        i += 1
        while i < len(items) and total + sizes[i] <= budget and total + sizes[i] / 2 <= share:
            run.append(items[i])
            total += sizes[i]
            i += 1
        runs.append(run)
        left -= total

    def smallest(cut: list[list[T]]) -> int:
        return min(sum(map(tokens, run)) for run in cut)

    return greedy if len(runs) > len(greedy) or smallest(runs) < smallest(greedy) else runs


# What one more batch costs beyond its graph bucket, in packed tokens: an estimate, not a measurement, of
# a step's fixed work (graph launch, heads, decoding kernels: guessed at a few tenths of a millisecond,
# against 2.4-2.9 us per packed token in the generation benchmark) and the batch's host work. Another
# batch is worth it when it saves more padding than this.
BATCH_COST_TOKENS = 512
_MAX_DP_STATES = 200_000


def bucket_batches(
    items: Sequence[T],
    tokens: Callable[[T], int],
    budget: int,
    buckets: Sequence[int],
    batch_cost: int = BATCH_COST_TOKENS,
) -> list[list[T]]:
    """Batches that fill their CUDA-graph buckets. A batch runs at its bucket's size (the smallest bucket
    that holds its tokens), so cutting a shard into batches of about equal tokens can pad each of them up
    to the next bucket (two batches of 20,000 tokens run as two of 24,576). Here the cheapest set of
    bucket capacities that holds all the tokens (their sum plus batch_cost each) is filled, largest items
    first, smallest capacity first, each batch within `budget`; even_batches is kept where that costs as
    little (and where an item fits no bucket or the buckets are too fine to search)."""
    even = even_batches(items, tokens, budget)
    ordered = sorted(set(buckets))
    capacities = [b for b in ordered if b <= budget]
    sizes = [tokens(item) for item in items]
    if len(even) < 2 or not capacities or max(sizes) > capacities[-1]:
        return even
    plan = _cheapest_capacities(sum(sizes), capacities, batch_cost)
    if plan is None:
        return even
    bins: list[list[int]] = [[] for _ in plan]
    room = list(plan)
    filled = [0] * len(plan)
    for i in sorted(range(len(items)), key=lambda i: -sizes[i]):
        target = next((b for b in range(len(bins)) if sizes[i] <= room[b]), None)
        if target is None:  # no capacity left for it: the least filled batch that stays within budget
            fits = [b for b in range(len(bins)) if filled[b] + sizes[i] <= budget]
            target = min(fits, key=lambda b: filled[b]) if fits else None
        if target is None:
            bins.append([])
            room.append(0)
            filled.append(0)
            target = len(bins) - 1
        bins[target].append(i)
        room[target] -= sizes[i]
        filled[target] += sizes[i]
    packed = sorted(([items[i] for i in b] for b in bins if b), key=lambda batch: -sum(map(tokens, batch)))

    def cost(batches: list[list[T]]) -> int:
        # a batch no bucket holds runs eagerly, at its own size
        sizes = (sum(map(tokens, batch)) for batch in batches)
        return sum((bucket_for(size, ordered) or size) + batch_cost for size in sizes)

    return packed if cost(packed) < cost(even) else even


def bucket_for(tokens: int, buckets: Sequence[int]) -> int | None:
    """The smallest of the (ascending) buckets that holds `tokens` packed tokens, None when none does."""
    i = bisect.bisect_left(buckets, tokens)
    return buckets[i] if i < len(buckets) else None


def _cheapest_capacities(total: int, capacities: list[int], batch_cost: int) -> list[int] | None:
    """Capacities (ascending) whose sum holds `total` at the least sum + batch_cost each (None when the
    search would be too large); a covering knapsack in units of the capacities' common divisor."""
    unit = math.gcd(*capacities)
    states = -(-total // unit)
    if states > _MAX_DP_STATES:
        return None
    steps = [c // unit for c in capacities]
    best = [0] + [math.inf] * states
    choice = [0] * (states + 1)
    for t in range(1, states + 1):
        for c, step in zip(capacities, steps):
            value = best[max(0, t - step)] + c + batch_cost
            if value < best[t]:
                best[t], choice[t] = value, c
    plan, t = [], states
    while t > 0:
        plan.append(choice[t])
        t = max(0, t - choice[t] // unit)
    return sorted(plan)
