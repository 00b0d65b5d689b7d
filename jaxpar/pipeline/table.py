"""A pipeline schedule as data: the ``Table`` of which op each stage runs at each tick, its buffer slots,
and its measures (makespan, bubbles, memory in flight, a Gantt chart). ``jaxpar.pipeline.schedules``
builds tables; ``jaxpar.pipeline.validate`` holds the rules every table keeps. Numpy only."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxpar.errors import ConfigError
from jaxpar.pipeline.ops import SPLIT_BACKWARD, Op, Schedule
from jaxpar.pipeline.timing import bubble_formula, durations, simulate
from jaxpar.pipeline.validate import check_table


# --------------------------------------------------------------------------------------------- table
@dataclasses.dataclass(frozen=True, eq=False)
class Table:
    """A schedule as arrays [ticks, stages] (module docstring). ``chunk`` is the stage's local chunk j:
    the model chunk is ``j·stages + s``. Slots: -1 where there is none."""

    schedule: Schedule
    stages: int
    microbatches: int
    virtual_stages: int
    op: np.ndarray
    mb: np.ndarray
    chunk: np.ndarray
    act_slot: np.ndarray
    grad_slot: np.ndarray
    fwd_recv_slot: np.ndarray
    bwd_recv_slot: np.ndarray
    act_slots: int
    grad_slots: int

    @property
    def split_backward(self) -> bool:
        """True where B is the input gradient alone and W ops compute the weight gradients."""
        return self.schedule in SPLIT_BACKWARD

    @property
    def ticks(self) -> int:
        return int(self.op.shape[0])

    def validate(self) -> None:
        """``ConfigError`` naming the stage, tick and ops of the first broken rule: the sizes, the cells,
        one F, B (and W iff split) per (stage, microbatch, chunk), the dependencies, the buffer slots
        (the rules: ``jaxpar.pipeline.validate``)."""
        check_table(self)

    def orders(self) -> list[list[tuple[Op, int, int]]]:
        """Per stage, its ops (op, microbatch, local chunk) in tick order."""
        return [
            [(Op(self.op[t, s]), int(self.mb[t, s]), int(self.chunk[t, s])) for t in np.nonzero(self.op[:, s])[0]]
            for s in range(self.stages)
        ]

    def makespan(self, t_f: float = 1.0, t_b: float | None = None, t_w: float | None = None) -> float:
        """The time the step takes when every op starts as soon as its stage is free and its inputs
        have arrived (no communication time), each stage keeping its order. Durations: ``durations``."""
        duration = durations(self.split_backward, t_f, t_b, t_w)
        return float(simulate(self.orders(), self.stages, self.virtual_stages, duration)[1])

    def busy_time(self, t_f: float = 1.0, t_b: float | None = None, t_w: float | None = None) -> float:
        """The work of all stages together."""
        return float(durations(self.split_backward, t_f, t_b, t_w)[self.op].sum())

    def bubble_fraction(self, t_f: float = 1.0, t_b: float | None = None, t_w: float | None = None) -> float:
        """1 - work / (stages × makespan): the share of stage time spent idle."""
        return float(1 - self.busy_time(t_f, t_b, t_w) / (self.stages * self.makespan(t_f, t_b, t_w)))

    def lockstep_bubble_fraction(self, t_f: float = 1.0, t_b: float | None = None, t_w: float | None = None) -> float:
        """As ``bubble_fraction`` for an executor that runs the ticks in lockstep: a tick lasts as long
        as its slowest op."""
        time = durations(self.split_backward, t_f, t_b, t_w)[self.op].max(axis=1).sum()
        return float(1 - self.busy_time(t_f, t_b, t_w) / (self.stages * time))

    def in_flight(self) -> np.ndarray:
        """[ticks, stages]: after each tick, the (microbatch, chunk) pairs of a stage whose F has run
        and whose last backward op (W when split, else B) has not: activations the stage holds."""
        last = Op.W if self.split_backward else Op.B
        return np.cumsum((self.op == Op.F).astype(np.int32) - (self.op == last), axis=0)

    @property
    def peak_in_flight(self) -> np.ndarray:
        """[stages]: the most (microbatch, chunk) activations each stage holds at once."""
        return self.in_flight().max(axis=0, initial=0)

    def cells(self) -> list[list[str]]:
        """Per stage, one string per tick: ``F3`` (op, microbatch), with the local chunk as a letter
        when there are several (``F3a`` chunk 0, ``F3b`` chunk 1), ``.`` for idle."""
        letters = self.virtual_stages > 1
        return [
            [_cell(self.op[t, s], self.mb[t, s], self.chunk[t, s], letters) for t in range(self.ticks)]
            for s in range(self.stages)
        ]

    def gantt(self) -> str:
        """A text Gantt chart: one row per stage, one column per tick."""
        rows = self.cells()
        width = max([len(c) for row in rows for c in row] + [len(str(self.ticks - 1))])
        label = len(f"stage {self.stages - 1}")
        head = " ".join(f"{t:<{width}}" if t % 5 == 0 else " " * width for t in range(self.ticks))
        lines = [f"{'tick':<{label}}  {head}".rstrip()]
        lines += [
            f"{f'stage {s}':<{label}}  " + " ".join(f"{c:<{width}}" for c in row).rstrip() for s, row in enumerate(rows)
        ]
        return "\n".join(lines)

    def to_json(self, t_f: float = 1.0, t_b: float | None = None, t_w: float | None = None) -> dict:
        """The table and its measures as JSON data (``table``: one row of ``cells`` per stage)."""
        duration = durations(self.split_backward, t_f, t_b, t_w)
        try:
            formula = bubble_formula(
                self.schedule, self.stages, self.microbatches, self.virtual_stages, t_f=t_f, t_b=t_b, t_w=t_w
            )
        except ConfigError:  # no closed form for these durations
            formula = None
        return {
            "schedule": str(self.schedule),
            "stages": self.stages,
            "microbatches": self.microbatches,
            "virtual_stages": self.virtual_stages,
            "ticks": self.ticks,
            "split_backward": self.split_backward,
            "times": {op.name: float(duration[op]) for op in (Op.F, Op.B, Op.W) if op != Op.W or self.split_backward},
            "makespan": self.makespan(t_f, t_b, t_w),
            "bubble_fraction": self.bubble_fraction(t_f, t_b, t_w),
            "lockstep_bubble_fraction": self.lockstep_bubble_fraction(t_f, t_b, t_w),
            "formula_bubble_fraction": formula,
            "peak_in_flight": [int(n) for n in self.peak_in_flight],
            "act_slots": self.act_slots,
            "grad_slots": self.grad_slots,
            "table": self.cells(),
        }


def _cell(op: int, mb: int, chunk: int, letters: bool) -> str:
    if op == Op.IDLE:
        return "."
    return f"{Op(op).name}{mb}{chr(ord('a') + chunk) if letters else ''}"
