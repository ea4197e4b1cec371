"""The one greedy cut that makes batches everywhere: shards in the job's plan, batches in a shard, the
engine's and the quantizer's batches. Plain Python (no torch), so a planner imports it cheaply."""

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
