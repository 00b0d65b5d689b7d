"""One stage's program in the pipeline executor (``jaxpar.pipeline.executor``): a ``lax.scan`` over the
table's ticks, inside ``shard_map`` (manual over ``stage``).

The scan reads one ``TickRow`` per tick (the table's arrays for every stage, and which section and sends
the tick runs) and carries a ``Carry``: the stage's buffers of chunk inputs and cotangents, and its float32
accumulators. Each stage reads its own ``Action`` out of the row (its op, microbatch, local chunk and
buffer slots) and runs the tick's section (``Sections``): idle, forward, the input-gradient vjp (split
schedules) or the full vjp; then every stage sends and files what arrives in the slots the table names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.pipeline.ops import Op
from jaxpar.pipeline.timing import tick_sections
from jaxpar.rules import constrain

AXIS = "stage"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TickRow:
    """What the scan reads at one tick: the table's cells of every stage ([stages] each; the slots with -1
    turned into each buffer's trash slot, microbatch and chunk with -1 into 0), and for all stages the
    section to run and the send pattern of each direction (0: nobody sends; ``send_patterns``)."""

    op: jax.Array
    microbatch: jax.Array
    local_chunk: jax.Array
    act_slot: jax.Array  # the act buffer slot the op reads
    grad_slot: jax.Array  # the grad buffer slot the op reads
    fwd_recv_slot: jax.Array  # where the forward output arriving at the end of the tick goes
    bwd_recv_slot: jax.Array  # where the input gradient arriving at the end of the tick goes
    section: jax.Array  # scalar: index into ``Sections.programs``
    fwd_send: jax.Array  # scalar: 1 + index of the forward pair list
    bwd_send: jax.Array  # scalar: 1 + index of the backward pair list


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Action:
    """What this stage does at a tick: ``op`` on ``microbatch`` with its ``local_chunk``, reading its input
    from act slot ``act_slot`` and its cotangent from grad slot ``grad_slot``; ``first``/``last``: the
    chunk is the model's first (the embedding runs in it) or last (the head and loss run in it)."""

    op: jax.Array
    microbatch: jax.Array
    local_chunk: jax.Array
    act_slot: jax.Array
    grad_slot: jax.Array
    first: jax.Array
    last: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Carry:
    """What a stage keeps from tick to tick. Buffers have one trash slot at the end (for "nothing")."""

    chunk_inputs: jax.Array  # [act_slots + 1, b, T, D]: the inputs of the chunks in flight
    cotangents: jax.Array  # [grad_slots + 1, b, T, D]: the gradients that came back for them
    stack_grads: object  # float32 weight gradients of the stage's rows of the pipelined stack
    other_grads: object  # float32 gradients of the replicated parameters (embedding, head, ...)
    cross_entropy: jax.Array  # float32 sums over the microbatches whose last chunk ran here
    z_loss: jax.Array
    moe_stats: object  # float32 MoE statistics of the stage's rows (None for dense models)
    start_grads: jax.Array | None  # [m, b, T, D]: gradients of the prologue's outputs (None: no prologue)


def tick_rows(table) -> tuple[TickRow, list[tuple], list[tuple]]:
    """The scan's input: every tick's ``TickRow`` stacked (numpy), and the forward and backward pair lists."""
    clamp = lambda a, k: np.where(a < 0, k, a).astype(np.int32)  # -1 -> the trash slot k
    fwd_pairs, fwd_send = send_patterns(table.fwd_recv_slot, -1)
    bwd_pairs, bwd_send = send_patterns(table.bwd_recv_slot, +1)
    rows = TickRow(
        op=table.op.astype(np.int32),
        microbatch=np.maximum(table.mb, 0).astype(np.int32),
        local_chunk=np.maximum(table.chunk, 0).astype(np.int32),
        act_slot=clamp(table.act_slot, table.act_slots),
        grad_slot=clamp(table.grad_slot, table.grad_slots),
        fwd_recv_slot=clamp(table.fwd_recv_slot, table.act_slots),
        bwd_recv_slot=clamp(table.bwd_recv_slot, table.grad_slots),
        section=tick_sections(table),
        fwd_send=fwd_send,
        bwd_send=bwd_send,
    )
    return rows, fwd_pairs, bwd_pairs


def send_patterns(recv_slot: np.ndarray, source: int) -> tuple[list[tuple], np.ndarray]:
    """The (sender, receiver) pairs whose send is used, per tick: stage r receives from r + ``source``
    (mod p) when its recv slot is set. Returns the distinct non-empty pair lists and, per tick, 1 + the
    index of its list (0: nobody sends). Sending only these pairs moves exactly what the schedule needs:
    per microbatch, one activation forward and one gradient back over each chunk boundary."""
    ticks, p = recv_slot.shape
    per_tick = [tuple(((r + source) % p, r) for r in range(p) if recv_slot[t, r] >= 0) for t in range(ticks)]
    patterns = sorted({pairs for pairs in per_tick if pairs})
    return patterns, np.array([patterns.index(pairs) + 1 if pairs else 0 for pairs in per_tick], np.int32)


