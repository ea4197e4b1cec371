"""Plan a job: each row's packed length and graph bucket, and shards of one bucket of about shard_tokens.

A row's packed length is what it costs the engine's forward pass: the conditional sequence (prompt text
tokens + reference frames + target frames) plus the unconditional one (target frames), i.e.
text + ref + 2 x target. A long text is generated chunk by chunk, so a row's packed length (what must fit
one batch and one bucket) is its largest chunk's, and its work the sum over its chunks. Rows are grouped
by the smallest engine bucket that holds them; a shard holds rows of one variant and one bucket, longest
first, up to `shard_tokens` packed tokens of work.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.generate.batching import bucket_for, greedy_batches
from pipeline.manifest import ManifestRow, Rejection

PLAN_VERSION = 1


@dataclass(frozen=True)
class RowSize:
    """A row's largest generation (its largest chunk when its text is chunked)."""

    text_tokens: int
    ref_frames: int
    target_frames: int
    chunked_tokens: int | None = None  # packed tokens summed over its chunks; None: one chunk
    cut_to_budget: bool = False  # its chunks were cut to fit the engine's token budget

    @property
    def packed_tokens(self) -> int:
        return self.text_tokens + self.ref_frames + 2 * self.target_frames

    @property
    def work_tokens(self) -> int:
        """Packed tokens of all its generations (its token work at one decoding step)."""
        return self.packed_tokens if self.chunked_tokens is None else self.chunked_tokens


Sizer = Callable[[ManifestRow], RowSize]
# Makes the sizer of a job's rows (given them all, so that it can prepare their clips together).
SizerFactory = Callable[[Any, Sequence[ManifestRow]], Sizer]


@dataclass
class PlannedRow:
    id: str
    row_key: str
    packed_tokens: int
    target_frames: int


@dataclass
class Shard:
    index: int
    variant: str
    bucket: int
    tokens: int
    rows: list[PlannedRow]


