"""The training run's configuration: frozen, nested dataclasses, every field settable by a dotted path.

    TrainConfig
      model        DenseConfig     (from --model PRESET, then --set model.embed_dim=128 ...): what the
                                   model is, the run's identity
      execution    ExecutionConfig (the preset's, then --set execution.remat=dots ...): how it runs
      optimizer    OptimizerConfig (--set optimizer.learning_rate=1e-3 ...)
      data         DataConfig      (--set data.source=files --set data.path=tokens.bin ...)
      checkpoint   CheckpointConfig
      log          LogConfig
      dpo          PreferenceConfig (objective=dpo: --set dpo.beta=0.1 --set dpo.loss=ipo ...)
      mesh, steps, batch, seq, seed, grad_accum, z_loss, pipeline, objective

``apply_overrides(cfg, ["optimizer.learning_rate=1e-3"])`` parses each value by the field's annotated
type (int, float, str, bool, enums, ``X | None`` where ``none`` means None) and refuses unknown paths
with the closest known one. ``to_dict``/``from_dict`` (``jaxpar.config``, the one serializer) round-trip
through JSON (``DIR/config.json``), the model keeping its family's config class.
"""

from __future__ import annotations

import dataclasses

from jaxpar import settings
from jaxpar.config import Choice, check_choices, from_dict, to_dict  # noqa: F401  (re-exported: the run's serializer)
from jaxpar.data import DataConfig
from jaxpar.errors import ConfigError
from jaxpar.execution import ExecutionConfig, moved_field
from jaxpar.layers.moe import check_execution
from jaxpar.models import DenseConfig, get_execution_preset, get_model_preset
from jaxpar.pipeline.ops import PipelineConfig
from jaxpar.settings import field_paths  # noqa: F401  (re-exported)
from jaxpar.train.accumulate import GradReduce
from jaxpar.train.guard import NonFinite
from jaxpar.train.optim import OptimizerConfig
from jaxpar.train.preference import PreferenceConfig


class Objective(Choice):
    """What a run trains (``objective``)."""

    LM = "lm"  # next-token cross-entropy (pretraining, SFT with the loss mask)
    DPO = "dpo"  # preference pairs (jaxpar.train.preference; data.pack=pairs)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 100  # save every K steps (and always at the last step)
    keep: int = 3  # keep the newest N checkpoints
    async_save: bool = True  # write in the background while training continues
    # a LoRA run --init-from a model: checkpoints hold the adapters and what else trains, not the frozen
    # base, which resuming and loading read from init_from again, checked (jaxpar.convert.base)
    adapters_only: bool = True


@dataclasses.dataclass(frozen=True)
class LogConfig:
    eval_every: int = 50  # eval loss on held-out data every K steps (and at the end); 0 = never
    eval_batches: int = 4  # batches per eval (the same ones every time)
    tensorboard: bool = True  # event files in DIR/tensorboard
    progress: bool = True  # tqdm progress bar on stderr
    profile_steps: str = ""  # "a:b": jax.profiler trace of steps a..b into DIR/profile
    compile_cache: str = ""  # persistent XLA compilation cache directory (opt-in)


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
    objective: Objective = Objective.LM
    dpo: PreferenceConfig = PreferenceConfig()  # objective=dpo's loss, beta and reference
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
        if self.seq % self.execution.loss_chunks:
            raise ConfigError(f"execution.loss_chunks={self.execution.loss_chunks} does not divide seq={self.seq}")
        if self.model.quantize != "none":
            raise ConfigError(
                f"model.quantize={self.model.quantize}: weights stored for serving do not train; to train "
                "adapters over a quantized base, set model.lora.quantize (QLoRA)"
            )
        if self.model.moe is not None:
            check_execution(self.model.moe, self.execution)
        if self.objective == Objective.DPO:
            if self.data.pack != "pairs":
                raise ConfigError(
                    f"objective=dpo: data.pack={self.data.pack} gives no pairs; set data.pack=pairs (files from "
                    "`jaxpar prepare --field preference`)"
                )
            self.dpo.resolved(self.model.lora.rank)  # refuses adapters_off without adapters
        elif self.data.pack == "pairs":
            raise ConfigError("data.pack=pairs: preference pairs train with objective=dpo")
        self.optimizer.validate()
        return self


def default_config(model_preset: str = "tiny", /, **fields) -> TrainConfig:
    """The preset's model, run under the preset's execution (``jaxpar.models.get_execution_preset``)."""
    execution = fields.pop("execution", None) or get_execution_preset(model_preset)
    return TrainConfig(model=get_model_preset(model_preset), model_preset=model_preset, execution=execution, **fields)


# Settings that were renamed, with where they went.
RENAMED = {
    "microbatches": "renamed: gradient accumulation is grad_accum (one optimizer update over k slices "
    "of the batch); pipeline microbatches are pipeline.microbatches"
}


def apply_overrides(cfg: TrainConfig, overrides: list[str], /, command: str = "train") -> TrainConfig:
    """``cfg`` with each ``path=value`` applied in order (``jaxpar.settings``: the grammar every command
    speaks; ``command``: the one whose ``--help`` an unknown path's message points to)."""
    return settings.apply_overrides(
        cfg, overrides, command=command, refuse=lambda path: RENAMED.get(path) or moved_field(path)
    )


def describe_fields(prefixes: tuple[str, ...] = ("",)) -> str:
    """The ``--set`` fields (those under ``prefixes``) with their defaults for ``--model tiny``."""
    return settings.describe(default_config(), prefixes)