def send(which, patterns: list[tuple], x):
    """``ppermute`` of x over the pairs ``patterns[which - 1]`` (zeros when ``which`` is 0); ``which``
    depends on the tick only, so every device takes the same branch."""
    branches = [jnp.zeros_like] + [lambda x, pairs=pairs: jax.lax.ppermute(x, AXIS, list(pairs)) for pairs in patterns]
    return jax.lax.switch(which, branches, x)


def action_of(row: TickRow, stage, stages: int, last_chunk: int) -> Action:
    """This stage's ``Action`` at the tick of ``row``."""
    local_chunk = row.local_chunk[stage]
    model_chunk = local_chunk * stages + stage
    return Action(
        op=row.op[stage],
        microbatch=row.microbatch[stage],
        local_chunk=local_chunk,
        act_slot=row.act_slot[stage],
        grad_slot=row.grad_slot[stage],
        first=model_chunk == 0,
        last=model_chunk == last_chunk,
    )


# ------------------------------------------------------------------------------------------- helpers
def here(tree):
    """The same state with its Variables rebuilt at the current trace level (nnx refuses Variables made
    outside a transform it runs, e.g. its scan inside our vjp)."""
    return jax.tree.map(lambda a: a, tree)


def rows_of(tree, j, n: int):
    """Rows [j·n, (j+1)·n) of every leaf (local chunk j of a stage's layers); the leaf itself where it
    has n rows (one chunk per stage: a dynamic slice would copy the stage's weights every tick)."""
    return jax.tree.map(lambda a: a if a.shape[0] == n else jax.lax.dynamic_slice_in_dim(a, j * n, n, axis=0), tree)


def add_rows(acc, tree, j, n: int, keep):
    """acc[j·n:(j+1)·n] += tree where ``keep`` (float32 accumulators)."""

    def add(a, g):
        if a.shape[0] == n:
            return a + jnp.where(keep, g.astype(a.dtype), 0)
        part = jax.lax.dynamic_slice_in_dim(a, j * n, n, axis=0) + jnp.where(keep, g.astype(a.dtype), 0)
        return jax.lax.dynamic_update_slice_in_dim(a, part, j * n, axis=0)

    return jax.tree.map(add, acc, tree)


def _add(acc, tree, keep):
    return jax.tree.map(lambda a, g: a + jnp.where(keep, g.astype(a.dtype), 0), acc, tree)


def zeros_f32(tree):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)


def act_buffer(slots: int, x) -> jax.Array:
    """A zeroed buffer of ``slots`` microbatch activations shaped as ``x`` [b, T, D], plus a trash slot."""
    return constrain(jnp.zeros((slots + 1, *x.shape), x.dtype), (None, "batch", "length", "act_embed"))


def stats_zeros(stats, rows: int):
    """Float32 accumulators for one chunk's MoE statistics ``stats`` (shapes), over a stage's ``rows``."""
    return None if stats is None else jax.tree.map(lambda a: jnp.zeros((rows, *a.shape[1:]), jnp.float32), stats)


