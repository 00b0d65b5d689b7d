"""Pipeline-parallel schedules as data: which stage runs which op on which microbatch at each tick.

Vocabulary. ``p`` stages, ``m`` microbatches, ``v`` virtual stages (model chunks per stage). The model is
cut into ``G = p·v`` chunks; model chunk ``g`` lives on stage ``g mod p`` as that stage's local chunk
``j = g // p`` (stage ``s`` holds chunks ``s, s+p, s+2p, ...``). Microbatch ``i`` runs forward through
chunks ``0..G-1`` and backward through ``G-1..0``. Ops (``Op``): ``F`` forward, ``B`` backward, ``W``
weight gradient. Where the schedule splits the backward (``zero_bubble``), ``B`` computes only the input
gradient and ``W`` the weight gradient; otherwise ``B`` is the whole backward and there is no ``W``.

Ticks. A ``Table`` holds one op per stage per tick (or idle). What a stage sends at the end of tick ``t``
(an ``F``'s output to the next stage, a ``B``'s input gradient to the previous one) is usable from tick
``t+1``. The dependencies: ``F(i, g)`` after ``F(i, g-1)``; ``B(i, g)`` after ``F(i, g)`` and, below the
last chunk, after ``B(i, g+1)``; ``W(i, g)`` after ``B(i, g)``.

How the tables are built. Each schedule is an *order* of ops per stage (the papers' warm-up, steady and
drain phases, below); every op is then placed as soon as possible in unit ticks without reordering a
stage's ops. ``Table.makespan`` runs the same as-soon-as-possible simulation with real durations, so the
bubble fractions here are those of the papers' event-driven pictures; ``lockstep_bubble_fraction`` is the
SPMD executor's, where every tick lasts as long as its slowest op.

    gpipe        (Huang et al. 2019) every forward, then every backward. In flight: m per stage.
    1f1b         PipeDream-Flush (Narayanan et al. 2021, arXiv 2104.04473 §2.2): stage s warms up with
                 min(p-s-1, m) forwards, then alternates one forward and one backward, then drains the
                 backwards. In flight: min(p-s, m) on stage s.
    interleaved  Megatron's interleaved 1F1B (same paper, §2.2): the same warm-up/steady/drain, over
                 v·m (microbatch, chunk) pairs per stage taken in groups of p microbatches: forwards
                 chunk 0 of the group's p microbatches, then chunk 1, ...; backwards from the last chunk
                 down. Warm-up (p-s-1) + (v-1)·p forwards, so stage s holds at most v·p - s chunk
                 activations, each 1/v of a stage's: stage 0 holds as much as under 1f1b. (Megatron-LM's
                 code warms up 2·(p-s-1) + (v-1)·p, to overlap its point-to-point transfers; in this
                 tick model both give the same ticks and bubble on the tests' grid, and this one holds
                 p-s-1 fewer activations.)
    zero_bubble  ZB-H1 (Qi et al. 2024, arXiv 2401.10241 §2.1): 1f1b's forwards and input-gradient
                 backwards, with stage s running W(k-s) right after B(k) and its last s weight gradients
                 in the drain. The deferred W's fill the drain; every stage holds at most p microbatches
                 (stage 0 defers none, so its memory is 1f1b's).

Closed forms (``bubble_formula``; bubble = idle time / (p × makespan), with ``t_f, t_b, t_w`` the
durations of one F, B, W of one model chunk; the tests check every one of them against the simulation):

    gpipe, 1f1b  (p-1)/(m+p-1), any t_f, t_b: the makespan is (m+p-1)·(t_f+t_b), the work of one stage
                 plus the fill (p-1 forward hops before the last stage starts) and the drain (p-1
                 backward hops after it ends), so every stage idles (p-1)·(t_f+t_b).
    interleaved  (p-1)/(v·m+p-1), any t_f, t_b, for m a multiple of p: the same (p-1)·(t_f+t_b) idle
                 against v·m·(t_f+t_b) of work (a chunk is 1/v of a stage: the bubble shrinks v-fold).
    zero_bubble  x/(m·(t_f+t_b+t_w) + x) with x = (p-1)·(t_f+t_b-t_w), for t_w <= min(t_f, t_b): stage
                 p-1 waits (p-1)·t_f for its first forward and then never idles until its last B; it then
                 has p weight gradients left (t_w each) while the last microbatch's B travels to stage 0
                 ((p-1)·t_b) and stage 0 runs its last W (t_w): it idles (p-1)·(t_b-t_w) at the end.
                 Every stage does the same work, so every stage idles x = (p-1)(t_f+t_b-t_w) in all. x is
                 the paper's ZB-H1 bubble, (p-1)(T_F+T_B-T_W), a third of 1F1B's (p-1)(T_F+T_B+T_W) when
                 the three are equal: (p-1)/(3m+p-1). With t_w above t_f or t_b the deferred W's no
                 longer fit the gaps and the measured bubble exceeds x (a grid of durations in the tests).

Lockstep. An SPMD executor that runs the ticks in lockstep pays the slowest op of every tick. gpipe loses
nothing by it (its forward ticks and backward ticks do not mix). 1f1b does: in its steady state every
tick has a B somewhere, so at t_b = 2·t_f its lockstep bubble is 1 - 3m/(4m+3p-4) for p >= 2, which
tends to 1/4 however many microbatches (interleaved likewise). zero_bubble at equal durations loses
nothing.

Buffers. The executor keeps, per stage, two buffers of slots: ``act`` (the stage input of a (microbatch,
chunk), written when it arrives and kept until its last backward op reads it) and ``grad`` (the cotangent
arriving from the next stage, kept until B, or W when the backward is split). The table says where every
arrival goes (``fwd_recv_slot``, ``bwd_recv_slot``) and which slot every op reads (``act_slot``,
``grad_slot``). Slots are assigned per stage by interval colouring (first free slot), which uses as many
slots as the most entries live at once: never fewer than the in-flight peak (an activation in flight
holds its slot), equal to it for gpipe (m), 1f1b and zero_bubble (p), up to p more for interleaved
(inputs arrive before the stage is free to run them). Only gpipe's grow with m.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers

import numpy as np

from jaxpar.config import Choice
from jaxpar.errors import ConfigError


class Schedule(Choice):
    """A pipeline schedule (see the module docstring)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZERO_BUBBLE = "zero_bubble"


