"""How long a schedule takes: op durations, the closed-form bubbles, the as-soon-as-possible simulation
that places a schedule's ops (``jaxpar.pipeline.schedules``), and the bubble of the SPMD executor
(``jaxpar.pipeline.executor``), which runs one section per tick on every stage. Numpy only."""

from __future__ import annotations

import math
import numbers

import numpy as np

from jaxpar.errors import ConfigError
from jaxpar.pipeline.ops import Op, Schedule, check_pipeline, dependencies, op_name


# ------------------------------------------------------------------------------ durations, closed forms
def durations(split_backward: bool, t_f: float = 1.0, t_b: float | None = None, t_w: float | None = None) -> np.ndarray:
    """The duration of each ``Op`` (index ``Op``; idle lasts 0). With a split backward B and W default to
    ``t_f``. Without one, B is the whole backward: ``t_b`` (default ``2·t_f``), or ``t_b + t_w`` when a
    ``t_w`` is given (``t_b`` then defaults to ``t_f``), so one (t_f, t_b, t_w) compares every schedule on
    the same work."""
    if split_backward:
        f, b, w = t_f, t_f if t_b is None else t_b, t_f if t_w is None else t_w
    elif t_w is None:
        f, b, w = t_f, 2 * t_f if t_b is None else t_b, 0.0
    else:
        f, b, w = t_f, (t_f if t_b is None else t_b) + t_w, 0.0
    for name, value in (("t_f", t_f), ("t_b", t_b), ("t_w", t_w)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0
        ):
            raise ConfigError(f"pipeline times: {name}={value!r} must be a positive number of time units")
    return np.array([0.0, f, b, w])


def bubble_formula(
    schedule: Schedule | str,
    stages: int,
    microbatches: int,
    virtual_stages: int = 1,
    *,
    t_f: float = 1.0,
    t_b: float | None = None,
    t_w: float | None = None,
) -> float:
    """The closed-form bubble fraction (module docstring): (p-1)/(m+p-1) for gpipe and 1f1b,
    (p-1)/(v·m+p-1) for interleaved, and for zero_bubble x/(m·(t_f+t_b+t_w)+x), x = (p-1)(t_f+t_b-t_w),
    which is (p-1)/(3m+p-1) at the default t_f = t_b = t_w. The zero_bubble form holds for
    t_w <= min(t_f, t_b) only: other durations raise ``ConfigError``."""
    check_pipeline(schedule, stages, microbatches, virtual_stages)
    schedule, p, m, v = Schedule(schedule), stages, microbatches, virtual_stages
    if schedule != Schedule.ZERO_BUBBLE:
        durations(False, t_f, t_b, t_w)  # refuses bad numbers; the form needs none
        return (p - 1) / (v * m + p - 1)
    _, f, b, w = durations(True, t_f, t_b, t_w)
    if w > min(f, b):
        raise ConfigError(
            f"pipeline times: t_w={w:g} above min(t_f={f:g}, t_b={b:g}): the zero_bubble "
            f"closed form holds for t_w <= min(t_f, t_b) only"
        )
    x = (p - 1) * (f + b - w)
    return x / (m * (f + b + w) + x)


def simulate(
    orders: list[list[tuple[Op, int, int]]], stages: int, virtual_stages: int, duration: np.ndarray
) -> tuple[list[list[float]], float]:
    """Start times of every op of ``orders`` (per stage, (op, microbatch, local chunk)), each placed as
    soon as its stage is free and its dependencies have finished, never reordering a stage's ops; and the
    makespan. Communication takes no time. ``ConfigError`` when the orders wait on each other forever."""
    chunks = stages * virtual_stages
    end: dict[tuple[Op, int, int], float] = {}
    starts: list[list[float]] = [[] for _ in orders]
    free = [0.0] * len(orders)
    while any(len(st) < len(order) for st, order in zip(starts, orders)):
        progressed = False
        for s, order in enumerate(orders):
            while len(starts[s]) < len(order):
                op, mb, j = order[len(starts[s])]
                deps = dependencies(op, mb, j * stages + s, chunks)
                if any(d not in end for d in deps):
                    break
                start = max([free[s], *(end[d] for d in deps)])
                end[(op, mb, j * stages + s)] = free[s] = start + duration[op]
                starts[s].append(start)
                progressed = True
        if not progressed:
            waiting = [
                f"stage {s}: {op_name(*order[len(st)])}"
                for s, (st, order) in enumerate(zip(starts, orders))
                if len(st) < len(order)
            ]
            raise ConfigError(f"pipeline order deadlocks; stuck at {', '.join(waiting)}")
    return starts, max(free, default=0.0)