# ------------------------------------------------------------------------------------ chunk programs
@dataclasses.dataclass(frozen=True)
class ChunkPrograms:
    """The forward and the objective of one model chunk on this stage, for an ``Action``: the model's
    pipelined stack ``stack_name`` (the stage's rows ``sr`` of its non-trained state, the replicated rest
    ``orest``), microbatches ``ids``/``targets`` (dicts of [m, b, T] arrays: ``pipeline_grads``) in storage
    order, ``per_chunk`` layers a chunk.
    ``prefixed``: chunk 0's input comes from the prologue, not the embedding."""

    graphdef: object
    stack_name: str
    sr: object
    orest: object
    ids: dict
    targets: dict
    losses: Callable
    per_chunk: int
    prefixed: bool
    active: object = None  # this stage's storage rows that hold a layer [v · per_chunk] (None: all)
    skip: bool = False  # padding rows are skipped by a branch (else computed and dropped)

    @property
    def rows(self) -> tuple[int, int]:
        """(rows, tokens) of a microbatch."""
        return self.ids["ids"].shape[1:]

    def tokens(self, model, microbatch):
        """(ids, positions, index, segments) of a microbatch, as the model's layers see them."""
        mb = jax.tree.map(lambda a: a[microbatch], self.ids)
        ids, positions, index, _ = model.inputs(mb["ids"], mb.get("positions"), stored=True)
        return ids, positions, index, mb.get("segments")

    def loss(self, head, x, microbatch):
        """(cross-entropy, z-loss) of a microbatch's targets (weighed by its ``weights`` when given)."""
        mb = jax.tree.map(lambda a: a[microbatch], self.targets)
        return self.losses(head, x, mb["targets"], weights=mb.get("weights"))

    def rows_active(self, j):
        """``run_stack``'s ``active`` for local chunk j (None when every row holds a layer)."""
        return None if self.active is None else (rows_of(self.active, j, self.per_chunk), self.skip)

    def forward(self, stack_params, other_params, x_in, a: Action):
        """Chunk ``a.local_chunk`` from x_in (or microbatch ``a.microbatch``'s embedding on model chunk 0):
        (model, x_out, weighted auxiliary loss, MoE statistics)."""
        rest = rows_of(self.sr, a.local_chunk, self.per_chunk)
        model = nnx.merge(self.graphdef, *here((stack_params, other_params, rest, self.orest)))
        ids, positions, index, segments = self.tokens(model, a.microbatch)
        x = x_in if self.prefixed else jnp.where(a.first, model.embed(ids), x_in)
        x = constrain(x, ("batch", "length", "act_embed"))
        stack = getattr(model, self.stack_name)
        x, aux, stats = model.run_stack(stack, x, positions, index, self.rows_active(a.local_chunk), segments)
        return model, x, aux, stats

    def objective(self, stack_params, other_params, x_in, a: Action):
        """``forward`` and the loss on the last model chunk:
        ((x_out, objective), (cross_entropy, z_loss, MoE statistics))."""
        model, x, aux, stats = self.forward(stack_params, other_params, x_in, a)
        ce, z = self.loss(model.head, x, a.microbatch)
        ce, z = jnp.where(a.last, ce, 0.0), jnp.where(a.last, z, 0.0)
        return (x, ce + z + aux), (ce, z, stats)


# ------------------------------------------------------------------------------------------ sections
@dataclasses.dataclass(frozen=True)
class Sections:
    """The sections a tick can run on every stage, each ``(Carry, Action) -> (Carry, forward send,
    backward send)``: ``programs[section]`` with the section numbers of ``tick_sections``. ``sp``, ``op``:
    the stage's stack parameters and the replicated ones; ``start``: the prologue's outputs (or None)."""

    chunk: ChunkPrograms
    sp: object
    op: object
    start: jax.Array | None
    microbatches: int
    split_backward: bool

    @property
    def programs(self) -> list[Callable]:
        vjp = [lambda c, a: self.vjp(c, a, weights=False)] * self.split_backward
        return [self.idle, self.forward] + vjp + [lambda c, a: self.vjp(c, a, weights=True)]

    def idle(self, c: Carry, a: Action):
        zero = jnp.zeros_like(c.cotangents[0])
        return c, zero, zero

    def forward(self, c: Carry, a: Action):
        stack = rows_of(self.sp, a.local_chunk, self.chunk.per_chunk)
        _, x, _, stats = self.chunk.forward(stack, self.op, self._input(c, a), a)
        return self._kept_stats(c, a, stats), x, jnp.zeros_like(x)

    def vjp(self, c: Carry, a: Action, *, weights: bool):
        """Every stage's chunk forward and backward from its own input: F keeps the output, B the input
        gradient (and the weight gradient unless the schedule splits it off), W the weight gradient."""
        x_in, dy, w = self._input(c, a), self._cotangent(c, a), rows_of(self.sp, a.local_chunk, self.chunk.per_chunk)
        seed = (dy, jnp.float32(1 / self.microbatches))
        if weights:
            objective = lambda w, o, x: self.chunk.objective(w, o, x, a)
            (x, _), vjp, (ce, z, stats) = jax.vjp(objective, w, self.op, x_in, has_aux=True)
            dw, do, dx = vjp(seed)
            keep = a.op == (Op.W if self.split_backward else Op.B)
            stack_grads = add_rows(c.stack_grads, dw, a.local_chunk, self.chunk.per_chunk, keep)
            c = dataclasses.replace(c, stack_grads=stack_grads, other_grads=_add(c.other_grads, do, keep))
        else:  # input gradients only: the weights are constants here
            (x, _), vjp, (ce, z, stats) = jax.vjp(lambda x: self.chunk.objective(w, self.op, x, a), x_in, has_aux=True)
            (dx,) = vjp(seed)
        keep = a.op == Op.B
        if self.start is not None:
            start_grads = c.start_grads.at[a.microbatch].add(jnp.where(keep & a.first, dx, 0))
            c = dataclasses.replace(c, start_grads=start_grads)
        c = dataclasses.replace(
            c, cross_entropy=c.cross_entropy + jnp.where(keep, ce, 0.0), z_loss=c.z_loss + jnp.where(keep, z, 0.0)
        )
        return self._kept_stats(c, a, stats), x, dx

    def _input(self, c: Carry, a: Action):
        x = c.chunk_inputs[a.act_slot]
        return x if self.start is None else jnp.where(a.first, self.start[a.microbatch], x)

    def _cotangent(self, c: Carry, a: Action):  # the last chunk's output goes nowhere: its loss is the seed
        return jnp.where(a.last, jnp.zeros_like(c.cotangents[0]), c.cotangents[a.grad_slot])

    def _kept_stats(self, c: Carry, a: Action, stats) -> Carry:  # MoE statistics count at the forward
        if stats is None:
            return c
        moe_stats = add_rows(c.moe_stats, stats, a.local_chunk, self.chunk.per_chunk, a.op == Op.F)
        return dataclasses.replace(c, moe_stats=moe_stats)


