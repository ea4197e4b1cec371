r"""Job configuration: dataclass defaults < YAML file < literal settings < `key=value` overrides (omegaconf).

Literal settings are values taken as they are (the paths and addresses given to command-line flags): a
`${`, `#` or `: ` in them means nothing to omegaconf or YAML. `key=value` overrides keep omegaconf's
meaning (YAML values, `${...}` interpolation; `\${` for a literal one).

The engine settings (`engine:`) are the engine's own EngineConfig; `variants:` maps a variant name to
overrides of those settings (an A/B job has two or more, e.g. fp16, fp8 and w4a4). A job with no variants
runs one, named `default`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from engine.checkpoint import check_checkpoint_path
from engine.config import EngineConfig
from engine.errors import CheckpointError, InputError
from pipeline.messages import first_line

DEFAULT_VARIANT = "default"
DEFAULT_ENGINE_FACTORY = "engine.api:Engine"
# Checkpoint names that need no path (engine.checkpoint, variants.*.checkpoint): the embedded tiny
# checkpoint (the same as null) and its W4A4 sibling, quantized on first use beside it.
TINY_CHECKPOINT = "tiny"
TINY_W4A4_CHECKPOINT = "tiny-w4a4"
_INTERPOLATION = re.compile(r"(\\*)\$\{")
_VARIANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# omegaconf's message for a list item it cannot convert, left unformatted: it names neither value nor key
_UNFORMATTED = "Value '$VALUE' of type '$VALUE_TYPE'"


@dataclass
class RayConfig:
    address: str | None = None  # None: RAY_ADDRESS when set, else a local Ray started for the job
    # Actors follow each variant's device: GPU actors for variants on cuda (or auto where the cluster has
    # GPUs), CPU actors for the others. num_actors of each kind; None: one per GPU, and cpu_actors.
    num_actors: int | None = None
    cpu_actors: int = 2  # CPU actors when num_actors is unset
    gpus_per_actor: float = 1.0
    cpus_per_actor: float = 1.0
    inflight_per_actor: int = 3  # shards queued on one actor at once (backpressure bound; SHARDS_IN_FLIGHT)
    max_shard_attempts: int = 3  # an actor dying counts one attempt against the shard it was running
    num_cpus: int | None = None  # for the local Ray started for the job (None: all cores)


@dataclass
class CompareConfig:
    """Report metrics that need a model (pipeline.quality); each is skipped, and the report says so, while
    its model is unset. A model is a local directory or a hub id, loaded with transformers."""

    asr_model: str | None = None  # speech recognition (e.g. openai/whisper-small): WER/CER against the text
    speaker_model: str | None = None  # x-vector (e.g. microsoft/wavlm-base-plus-sv): similarity to the clip
    device: str = "auto"  # auto: cuda when there is a GPU, else cpu
    batch_size: int = 16
    # How the report's players reach their wavs: link (hard links in report/audio/, copies where links
    # fail), copy, or embed (data URIs in index.html). Either way report/ opens anywhere on its own.
    audio: str = "link"


@dataclass
class JobConfig:
    manifest: str | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    variants: dict[str, Any] = field(default_factory=dict)
    # Shards hold rows of one graph bucket and about this many packed tokens (cond + uncond).
    shard_tokens: int = 65536
    max_rows_per_shard: int = 512
    local: bool = False  # run shards in this process instead of on Ray actors
    # Threads that post-process and write a batch's rows while the engine generates the next batch; at
    # most twice as many batches wait for them (a slow disk slows the job, it never queues without bound).
    writer_threads: int = 2
    ray: RayConfig = field(default_factory=RayConfig)
    engine_factory: str = DEFAULT_ENGINE_FACTORY  # "module:callable" taking an EngineConfig
    progress: bool = True
    report: str = "auto"  # auto (when there are two or more variants) | always | never
    compare: CompareConfig = field(default_factory=CompareConfig)

    def variant_names(self) -> list[str]:
        return list(self.variants) or [DEFAULT_VARIANT]

    def engine_config(self, variant: str) -> EngineConfig:
        """The engine settings of one variant: `engine` with the variant's overrides on top."""
        overrides = self.variants.get(variant, {}) if self.variants else {}
        if variant not in self.variant_names():
            raise InputError(f"variant {variant!r} is not in this job (variants: {self.variant_names()}).")
        if overrides is not None and not isinstance(overrides, Mapping):
            raise InputError(
                f"variants.{variant}={overrides!r}: give it as a mapping of engine settings, e.g. "
                f"variants.{variant}.precision=fp16 (see jobs/ab.yaml)."
            )
        try:
            values = [as_literal(asdict(self.engine)), as_literal(overrides or {})]
            merged = OmegaConf.merge(OmegaConf.structured(EngineConfig), *values)
            return OmegaConf.to_object(merged)
        except OmegaConfBaseException as e:
            raise InputError(
                f"variants.{variant}: {_reason(e)}. Use keys of `engine:` (see jobs/ab.yaml)."
            ) from None