class Op(enum.IntEnum):
    """What a stage runs in a tick. ``B`` is the input gradient alone when the schedule has ``W`` ops,
    else the whole backward."""

    IDLE = 0
    F = 1
    B = 2
    W = 3


SPLIT_BACKWARD = frozenset({Schedule.ZERO_BUBBLE})


# ------------------------------------------------------------------------------------------ refusals
def _count(value, field: str) -> int:
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
    p = _count(stages, "mesh stage")
    m = _count(microbatches, "pipeline.microbatches")
    v = _count(virtual_stages, "pipeline.virtual_stages")
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


# -------------------------------------------------------------------------------------------- orders
def _forward_order(p: int, m: int, v: int) -> list[tuple[int, int]]:
    """(microbatch, local chunk) in the order every stage runs their forwards: groups of p microbatches,
    chunk 0 of the group, then chunk 1, ... (for v = 1: microbatch order)."""
    return [(i, j) for start in range(0, m, p) for j in range(v) for i in range(start, min(start + p, m))]


def _backward_order(p: int, m: int, v: int) -> list[tuple[int, int]]:
    """As ``_forward_order`` with the chunks from the last down (the backward runs them in reverse)."""
    return [(i, j) for start in range(0, m, p) for j in reversed(range(v)) for i in range(start, min(start + p, m))]


def _gpipe_order(p: int, m: int, v: int, s: int) -> list[tuple[Op, int, int]]:
    return [(Op.F, i, 0) for i in range(m)] + [(Op.B, i, 0) for i in range(m)]


def _one_f_one_b_order(p: int, m: int, v: int, s: int) -> list[tuple[Op, int, int]]:
    """Warm-up forwards, then one forward and one backward at a time, then the remaining backwards.
    For v = 1 this is 1f1b (warm-up min(p-s-1, m)); for v > 1 Megatron's interleaved order."""
    forwards, backwards = _forward_order(p, m, v), _backward_order(p, m, v)
    warmup = min(p - s - 1 + (v - 1) * p, len(forwards))
    order = [(Op.F, i, j) for i, j in forwards[:warmup]]
    for k in range(len(forwards) - warmup):
        order += [(Op.F, *forwards[warmup + k]), (Op.B, *backwards[k])]
    return order + [(Op.B, i, j) for i, j in backwards[len(forwards) - warmup :]]


