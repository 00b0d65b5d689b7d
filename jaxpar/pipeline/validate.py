"""Validity of a pipeline ``Table`` (``jaxpar.pipeline.table``): ``Table.validate``, which ``build`` runs on
every table it makes.

A table is valid when, in this order (the first broken rule raises ``ConfigError`` naming the stage,
tick and ops):

    inputs        (schedule, stages, microbatches, virtual_stages) pass ``check_pipeline``.
    shapes        the seven arrays are integers of shape [ticks, stages]; act_slots, grad_slots >= 1.
    cells         op is an ``Op``; W only with a split backward; idle cells have mb, chunk, act_slot and
                  grad_slot -1; a busy cell's mb, chunk and act_slot are in range; grad_slot is in range
                  where the op reads a cotangent (B or W below the last model chunk), -1 elsewhere;
                  fwd_recv_slot and bwd_recv_slot are -1 or in range.
    counts        one F and one B per (stage, microbatch, chunk), and one W iff the backward is split.
    dependencies  every op at a later tick than the ops it needs (``ops.dependencies``).
    slots         replaying each stage's act and grad buffers: every arrival (chunk 0's input from the
                  executor at the end of the tick before its F; an F's output from the previous stage;
                  a B's input gradient from the next) goes into a free slot, a recv slot is -1 where
                  nothing arrives, every op reads a slot holding its own (microbatch, chunk), and an
                  entry frees its slot after its last read (W when split, else B), in time for a write
                  at the end of that tick.
"""

from __future__ import annotations

import numpy as np

from jaxpar.errors import ConfigError
from jaxpar.pipeline.ops import Op, check_pipeline, count, dependencies, op_name, op_ticks


def check_table(table) -> None:
    """``ConfigError`` for the first rule (module docstring) ``table`` breaks."""
    check_pipeline(table.schedule, table.stages, table.microbatches, table.virtual_stages)
    _check_shapes(table)
    _check_cells(table)
    _check_counts(table)
    ticks = op_ticks(table.op, table.mb, table.chunk)
    _check_dependencies(table, ticks)
    for s in range(table.stages):
        _check_slots(table, s, ticks)


def _where(table, t: int, s: int) -> str:
    return f"pipeline table ({table.schedule}): stage {s}, tick {t}"


def _check_shapes(table) -> None:
    ticks = table.op.shape[0] if isinstance(table.op, np.ndarray) and table.op.ndim == 2 else None
    for name in ("op", "mb", "chunk", "act_slot", "grad_slot", "fwd_recv_slot", "bwd_recv_slot"):
        array = getattr(table, name)
        if (
            not isinstance(array, np.ndarray)
            or not np.issubdtype(array.dtype, np.integer)
            or array.shape != (ticks, table.stages)
        ):
            shape = getattr(array, "shape", type(array).__name__)
            raise ConfigError(
                f"pipeline table ({table.schedule}): {name} is {shape}, expected integers of "
                f"shape [ticks, stages] = [{ticks}, {table.stages}]"
            )
    for name in ("act_slots", "grad_slots"):
        if count(getattr(table, name), f"pipeline table {name}") < 1:
            raise ConfigError(f"pipeline table ({table.schedule}): {name}={getattr(table, name)} must be >= 1")


def _first_cell(mask: np.ndarray) -> tuple[int, int] | None:
    hits = np.argwhere(mask)
    return (int(hits[0][0]), int(hits[0][1])) if len(hits) else None


