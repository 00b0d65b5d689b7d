"""The training run's configuration: frozen, nested dataclasses, every field settable by a dotted path.

    TrainConfig
      model        DenseConfig     (from --model PRESET, then --set model.embed_dim=128 ...): what the
                                   model is, the run's identity
      execution    ExecutionConfig (the preset's, then --set execution.remat=dots ...): how it runs
      optimizer    OptimizerConfig (--set optimizer.learning_rate=1e-3 ...)
      data         DataConfig      (--set data.source=files --set data.path=tokens.bin ...)
      checkpoint   CheckpointConfig
      log          LogConfig
      mesh, steps, batch, seq, seed, grad_accum, z_loss, pipeline

``apply_overrides(cfg, ["optimizer.learning_rate=1e-3"])`` parses each value by the field's annotated
type (int, float, str, bool, enums, ``X | None`` where ``none`` means None) and refuses unknown paths
with the closest known one. ``to_dict``/``from_dict`` (``jaxpar.config``, the one serializer) round-trip
through JSON (``DIR/config.json``), the model keeping its family's config class.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any

from jaxpar.config import Choice, check_choices, config_classes, from_dict, hints, is_union, to_dict  # noqa: F401
from jaxpar.data import DataConfig
from jaxpar.errors import ConfigError
from jaxpar.execution import ExecutionConfig, moved_field
from jaxpar.layers.moe import check_execution
from jaxpar.models import DenseConfig, get_execution_preset, get_model_preset
from jaxpar.pipeline.ops import FsdpGather, Schedule
from jaxpar.train.accumulate import GradReduce
from jaxpar.train.guard import NonFinite
from jaxpar.train.optim import OptimizerConfig


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 100  # save every K steps (and always at the last step)
    keep: int = 3  # keep the newest N checkpoints
    async_save: bool = True  # write in the background while training continues


@dataclasses.dataclass(frozen=True)
class LogConfig:
    eval_every: int = 50  # eval loss on held-out data every K steps (and at the end); 0 = never
    eval_batches: int = 4  # batches per eval (the same ones every time)
    tensorboard: bool = True  # event files in DIR/tensorboard
    progress: bool = True  # tqdm progress bar on stderr
    profile_steps: str = ""  # "a:b": jax.profiler trace of steps a..b into DIR/profile
    compile_cache: str = ""  # persistent XLA compilation cache directory (opt-in)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """How the train step runs the layers when the mesh has ``stage`` > 1 (``jaxpar.pipeline``)."""

    schedule: Schedule = Schedule.ONE_F_ONE_B  # gpipe, 1f1b, interleaved, zero_bubble
    microbatches: int = 8  # the batch is fed through the stages in this many pieces
    virtual_stages: int = 1  # model chunks per stage (interleaved only)
    fsdp_gather: FsdpGather = FsdpGather.SECTION  # FSDP weights gathered per tick section, or once a step
    # Megatron's uneven split: the first / last stage's layers (None: an even share); the other stages
    # split the rest evenly (e.g. 58 layers on 8 stages: first 4, last 6, 8 each between)
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    def __post_init__(self):
        check_choices(self, "pipeline")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: DenseConfig
    model_preset: str = "tiny"
    execution: ExecutionConfig = ExecutionConfig()  # how the model runs (not its identity: jaxpar.execution)
    mesh: str = "3d"  # a mesh preset or an axis spec like data=2,fsdp=-1
    steps: int = 300
    batch: int = 16  # global batch (sequences per optimizer step)
    seq: int = 128
    seed: int = 0  # parameter init and data order
    grad_accum: int = 1  # gradient accumulation: the batch is split into this many slices, one
    # optimizer update (pipeline microbatches are pipeline.microbatches)
    grad_reduce: GradReduce = GradReduce.SLICE  # accumulated gradients reduced over the batch axes after
    # every slice (or pipeline section), or once a step (jaxpar.parallel.manual: dense models)
    z_loss: float = 0.0  # weight of the log-partition (z) loss, e.g. 1e-4; 0 = off
    init_from: str | None = None  # a model checkpoint (jaxpar convert) or run folder: start from its weights
    nonfinite: NonFinite = NonFinite.STOP  # a step whose loss or gradient norm is NaN/inf: stop, or skip its update
    max_skips: int = 10  # nonfinite=skip: stop anyway after this many skipped steps in a row
    pipeline: PipelineConfig = PipelineConfig()
    optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-3, schedule="cosine", warmup_steps=30)
    data: DataConfig = DataConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()

    def __post_init__(self):
        check_choices(self, "")
        if not isinstance(self.model, DenseConfig):
            raise ConfigError(
                f"model: expected a model config (DenseConfig or a family extending it), "
                f"got {type(self.model).__name__}"
            )

    def validate(self) -> TrainConfig:
        """Checks that need no devices; raises ``ConfigError`` naming the field."""
        for name in ("steps", "batch", "seq", "grad_accum"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be ≥ 1")
        if self.batch % self.grad_accum:
            raise ConfigError(f"batch={self.batch} is not divisible by grad_accum={self.grad_accum}")
        if self.seq > self.model.max_seq_len:
            raise ConfigError(
                f"seq={self.seq} is longer than model.max_seq_len={self.model.max_seq_len} "
                f"of model {self.model_preset!r}"
            )
        if not self.z_loss >= 0:  # also refuses NaN
            raise ConfigError(f"z_loss={self.z_loss} must be ≥ 0")
        if self.log.eval_every < 0:
            raise ConfigError(f"log.eval_every={self.log.eval_every} must be ≥ 0 (0: never)")
        if self.max_skips < 1:
            raise ConfigError(f"max_skips={self.max_skips} must be ≥ 1")
        for section in ("checkpoint.every", "checkpoint.keep", "log.eval_batches"):
            outer, inner = section.split(".")
            if getattr(getattr(self, outer), inner) < 1:
                raise ConfigError(f"{section} must be ≥ 1")
        if self.model.moe is not None:
            check_execution(self.model.moe, self.execution)
        self.optimizer.validate()
        return self


def default_config(model_preset: str = "tiny", /, **fields) -> TrainConfig:
    """The preset's model, run under the preset's execution (``jaxpar.models.get_execution_preset``)."""
    execution = fields.pop("execution", None) or get_execution_preset(model_preset)
    return TrainConfig(model=get_model_preset(model_preset), model_preset=model_preset, execution=execution, **fields)


# ---------------------------------------------------------------------------------- dotted paths
def field_paths(obj=TrainConfig, prefix: str = "") -> dict[str, Any]:
    """Every settable leaf path → its annotated type. ``obj`` is a config or a config class; nested
    dataclasses are walked, by their actual class when ``obj`` is an instance (so an MoE model's
    ``model.moe.top_k`` is settable while a dense model has no ``model.moe``)."""
    out = {}
    cls = obj if isinstance(obj, type) else type(obj)
    for name, tp in hints(cls).items():
        value = None if isinstance(obj, type) else getattr(obj, name)
        inner = type(value) if dataclasses.is_dataclass(value) else _dataclass_in(tp)
        if inner is not None:
            out.update(field_paths(value if dataclasses.is_dataclass(value) else inner, f"{prefix}{name}."))
        else:
            out[prefix + name] = tp
    return out


def _dataclass_in(tp):
    classes = config_classes(tp)
    return classes[0] if classes else None


def parse_value(path: str, tp, text: str):
    """``text`` as a value of type ``tp``; ``ConfigError`` naming ``path`` if it is not one."""
    if is_union(tp):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if type(None) in typing.get_args(tp) and text.lower() in ("none", "null"):
            return None
        errors = []
        for a in args:
            try:
                return parse_value(path, a, text)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0])
    if tp is bool:
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"--set {path}={text}: expected true or false")
    if isinstance(tp, type) and issubclass(tp, Choice):
        return tp.parse(text, field=f"--set {path}")
    if tp in (int, float, str):
        try:
            return tp(text)
        except ValueError:
            raise ConfigError(f"--set {path}={text}: expected {tp.__name__}") from None
    raise ConfigError(f"--set {path}: fields of type {tp} cannot be set from the command line")


def _replace_path(obj, parts: list[str], value):
    head, rest = parts[0], parts[1:]
    if not rest:
        return dataclasses.replace(obj, **{head: value})
    child = getattr(obj, head)
    if child is None:
        raise ConfigError(f"--set {'.'.join(parts)}: {head} is None here; it has no fields to set")
    return dataclasses.replace(obj, **{head: _replace_path(child, rest, value)})


# Settings that were renamed, with where they went.
RENAMED = {
    "microbatches": "renamed: gradient accumulation is grad_accum (one optimizer update over k slices "
    "of the batch); pipeline microbatches are pipeline.microbatches"
}


def apply_overrides(cfg: TrainConfig, overrides: list[str], /, command: str = "train") -> TrainConfig:
    """``cfg`` with each ``path=value`` applied in order (``command``: the one whose ``--help`` the
    message for an unknown path points to)."""
    paths = field_paths(cfg)
    for item in overrides:
        path, sep, text = item.partition("=")
        path = path.strip()
        if not sep:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. optimizer.learning_rate=1e-3")
        if path in RENAMED or moved_field(path):
            raise ConfigError(f"--set {path}: {RENAMED.get(path) or moved_field(path)}")
        if path not in paths:
            raise ConfigError(
                f"--set {path}: unknown field{_closest(path, paths)}; `jaxpar {command} --help` lists them"
            )
        value = parse_value(path, paths[path], text.strip())
        try:
            cfg = _replace_path(cfg, path.split("."), value)
        except (ValueError, TypeError) as err:  # a config's own check: prefix where the value came from
            if str(err).startswith("--set "):
                raise
            raise ConfigError(f"--set {path}={text}: {err}") from None
    return cfg


def _closest(path: str, paths) -> str:
    leaves = {p.rsplit(".", 1)[-1]: p for p in paths}
    match = difflib.get_close_matches(path, list(paths), n=1, cutoff=0.6) or [
        leaves[m] for m in difflib.get_close_matches(path.rsplit(".", 1)[-1], list(leaves), n=1, cutoff=0.6)
    ]
    return f"; did you mean {match[0]}?" if match else ""


def describe_fields(prefixes: tuple[str, ...] = ("",)) -> str:
    """The ``--set`` fields (those under ``prefixes``) with their defaults, for ``--help``."""
    cfg = default_config()
    defaults = to_dict(cfg)
    lines = []
    for path in (p for p in field_paths(cfg) if p.startswith(prefixes)):
        value = defaults
        for part in path.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        lines.append(f"  {path} = {value!r}")
    return "\n".join(lines)