# ----------------------------------------------------------------------------------- the SPMD executor
# The sections the executor can run in a tick, as indices into its list of section programs.
IDLE_SECTION, FORWARD_SECTION, INPUT_GRAD_SECTION = 0, 1, 2


def tick_sections(table) -> np.ndarray:
    """[ticks]: the one section each tick of ``table`` (a ``jaxpar.pipeline.table.Table``) runs on every
    stage, as an index into the executor's list (idle, forward, [input-gradient vjp when the table splits
    the backward,] full vjp): the cheapest that covers every stage's op in the tick."""
    op = table.op
    any_f, any_b, any_w = ((op == o).any(1) for o in (Op.F, Op.B, Op.W))
    full = 3 if table.split_backward else 2
    if table.split_backward:
        return np.where(any_w, full, np.where(any_b, 2, np.where(any_f, 1, 0))).astype(np.int32)
    return np.where(any_b, full, np.where(any_f, 1, 0)).astype(np.int32)


def executor_bubble_fraction(table, t_f: float, t_b: float, t_w: float | None = None) -> float:
    """The idle share of stage time when the executor runs ``table``: a tick lasts as long as its
    section (``tick_sections``): ``t_f`` the forward, ``t_b`` the vjp (in split tables the input-gradient
    one, and ``t_w`` the full one, which W actions need). Each action's own time is its useful work."""
    cost = np.array([0.0, t_f, t_b] + ([t_w] if table.split_backward else []))[tick_sections(table)]
    return float(1 - table.busy_time(t_f, t_b, t_w) / (table.stages * cost.sum()))


# ------------------------------------------------------------------ the executor with its own actions
def own_action_times(
    table, t_f: float, t_b: float, t_w: float | None = None, head: float = 0.0, scale=None
) -> np.ndarray:
    """[ticks, stages]: how long each stage's op lasts in each tick when every stage runs its own action
    (``jaxpar.pipeline.actions``): F, B, W by ``durations``, times each stage's ``scale`` (its chunks'
    layers over the largest chunk's, where a split is uneven; default 1), and the last model chunk's F
    ``head`` more (the final norm, LM head and loss run there, forward and backward)."""
    cell = durations(table.split_backward, t_f, t_b, t_w)[table.op]
    if scale is not None:
        cell = cell * np.asarray(scale, float)[None, :]
    model_chunk = table.chunk * table.stages + np.arange(table.stages)
    last = (table.op == Op.F) & (model_chunk == table.stages * table.virtual_stages - 1)
    return cell + np.where(last, head, 0.0)


def paired_makespan(table, cell: np.ndarray) -> float:
    """The step's time when each stage runs its ticks at its own pace (``cell``: [ticks, stages] op
    times) and a tick's send is a rendezvous of its sender and receiver alone: both go on once both have
    ended that tick (``ppermute``, XLA's collective-permute). No global barrier, no communication time."""
    p = table.stages
    end = np.zeros(p)
    for t in range(table.ticks):
        end = end + cell[t]
        ready = end.copy()
        for recv, source in ((table.fwd_recv_slot[t], -1), (table.bwd_recv_slot[t], +1)):
            for r in np.nonzero(recv >= 0)[0]:
                s = (r + source) % p
                both = max(end[s], end[r])
                ready[s], ready[r] = max(ready[s], both), max(ready[r], both)
        end = ready
    return float(end.max(initial=0.0))


def own_action_bubble_fraction(
    table, t_f: float, t_b: float, t_w: float | None = None, head: float = 0.0, scale=None
) -> float:
    """The idle share of stage time when every stage runs its own action (``own_action_times``) and
    waits only for the stages it exchanges with (``paired_makespan``). For gpipe, 1f1b and zero_bubble
    this is the table's ideal (``Table.bubble_fraction``) at head = 0; interleaved stays above it, since
    its sends close a ring (stage p-1 sends chunk boundaries on to stage 0) whose rendezvous pace the ring
    as one."""
    cell = own_action_times(table, t_f, t_b, t_w, head, scale)
    return float(1 - cell.sum() / (table.stages * paired_makespan(table, cell)))
