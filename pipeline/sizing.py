"""Row sizes for the planner, from the engine's own request preparation.

The driver loads the engine on the CPU and calls `Engine.prepare` on each row: that validates the row as
the actors will (an InputError rejects the row at planning time), builds its voice prompt through the
shared prompt cache (so actors find every prompt ready), and `Engine.chunk_sizes` gives the size of each
of its text chunks (prompt text ids + reference frames + 2 x target frames): the row is sized by its
largest chunk, its work by all of them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pipeline import manifest as manifest_mod
from pipeline.config import JobConfig
from pipeline.plan import RowSize, Sizer
from pipeline.shard_runner import load_factory, synth_request


def planning_engine(cfg: JobConfig) -> Any:
    """The first variant's engine, on the CPU (planning never runs the model)."""
    variant = cfg.variant_names()[0]
    return load_factory(cfg.engine_factory)(replace(cfg.engine_config(variant), device="cpu"))


def prepared_size(engine: Any, prepared: Any) -> RowSize:
    """Packed tokens of a prepared request, laid out as the engine packs them (Engine.chunk_sizes)."""
    sizes = [RowSize(*size) for size in engine.chunk_sizes(prepared)]
    largest = max(sizes, key=lambda s: s.packed_tokens)
    if len(sizes) == 1:
        return largest
    return replace(largest, chunked_tokens=sum(s.packed_tokens for s in sizes))


class EngineSizer:
    """Sizer backed by an engine; local mode on the CPU reuses `engine` to run the shards.

    Rows sharing a clip and transcript reuse its voice prompt (the engine reads and hashes a clip on
    every request that names it by path)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.prompts: dict[tuple[str, str], Any] = {}

    def __call__(self, row: manifest_mod.ManifestRow) -> RowSize:
        req = synth_request(row)
        voice = (row.ref_audio, row.ref_text)
        if row.ref_audio is not None and voice in self.prompts:
            req = replace(req, ref_audio=None, ref_text=None, prompt=self.prompts[voice])
        prepared = self.engine.prepare(req)
        if row.ref_audio is not None:
            self.prompts[voice] = prepared.prompt
        return prepared_size(self.engine, prepared)


def engine_sizer(cfg: JobConfig) -> Sizer:
    return EngineSizer(planning_engine(cfg))