def as_literal(value: Any) -> Any:
    """`value` (a string, or dicts and lists holding strings) as omegaconf must store it to give it back
    unchanged: every `${` escaped, with the backslashes before it doubled."""
    if isinstance(value, str):
        return _INTERPOLATION.sub(lambda m: m.group(1) * 2 + "\\${", value)
    if isinstance(value, Mapping):
        return {k: as_literal(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [as_literal(v) for v in value]
    return value


def load_job_config(
    config_file: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    literal: Mapping[str, Any] | None = None,
) -> JobConfig:
    """Defaults, then the YAML file, then `literal` (dotted key -> value, taken as it is), then `key=value`
    overrides; validated into a JobConfig."""
    layers: list[DictConfig] = [OmegaConf.structured(JobConfig)]
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise InputError(f"config file {str(path)!r} not found: pass an existing YAML file to --config.")
        try:
            layers.append(OmegaConf.load(path))
        except Exception as e:  # yaml parse errors come in several types
            raise InputError(f"config file {str(path)!r} is not valid YAML: {first_line(e)}") from None
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise InputError(f"override {bad[0]!r} is not key=value (e.g. engine.precision=fp16).")
    file_keys = [str(k) for layer in layers[1:] if isinstance(layer, DictConfig) for k in layer]
    _reject_engine_keys_at_top_level([*file_keys, *(literal or {}), *(o.split("=", 1)[0] for o in overrides)])
    try:
        given = OmegaConf.create()
        for key, value in (literal or {}).items():
            OmegaConf.update(given, key, as_literal(value), merge=True)
        layers += [given, OmegaConf.from_dotlist(list(overrides))]
        cfg: JobConfig = OmegaConf.to_object(OmegaConf.merge(*layers))
    except OmegaConfBaseException as e:
        culprit = _UNFORMATTED in str(e) and _culprit(config_file, overrides, OmegaConfBaseException)
        raise InputError(f"job config: {f'{culprit}: ' if culprit else ''}{_reason(e)}") from None
    except TypeError:  # omegaconf's "Cannot merge incompatible container types"
        raise InputError(
            f"job config: {_culprit(config_file, overrides, TypeError)} gives a list where a mapping "
            "belongs, or the reverse: give each key the form docs/pipeline.md shows (e.g. "
            "variants.fp16.precision=fp16, engine.buckets=[512,1024])."
        ) from None
    validate(cfg)
    return cfg


def _reason(e: OmegaConfBaseException) -> str:
    return first_line(e).replace(_UNFORMATTED, "a list item")


def _culprit(
    config_file: str | Path | None, overrides: list[str] | tuple[str, ...], error: type[Exception]
) -> str:
    """The override, else the config file, whose merge raises `error` on its own."""
    for override in overrides:
        try:
            OmegaConf.merge(OmegaConf.structured(JobConfig), OmegaConf.from_dotlist([override]))
        except error:
            return repr(override)
        except (OmegaConfBaseException, TypeError):  # wrong too, in another way
            continue
    return f"config file {str(config_file)!r}" if config_file is not None else "a setting"


def _reject_engine_keys_at_top_level(keys: list[str]) -> None:
    """An engine setting given without `engine.` (precision=fp16) gets the key it meant, where omegaconf
    would only say the key is not in JobConfig."""
    job_keys = {f.name for f in fields(JobConfig)}
    engine_keys = {f.name for f in fields(EngineConfig)}
    for key in keys:
        head = key.split(".", 1)[0]
        if head not in job_keys and head in engine_keys:
            raise InputError(f"job config: {key!r} is an engine setting: write it as engine.{key}.")


def validate(cfg: JobConfig) -> None:
    for name in cfg.variant_names():
        if not _VARIANT_NAME.match(name):
            raise InputError(
                f"variant name {name!r} is unusable as a folder name: use letters, digits, '_', '-', '.'."
            )
        cfg.engine_config(name)
    if cfg.writer_threads < 1:
        raise InputError(f"writer_threads={cfg.writer_threads}: it must be at least 1.")
    if cfg.shard_tokens < 1 or cfg.max_rows_per_shard < 1:
        raise InputError(
            f"shard_tokens={cfg.shard_tokens}, max_rows_per_shard={cfg.max_rows_per_shard}: "
            "both must be positive."
        )
    ray = cfg.ray
    for key in ("inflight_per_actor", "max_shard_attempts", "cpu_actors"):
        if getattr(ray, key) < 1:
            raise InputError(f"ray.{key}={getattr(ray, key)}: it must be at least 1.")
    if ray.num_actors is not None and ray.num_actors < 1:
        raise InputError(f"ray.num_actors={ray.num_actors}: need at least one actor (or null for auto).")
    if ray.gpus_per_actor <= 0 or ray.cpus_per_actor < 0:
        raise InputError(
            f"ray.gpus_per_actor={ray.gpus_per_actor:g}, ray.cpus_per_actor={ray.cpus_per_actor:g}: GPUs per "
            "actor must be positive (a fraction shares a GPU) and CPUs per actor not negative."
        )
    if ray.num_cpus is not None and ray.num_cpus < 1:
        raise InputError(f"ray.num_cpus={ray.num_cpus}: give the local Ray at least 1 CPU (or null for all).")
    if cfg.report not in ("auto", "always", "never"):
        raise InputError(f"report={cfg.report!r}: choose auto, always or never.")
    validate_compare(cfg.compare)
    if ":" not in cfg.engine_factory:
        raise InputError(f"engine_factory={cfg.engine_factory!r}: write it as 'module:callable'.")


def validate_compare(cmp: CompareConfig) -> None:
    if cmp.batch_size < 1:
        raise InputError(f"compare.batch_size={cmp.batch_size}: it must be at least 1.")
    if cmp.audio not in ("link", "copy", "embed"):
        raise InputError(f"compare.audio={cmp.audio!r}: choose link, copy or embed.")
    for key in ("asr_model", "speaker_model"):
        value = getattr(cmp, key)
        if value is not None and not value.strip():
            raise InputError(f"compare.{key}={value!r}: give a model directory or hub id, or leave it unset.")


def resolve_checkpoint_names(cfg: JobConfig) -> JobConfig:
    """`cfg` with the checkpoint names `tiny` (null: the engine's embedded tiny checkpoint) and `tiny-w4a4`
    (that checkpoint quantized to W4A4, made on first use) replaced by what the engine loads. A checkpoint our
    engine could never load (a file, a missing path) is refused here, before a job plans or writes anything:
    its plan would tie the job to that checkpoint."""

    def resolve(checkpoint: Any) -> Any:
        if checkpoint == TINY_CHECKPOINT:
            return None
        if checkpoint == TINY_W4A4_CHECKPOINT:
            from engine.tiny import ensure_tiny_checkpoint
            from pipeline.demo import tiny_w4a4_checkpoint

            return str(tiny_w4a4_checkpoint(ensure_tiny_checkpoint()))
        return checkpoint

    variants = {
        name: {**v, "checkpoint": resolve(v["checkpoint"])} if "checkpoint" in (v or {}) else v
        for name, v in cfg.variants.items()
    }
    engine = replace(cfg.engine, checkpoint=resolve(cfg.engine.checkpoint))
    resolved = replace(cfg, engine=engine, variants=variants)
    if cfg.engine_factory == DEFAULT_ENGINE_FACTORY:  # another engine may read the setting its own way
        for name in resolved.variant_names():
            checkpoint = resolved.engine_config(name).checkpoint
            try:
                check_checkpoint_path(checkpoint)
            except CheckpointError as e:
                where = f"variants.{name}.checkpoint" if cfg.variants else "engine.checkpoint"
                raise CheckpointError(f"{where}: {e}") from None
    return resolved


def to_yaml(cfg: JobConfig) -> str:
    """The resolved config as YAML that load_job_config reads back to an equal JobConfig."""
    return OmegaConf.to_yaml(OmegaConf.create(as_literal(asdict(cfg))))