def _check_cells(table) -> None:
    """Values in range, idle cells empty, W only with a split backward, slots where an op reads one."""
    op, p, chunks = table.op, table.stages, table.stages * table.virtual_stages
    idle, busy = op == Op.IDLE, op != Op.IDLE
    model_chunk = table.chunk * p + np.arange(p)
    reads_grad = ((op == Op.B) | (op == Op.W)) & (model_chunk < chunks - 1)
    rules = [
        ((op < 0) | (op > Op.W), "op {op} is not an Op (0 idle, 1 F, 2 B, 3 W)"),
        ((op == Op.W) & (not table.split_backward), f"a W op, but {table.schedule} has no split backward"),
        (
            idle & ((table.mb != -1) | (table.chunk != -1) | (table.act_slot != -1) | (table.grad_slot != -1)),
            "an idle cell with mb {mb}, chunk {chunk}, act_slot {act}, grad_slot {grad} (all must be -1)",
        ),
        (busy & ((table.mb < 0) | (table.mb >= table.microbatches)), f"mb {{mb}} outside 0..{table.microbatches - 1}"),
        (
            busy & ((table.chunk < 0) | (table.chunk >= table.virtual_stages)),
            f"chunk {{chunk}} outside 0..{table.virtual_stages - 1}",
        ),
        (
            busy & ((table.act_slot < 0) | (table.act_slot >= table.act_slots)),
            f"act_slot {{act}} outside 0..{table.act_slots - 1}",
        ),
        (
            reads_grad & ((table.grad_slot < 0) | (table.grad_slot >= table.grad_slots)),
            f"grad_slot {{grad}} outside 0..{table.grad_slots - 1}",
        ),
        (
            busy & ~reads_grad & (table.grad_slot != -1),
            "grad_slot {grad} on an op with no incoming cotangent (an F, or the last model chunk's B/W)",
        ),
        ((table.fwd_recv_slot < -1) | (table.fwd_recv_slot >= table.act_slots), "fwd_recv_slot {fwd} out of range"),
        ((table.bwd_recv_slot < -1) | (table.bwd_recv_slot >= table.grad_slots), "bwd_recv_slot {bwd} out of range"),
    ]
    for mask, message in rules:
        cell = _first_cell(mask)
        if cell is not None:
            t, s = cell
            values = dict(
                op=op[t, s],
                mb=table.mb[t, s],
                chunk=table.chunk[t, s],
                act=table.act_slot[t, s],
                grad=table.grad_slot[t, s],
                fwd=table.fwd_recv_slot[t, s],
                bwd=table.bwd_recv_slot[t, s],
            )
            raise ConfigError(f"{_where(table, t, s)}: {message.format(**values)}")


def _check_counts(table) -> None:
    """Exactly one F and one B per (stage, microbatch, chunk), and one W iff the backward is split."""
    counts = np.zeros((table.stages, table.microbatches, table.virtual_stages, 4), np.int64)
    t, s = np.nonzero(table.op)
    np.add.at(counts, (s, table.mb[t, s], table.chunk[t, s], table.op[t, s]), 1)
    expected = np.array([0, 1, 1, 1 if table.split_backward else 0])
    bad = np.argwhere(counts != expected)
    if len(bad):
        s, i, j, o = (int(x) for x in bad[0])
        at = [int(x) for x in np.nonzero((table.op[:, s] == o) & (table.mb[:, s] == i) & (table.chunk[:, s] == j))[0]]
        raise ConfigError(
            f"pipeline table ({table.schedule}): stage {s} has {counts[s, i, j, o]} "
            f"{Op(o).name} ops of (mb {i}, chunk {j}) (ticks {at}); each (stage, microbatch, "
            f"chunk) needs exactly {expected[o]}"
        )


def _check_dependencies(table, ticks: dict) -> None:
    """Every op after the ops it needs, at an earlier tick."""
    p, chunks = table.stages, table.stages * table.virtual_stages
    for (o, i, g), t in sorted(ticks.items(), key=lambda item: item[1]):
        for d in dependencies(o, i, g, chunks):
            if ticks[d] >= t:
                raise ConfigError(
                    f"{_where(table, t, g % p)}: {op_name(o, i, g // p)} needs "
                    f"{d[0].name}(mb {i}, model chunk {d[2]}) on stage {d[2] % p} at an earlier "
                    f"tick; it runs at tick {ticks[d]}"
                )