@dataclass
class Plan:
    variants: list[str]
    buckets: list[int]
    shard_tokens: int
    shards: list[Shard] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    engine_settings: dict[str, Any] = field(default_factory=dict)  # variant -> settings in its row keys
    # The token budget rows were cut to fit (EngineConfig.token_budget), which their audio then depends on;
    # None when it cut no row. A job keeps it: a resume or rerun under another budget is refused.
    token_budget: int | None = None

    @property
    def fingerprint(self) -> str:
        """Hash of what the plan will produce: shards, their rows and row keys, and which rows are rejected
        (not the wording of why: an error text from storage may differ between two identical submissions)."""
        items = [[s.index, s.variant, [(r.id, r.row_key) for r in s.rows]] for s in self.shards]
        items.append([[r.row_index, r.id] for r in self.rejected])
        if self.token_budget is not None:
            items.append(["token_budget", self.token_budget])
        return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:32]

    def to_json(self) -> dict[str, Any]:
        return {
            "version": PLAN_VERSION,
            "fingerprint": self.fingerprint,
            "variants": self.variants,
            "buckets": self.buckets,
            "shard_tokens": self.shard_tokens,
            "num_rows": sum(len(s.rows) for s in self.shards),
            "num_rejected": len(self.rejected),
            "engine_settings": self.engine_settings,
            "token_budget": self.token_budget,
            "shards": [asdict(s) for s in self.shards],
            "rejected": [asdict(r) for r in self.rejected],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Plan:
        if d.get("version") != PLAN_VERSION:
            raise ValueError(f"plan version {d.get('version')!r}, this ovbatch reads version {PLAN_VERSION}")
        shards = [
            Shard(s["index"], s["variant"], s["bucket"], s["tokens"], [PlannedRow(**r) for r in s["rows"]])
            for s in d["shards"]
        ]
        return cls(
            d["variants"],
            d["buckets"],
            d["shard_tokens"],
            shards,
            [Rejection(**r) for r in d["rejected"]],
            d.get("engine_settings", {}),
            d.get("token_budget"),
        )


def plan_differences(old: Plan, new: Plan) -> list[str]:
    """What makes two plans of one job directory differ, in words a person can act on."""
    out, resettled = [], set()
    for variant in sorted(set(old.engine_settings) | set(new.engine_settings)):
        a, b = _flatten(old.engine_settings.get(variant, {})), _flatten(new.engine_settings.get(variant, {}))
        changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        if changed:
            shown = ", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in changed[:5])
            out.append(f"variant {variant} engine settings changed ({shown})")
            resettled.add(variant)  # its row keys hold its settings: they all change, said once above
    keys_a = {(s.variant, r.id): r.row_key for s in old.shards for r in s.rows}
    keys_b = {(s.variant, r.id): r.row_key for s in new.shards for r in s.rows}
    if set(keys_a) != set(keys_b):
        out.append(f"{len(set(keys_a) ^ set(keys_b))} row(s) added or removed")
    changed_rows = [k for k in set(keys_a) & set(keys_b) if keys_a[k] != keys_b[k] and k[0] not in resettled]
    if changed_rows:
        out.append(f"{len(changed_rows)} row(s) have other inputs (e.g. id {sorted(changed_rows)[0][1]!r})")
    if old.token_budget != new.token_budget:
        out.append(budget_difference(old.token_budget, new.token_budget))
    return out or ["its shards are cut differently (shard_tokens, max_rows_per_shard or engine.buckets)"]


def budget_difference(job: int | None, now: int | None) -> str:
    """Why a budget (EngineConfig.token_budget) other than the one a job's rows were cut by is refused."""
    cut = f"rows were cut into chunks to fit a token budget of {job}" if job else "no row was cut to fit"
    budget = f"one of {now}" if now else "none"
    return (
        f"{cut}, and these settings give {budget} (the smaller of engine.max_batch_tokens and the largest "
        "engine.buckets): their audio depends on it, so keep the job's"
    )


def budget_problem(plan: Plan, variant: str, budget: int, shards: Sequence[int] | None = None) -> str | None:
    """Why running a variant's rows (those of `shards`, default all) under a token budget would change their
    audio, or None: rows cut to fit the plan's budget need that one; others must fit whole, since a smaller
    budget would cut them."""
    rows = [
        r
        for s in plan.shards
        if s.variant == variant and (shards is None or s.index in shards)
        for r in s.rows
    ]
    if not rows or budget == plan.token_budget:
        return None
    if plan.token_budget is not None:
        return budget_difference(plan.token_budget, budget)
    largest = max(rows, key=lambda r: r.packed_tokens)
    if largest.packed_tokens <= budget:
        return None
    return (
        f"row {largest.id!r} needs {largest.packed_tokens} packed tokens in one generation, and these "
        f"settings give a token budget of {budget} (the smaller of engine.max_batch_tokens and the largest "
        "engine.buckets): it would be cut into other chunks, and sound other"
    )


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            flat.update(_flatten(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


def make_plan(
    rows: Sequence[ManifestRow],
    rejected: Sequence[Rejection],
    sizes: dict[str, RowSize],
    row_keys: dict[str, dict[str, str]],
    buckets: Sequence[int],
    max_batch_tokens: int,
    shard_tokens: int,
    max_rows_per_shard: int,
) -> Plan:
    """Cut shards. `sizes[id]` is a row's size; `row_keys[variant][id]` its key in each variant.

    A row too long for every bucket (or for one batch) is rejected with the numbers that decide it.
    """
    buckets = sorted(buckets)
    variants = list(row_keys)
    plan = Plan(variants=variants, buckets=buckets, shard_tokens=shard_tokens, rejected=list(rejected))
    limit = min(buckets[-1], max_batch_tokens)
    by_bucket: dict[int, list[ManifestRow]] = {}
    for row in rows:
        size = sizes[row.id]
        bucket = bucket_for(size.packed_tokens, buckets)
        if bucket is None or size.packed_tokens > max_batch_tokens:
            what = "row" if size.chunked_tokens is None else "row's largest text chunk"
            reason = (
                f"{what} needs {size.packed_tokens} packed tokens ({size.text_tokens} text + "
                f"{size.ref_frames} reference frames + 2 x {size.target_frames} target frames), over the "
                f"engine limit of {limit}: split the text, use a shorter reference clip, or raise "
                "engine.buckets / max_batch_tokens"
            )
            plan.rejected.append(Rejection(row.row_index, row.id, reason))
            continue
        by_bucket.setdefault(bucket, []).append(row)

    for bucket in sorted(by_bucket, reverse=True):  # longest work first: the tail of the job is short shards
        members = sorted(by_bucket[bucket], key=lambda r: (-sizes[r.id].packed_tokens, r.id))
        for variant in variants:
            for chunk in greedy_batches(
                members, lambda r: sizes[r.id].work_tokens, shard_tokens, max_rows_per_shard
            ):
                planned = [
                    PlannedRow(
                        r.id, row_keys[variant][r.id], sizes[r.id].packed_tokens, sizes[r.id].target_frames
                    )
                    for r in chunk
                ]
                work = sum(sizes[r.id].work_tokens for r in chunk)
                plan.shards.append(Shard(len(plan.shards), variant, bucket, work, planned))
    plan.rejected.sort(key=lambda r: r.row_index)
    return plan