def _zero_bubble_order(p: int, m: int, v: int, s: int) -> list[tuple[Op, int, int]]:
    """ZB-H1: 1f1b's order with W(k-s) right after B(k), and the s weight gradients left after the last
    B at the end (stage s defers s of them: it holds at most p-s forwards plus s of those)."""
    order = []
    for op in _one_f_one_b_order(p, m, 1, s):
        order.append(op)
        if op[0] == Op.B and op[1] >= s:
            order.append((Op.W, op[1] - s, 0))
    return order + [(Op.W, i, 0) for i in range(max(m - s, 0), m)]


ORDERS = {
    Schedule.GPIPE: _gpipe_order,
    Schedule.ONE_F_ONE_B: _one_f_one_b_order,
    Schedule.INTERLEAVED: _one_f_one_b_order,
    Schedule.ZERO_BUBBLE: _zero_bubble_order,
}


# -------------------------------------------------------------------------------------------- timing
def _dependencies(op: Op, mb: int, g: int, chunks: int) -> list[tuple[Op, int, int]]:
    """The ops (op, microbatch, model chunk) that must finish before ``op`` of ``mb`` on chunk ``g``."""
    if op == Op.F:
        return [(Op.F, mb, g - 1)] if g > 0 else []
    if op == Op.B:
        return [(Op.F, mb, g)] + ([(Op.B, mb, g + 1)] if g < chunks - 1 else [])
    return [(Op.B, mb, g)]


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
                deps = _dependencies(op, mb, j * stages + s, chunks)
                if any(d not in end for d in deps):
                    break
                start = max([free[s], *(end[d] for d in deps)])
                end[(op, mb, j * stages + s)] = free[s] = start + duration[op]
                starts[s].append(start)
                progressed = True
        if not progressed:
            waiting = [
                f"stage {s}: {_name(*order[len(st)])}"
                for s, (st, order) in enumerate(zip(starts, orders))
                if len(st) < len(order)
            ]
            raise ConfigError(f"pipeline order deadlocks; stuck at {', '.join(waiting)}")
    return starts, max(free, default=0.0)


def _name(op: Op, mb: int, j: int) -> str:
    return f"{Op(op).name}(mb {mb}, chunk {j})"


def _place(orders: list[list[tuple[Op, int, int]]], p: int, v: int) -> tuple[np.ndarray, ...]:
    """The (op, mb, chunk) arrays [ticks, stages] of ``orders`` placed as soon as possible in unit ticks."""
    starts, ticks = simulate(orders, p, v, np.ones(4))
    op = np.zeros((int(ticks), p), np.int8)
    mb = np.full((int(ticks), p), -1, np.int32)
    chunk = np.full((int(ticks), p), -1, np.int32)
    for s, order in enumerate(orders):
        for (o, i, j), t in zip(order, starts[s]):
            op[int(t), s], mb[int(t), s], chunk[int(t), s] = o, i, j
    return op, mb, chunk


def op_ticks(op: np.ndarray, mb: np.ndarray, chunk: np.ndarray) -> dict[tuple[Op, int, int], int]:
    """{(op, microbatch, model chunk): tick} of a table's non-idle cells (the last one for duplicates)."""
    p = op.shape[1]
    return {(Op(op[t, s]), int(mb[t, s]), int(chunk[t, s]) * p + s): t for t, s in zip(*np.nonzero(op))}


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
        from jaxpar.pipeline.validate import check_table  # validate imports this module

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


def build(schedule: Schedule | str, stages: int, microbatches: int, virtual_stages: int = 1) -> Table:
    """The table of ``schedule`` for ``stages`` stages, ``microbatches`` microbatches and
    ``virtual_stages`` chunks per stage: the inputs checked (``check_pipeline``), each stage's order
    placed in unit ticks, buffer slots assigned, and the result validated."""
    check_pipeline(schedule, stages, microbatches, virtual_stages)
    schedule = Schedule(schedule)
    p, m, v = int(stages), int(microbatches), int(virtual_stages)
    orders = [ORDERS[schedule](p, m, v, s) for s in range(p)]
    op, mb, chunk = _place(orders, p, v)
    from jaxpar.pipeline.slots import assign_slots  # it reads this module's Op and op_ticks

    table = Table(schedule, p, m, v, op, mb, chunk, **assign_slots(op, mb, chunk, p, v, schedule in SPLIT_BACKWARD))
    table.validate()
    return table