class _Buffer:
    """One stage's act or grad buffer while a table is checked: which (microbatch, chunk) each slot holds.
    An entry leaves its slot after its last read, so a slot read for the last time in tick u is free to
    be written at the end of tick u."""

    def __init__(self, table, stage: int, name: str, recv_field: str, last_use: dict):
        self.table, self.stage, self.name, self.recv_field = table, stage, name, recv_field
        self.last_use = last_use  # {(microbatch, chunk): tick of its last read}
        self.held: dict[int, tuple[int, int]] = {}

    def write(self, t: int, slot: int, entry: tuple[int, int], sender: str) -> None:
        """``sender`` delivers ``entry`` into ``slot`` at the end of tick ``t``."""
        where, (i, j) = _where(self.table, t, self.stage), entry
        if slot < 0:
            raise ConfigError(
                f"{where}: {sender} sends the {self.name} of (mb {i}, chunk {j}) but "
                f"{self.recv_field} is -1: it would be lost"
            )
        if slot in self.held:
            old = self.held[slot]
            raise ConfigError(
                f"{where}: the {self.name} of (mb {i}, chunk {j}) from {sender} overwrites "
                f"{self.name} slot {slot}, which holds (mb {old[0]}, chunk {old[1]}) until "
                f"tick {self.last_use[old]}"
            )
        self.held[slot] = entry

    def read(self, t: int, slot: int, entry: tuple[int, int], reader: str) -> None:
        held = self.held.get(int(slot))
        if held != entry:
            holds = "nothing" if held is None else f"(mb {held[0]}, chunk {held[1]})"
            raise ConfigError(
                f"{_where(self.table, t, self.stage)}: {reader} reads {self.name} slot {slot}, "
                f"which holds {holds}, not (mb {entry[0]}, chunk {entry[1]})"
            )
        if self.last_use[entry] == t:
            del self.held[int(slot)]


def _check_slots(table, s: int, ticks: dict) -> None:
    """Replays stage ``s``'s two buffers: every arrival stored in a free slot, every op reading a slot
    that holds its own (microbatch, chunk)."""
    p = table.stages
    last = Op.W if table.split_backward else Op.B
    last_use = {(i, g // p): t for (o, i, g), t in ticks.items() if o == last and g % p == s}
    act = _Buffer(table, s, "act", "fwd_recv_slot", last_use)
    grad = _Buffer(table, s, "grad", "bwd_recv_slot", last_use)
    chunks = p * table.virtual_stages
    for t in range(-1, table.ticks):
        o, i, j = (int(x[t, s]) for x in (table.op, table.mb, table.chunk)) if t >= 0 else (0, -1, -1)
        if o != Op.IDLE:
            act.read(t, table.act_slot[t, s], (i, j), op_name(o, i, j))
            if o != Op.F and j * p + s < chunks - 1:
                grad.read(t, table.grad_slot[t, s], (i, j), op_name(o, i, j))
        if s == 0 and t + 1 < table.ticks and table.op[t + 1, 0] == Op.F and table.chunk[t + 1, 0] == 0:
            i = int(table.mb[t + 1, 0])
            act.write(t, table.act_slot[t + 1, 0], (i, 0), f"the executor (the input of F(mb {i}, chunk 0))")
        if t >= 0:
            _check_arrival(table, t, s, act, Op.F, (s - 1) % p, table.fwd_recv_slot[t, s])
            _check_arrival(table, t, s, grad, Op.B, (s + 1) % p, table.bwd_recv_slot[t, s])


def _check_arrival(table, t: int, s: int, buffer: _Buffer, kind: Op, sender: int, slot: int) -> None:
    """What ``sender`` sends stage ``s`` at the end of tick ``t``: the output of an F (the input of the
    next model chunk) or the input gradient of a B (the cotangent of the previous chunk), if any."""
    p, chunks = table.stages, table.stages * table.virtual_stages
    o, i, j = (int(x[t, sender]) for x in (table.op, table.mb, table.chunk))
    g = j * p + sender
    target = g + 1 if kind == Op.F else g - 1
    if o == kind and 0 <= target < chunks:
        buffer.write(t, int(slot), (i, target // p), f"{op_name(o, i, j)} on stage {sender}")
    elif slot != -1:
        raise ConfigError(
            f"{_where(table, t, s)}: {buffer.recv_field} is {slot}, but stage {sender} sends "
            f"nothing stage {s} uses at this tick"
        )
