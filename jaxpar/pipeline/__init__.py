"""Pipeline parallelism: schedules as data (``schedules``) and the ``jaxpar pipeline`` command.

    from jaxpar.pipeline import build
    table = build("1f1b", stages=4, microbatches=8)
    print(table.gantt(), table.bubble_fraction())

A ``Table`` says, per tick and stage, which op (F, B, W) runs on which microbatch and model chunk, and
which buffer slots the executor reads and writes. Numpy only: nothing here imports jax.
"""

from jaxpar.pipeline.ops import FsdpGather, Op, Schedule, check_pipeline, min_microbatches
from jaxpar.pipeline.schedules import build
from jaxpar.pipeline.table import Table
from jaxpar.pipeline.timing import bubble_formula, durations, simulate

__all__ = [
    "Op",
    "FsdpGather",
    "Schedule",
    "Table",
    "bubble_formula",
    "build",
    "check_pipeline",
    "durations",
    "min_microbatches",
    "simulate",
]
