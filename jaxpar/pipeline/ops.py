"""The vocabulary of pipeline schedules (``jaxpar.pipeline.schedules``): the schedules, a run's pipeline
settings (``PipelineConfig``: ``--set pipeline.…``), the ops a stage runs in a tick, the refusals of a
pipeline no schedule can make, and the dependencies between ops. Numpy only."""

from __future__ import annotations

import dataclasses
import enum
import numbers

import numpy as np

from jaxpar.config import Choice, check_choices
from jaxpar.errors import ConfigError


class Schedule(Choice):
    """A pipeline schedule (see the module docstring)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZERO_BUBBLE = "zero_bubble"


class FsdpGather(Choice):
    """When the executor gathers a stage's FSDP-sharded weights: in every tick section that uses them
    (XLA's default: least memory), or once per step before the schedule (Megatron's and torchtitan's
    ``reshard_after_forward=False``: the stage's weights stay whole over ``fsdp`` for the step)."""

    SECTION = "section"
    STEP = "step"


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


class Op(enum.IntEnum):
    """What a stage runs in a tick. ``B`` is the input gradient alone when the schedule has ``W`` ops,
    else the whole backward."""

    IDLE = 0
    F = 1
    B = 2
    W = 3


SPLIT_BACKWARD = frozenset({Schedule.ZERO_BUBBLE})


# ------------------------------------------------------------------------------------------ refusals
def count(value, field: str) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ConfigError(f"{field}={value!r}: must be an integer")
    return int(value)


def min_microbatches(schedule: Schedule | str, stages: int, virtual_stages: int = 1) -> int:
    """The fewest microbatches ``schedule`` takes on ``stages`` stages: 1 for gpipe; ``stages`` for the
    others (1f1b and zero_bubble reach their steady state only then; interleaved also needs a multiple of
    ``stages``, its group size)."""
    schedule = Schedule.parse(schedule, field="pipeline.schedule")
    return 1 if schedule == Schedule.GPIPE else max(1, stages)


def check_pipeline(schedule: Schedule | str, stages: int, microbatches: int, virtual_stages: int = 1) -> None:
    """Refuses, with a ``ConfigError`` naming the field and the numbers, a pipeline ``build`` cannot make."""
    schedule = Schedule.parse(schedule, field="pipeline.schedule")
    p = count(stages, "mesh stage")
    m = count(microbatches, "pipeline.microbatches")
    v = count(virtual_stages, "pipeline.virtual_stages")
    if p < 1:
        raise ConfigError(f"mesh stage={p}: a pipeline needs at least 1 stage")
    if v < 1:
        raise ConfigError(f"pipeline.virtual_stages={v}: each stage needs at least 1 model chunk")
    if v > 1 and schedule != Schedule.INTERLEAVED:
        raise ConfigError(
            f"pipeline.virtual_stages={v} needs pipeline.schedule=interleaved (got "
            f"pipeline.schedule={schedule}, which runs one model chunk per stage)"
        )
    if schedule == Schedule.INTERLEAVED and v < 2:
        raise ConfigError(
            f"pipeline.schedule=interleaved needs pipeline.virtual_stages >= 2 (got {v}); "
            f"with one model chunk per stage use pipeline.schedule=1f1b"
        )
    need = min_microbatches(schedule, p, v)
    if m < need:
        why = "" if need == 1 else " (one per stage, so that every stage reaches its steady state)"
        raise ConfigError(
            f"pipeline.microbatches={m}: pipeline.schedule={schedule} on mesh stage={p} needs at least {need}{why}"
        )
    if schedule == Schedule.INTERLEAVED and m % p:
        raise ConfigError(
            f"pipeline.microbatches={m}: pipeline.schedule=interleaved needs a multiple of "
            f"mesh stage={p} (microbatches go through the chunks in groups of {p}); "
            f"try {m // p * p} or {(m // p + 1) * p}"
        )


def dependencies(op: Op, mb: int, g: int, chunks: int) -> list[tuple[Op, int, int]]:
    """The ops (op, microbatch, model chunk) that must finish before ``op`` of ``mb`` on chunk ``g``."""
    if op == Op.F:
        return [(Op.F, mb, g - 1)] if g > 0 else []
    if op == Op.B:
        return [(Op.F, mb, g)] + ([(Op.B, mb, g + 1)] if g < chunks - 1 else [])
    return [(Op.B, mb, g)]


def op_name(op: Op, mb: int, j: int) -> str:
    """``F(mb 3, chunk 1)``: an op of microbatch ``mb`` on local chunk ``j``, for messages."""
    return f"{Op(op).name}(mb {mb}, chunk {j})"


def op_ticks(op: np.ndarray, mb: np.ndarray, chunk: np.ndarray) -> dict[tuple[Op, int, int], int]:
    """{(op, microbatch, model chunk): tick} of a table's non-idle cells (the last one for duplicates)."""
    p = op.shape[1]
    return {(Op(op[t, s]), int(mb[t, s]), int(chunk[t, s]) * p + s): t for t, s in zip(*np.nonzero(op))}
