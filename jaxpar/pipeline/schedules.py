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

import numpy as np

from jaxpar.pipeline.ops import SPLIT_BACKWARD, Op, Schedule, check_pipeline
from jaxpar.pipeline.slots import assign_slots
from jaxpar.pipeline.table import Table
from jaxpar.pipeline.timing import simulate


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


def build(schedule: Schedule | str, stages: int, microbatches: int, virtual_stages: int = 1) -> Table:
    """The table of ``schedule`` for ``stages`` stages, ``microbatches`` microbatches and
    ``virtual_stages`` chunks per stage: the inputs checked (``check_pipeline``), each stage's order
    placed in unit ticks, buffer slots assigned, and the result validated."""
    check_pipeline(schedule, stages, microbatches, virtual_stages)
    schedule = Schedule(schedule)
    p, m, v = int(stages), int(microbatches), int(virtual_stages)
    orders = [ORDERS[schedule](p, m, v, s) for s in range(p)]
    op, mb, chunk = _place(orders, p, v)
    table = Table(schedule, p, m, v, op, mb, chunk, **assign_slots(op, mb, chunk, p, v, schedule in SPLIT_BACKWARD))
    table.validate()
    return table
