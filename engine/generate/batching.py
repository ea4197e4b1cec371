"""The one greedy cut that makes batches everywhere (shards in the job's plan, batches in a shard, the
engine's and the quantizer's batches), and even_batches, the same cut under the smallest budget that needs
no more batches. Plain Python (no torch), so a planner imports it cheaply."""

from __future__ import annotations

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