# ------------------------------------------------------------------------------------------ the scan
def initial_carry(chunk: ChunkPrograms, sp, op, table, start) -> Carry:
    """Zeroed buffers (one trash slot at the end for "nothing") and float32 accumulators."""
    n, name = chunk.per_chunk, chunk.stack_name
    parts = (rows_of(sp, 0, n), op, rows_of(chunk.sr, 0, n), chunk.orest)
    model = nnx.merge(chunk.graphdef, *here(parts))
    b, t = chunk.rows
    x = jax.ShapeDtypeStruct((b, t, model.cfg.embed_dim), model.execution.dtype)

    def stack_stats(parts):
        model = nnx.merge(chunk.graphdef, *here(parts))
        index = jnp.zeros((b, t), jnp.int32)
        return model.run_stack(getattr(model, name), jnp.zeros(x.shape, x.dtype), index, index)[2]

    stats = stats_zeros(jax.eval_shape(stack_stats, parts), table.virtual_stages * n)
    return Carry(
        chunk_inputs=act_buffer(table.act_slots, x),
        cotangents=act_buffer(table.grad_slots, x),
        stack_grads=zeros_f32(sp),
        other_grads=zeros_f32(op),
        cross_entropy=jnp.zeros((), jnp.float32),
        z_loss=jnp.zeros((), jnp.float32),
        moe_stats=stats,
        start_grads=None if start is None else jnp.zeros_like(start),
    )


def stage_active(active: np.ndarray | None, stage, stages: int):
    """This stage's rows of the storage's ``active`` mask (``jaxpar.pipeline.stack``; None: no padding)."""
    return None if active is None else jnp.asarray(active.reshape(stages, -1))[stage]


def stage_body(graphdef, stack_name: str, table, per_chunk: int, losses: Callable, prefixed: bool, active=None):
    """The per-stage program (inside ``shard_map``, manual over ``stage``). ``prefixed``: model chunk 0
    starts from ``start`` [m, b, T, D] (the executor's prologue), and the program also returns its gradient.
    ``active``: the storage rows that hold a layer (None: all; padding rows are computed and dropped, as
    a branch that differs between stages must not hold the collectives XLA places in a section)."""
    rows, fwd_pairs, bwd_pairs = tick_rows(table)
    last_chunk = table.stages * table.virtual_stages - 1

    def body(sp, op, sr, orest, ids, targets, start=None):
        stage = jax.lax.axis_index(AXIS)
        rows_on = stage_active(active, stage, table.stages)
        chunk = ChunkPrograms(graphdef, stack_name, sr, orest, ids, targets, losses, per_chunk, prefixed, rows_on)
        sections = Sections(chunk, sp, op, start, table.microbatches, table.split_backward).programs

        def tick(c: Carry, row: TickRow):
            a = action_of(row, stage, table.stages, last_chunk)
            c, fwd, bwd = jax.lax.switch(row.section, sections, c, a)
            fwd, bwd = send(row.fwd_send, fwd_pairs, fwd), send(row.bwd_send, bwd_pairs, bwd)
            inputs = c.chunk_inputs.at[row.fwd_recv_slot[stage]].set(fwd)  # what arrived, filed
            cotangents = c.cotangents.at[row.bwd_recv_slot[stage]].set(bwd)
            return dataclasses.replace(c, chunk_inputs=inputs, cotangents=cotangents), None

        carry, _ = jax.lax.scan(tick, initial_carry(chunk, sp, op, table, start), jax.tree.map(jnp.asarray, rows))
        psum = lambda x: jax.lax.psum(x, AXIS)
        out = carry.stack_grads, psum(carry.other_grads), psum(carry.cross_entropy), psum(carry.z_loss)
        out += (carry.moe_stats,)
        return out + ((carry.start_grads[None],) if prefixed else ())

    return body
