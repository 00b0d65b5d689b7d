"""The stage program where each stage runs only its own action (``jaxpar.pipeline.executor``).

It runs with the batch axes manual beside ``stage`` (``grad_reduce=step``), where what is still split
inside a stage is ``tensor`` and ``sequence`` at most: their collectives run among one stage's devices,
which all run the same action, so stages can run different work in the same tick. Each tick, every
stage runs its own ``Op``, as a loop of zero or one trips (``when``: XLA updates its carry in place):

- ``F`` runs its chunk's forward once, as a ``jax.vjp``, and files the residuals the backward needs in
  the slot its chunk input holds (the act slot, alive until the chunk's last backward op). The embedding
  runs only on model chunk 0. On the last chunk the final norm, LM head and loss run here, forward and
  backward at once: their weight gradient is added, and the gradient of the chunk's output is filed
  beside the residuals (so no logits outlive the tick).
- ``B`` rebuilds the chunk's pullback from the filed residuals and runs it: the input gradient (and the
  weight gradient, unless the schedule splits it off). On chunk 0 the embedding's backward follows.
- ``W`` (split schedules) runs the weight gradient alone. The pullback is cut in two by data dependence
  (``jaxpar.pipeline.wgrad``): B runs the input gradient's chain and hands W, in the act slot, the
  cotangents of the ops the weights multiply; W contracts them with the residuals, so it costs the
  weight gradient's own FLOPs and nothing of B's chain again. Where the cut saves nothing (an equation
  it cannot enter computes both gradients), W runs the whole pullback for the weight gradient.

Nothing is recomputed but what the model's remat policy asks for, and the residuals that depend on the
weights alone (their compute-dtype casts, reshapes): those are recomputed from the weights in the tick
that needs them, so no copy of a weight lives per microbatch in flight (``split_residuals``).
What a stage holds per microbatch in flight: its chunk input, the residuals its remat policy keeps, and
(for the stage's last chunk) the gradient of the chunk's output.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax._src.interpreters import partial_eval as pe  # no public API splits a jaxpr by data dependence

from jaxpar.pipeline.ops import Op
from jaxpar.pipeline.stage import (
    AXIS,
    Action,
    ChunkPrograms,
    TickRow,
    act_buffer,
    action_of,
    add_rows,
    here,
    rows_of,
    send,
    stage_active,
    stats_zeros,
    tick_rows,
    zeros_f32,
)
from jaxpar.pipeline.wgrad import WeightCut
from jaxpar.rules import constrain


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Carry:
    """What a stage keeps from tick to tick (buffers: one trash slot at the end, for "nothing")."""

    chunk_inputs: jax.Array  # [act_slots + 1, b, T, D]
    cotangents: jax.Array  # [grad_slots + 1, b, T, D]
    residuals: tuple  # per kept residual [act_slots + 1, ...]; the last: the output gradient of a last chunk
    handoff: tuple  # split schedules: per value B hands W [act_slots + 1, ...] (``jaxpar.pipeline.wgrad``)
    stack_grads: object
    other_grads: object
    cross_entropy: jax.Array
    z_loss: jax.Array
    moe_stats: object
    outbox: tuple  # (forward send, backward send) [b, T, D] each: what this tick's op sends


def _arrays(pullback, primals) -> list[int]:
    """Positions, among ``pullback``'s leaves, of its residual arrays (not the primal inputs themselves)."""
    given = {id(x) for x in jax.tree.leaves(primals)}
    return [k for k, x in enumerate(jax.tree.leaves(pullback)) if isinstance(x, jax.Array) and id(x) not in given]


def _added(acc, grads):
    """The float32 accumulator ``acc`` plus ``grads``."""
    return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)


def kept_vjp(forward: Callable, w, x, a, weight_only: list[bool]):
    """``forward(w, x, a)`` as a vjp: ((x_out, aux), the residuals to keep, stats), the residuals of the
    weights alone (``weight_only``, from ``split_residuals``) left out."""
    out, pullback, stats = jax.vjp(lambda w, x: forward(w, x, a), w, x, has_aux=True)
    leaves = jax.tree.leaves(pullback)
    return out, [leaves[k] for k, known in zip(_arrays(pullback, (w, x)), weight_only) if not known], stats


def split_residuals(forward: Callable, w, x, a) -> list[bool]:
    """Per residual array of ``jax.vjp(forward(·, ·, a), w, x)``: True where it depends on the weights
    ``w`` alone (not on ``x`` or the action ``a``), found by splitting its jaxpr by data dependence."""

    def residuals(w, x, a):
        _, pullback, _ = jax.vjp(lambda w, x: forward(w, x, a), w, x, has_aux=True)
        leaves = jax.tree.leaves(pullback)
        return [leaves[k] for k in _arrays(pullback, (w, x))]

    closed = jax.make_jaxpr(residuals)(w, x, a)
    known = [False] * len(jax.tree.leaves(w)) + [True] * len(jax.tree.leaves((x, a)))
    _, _, depends, _ = pe.partial_eval_jaxpr_nounits(closed, known, instantiate=False)
    return [not d for d in depends]


def when(pred, fn: Callable, carry):
    """``fn(carry)`` where ``pred``, else ``carry``: a loop of 0 or 1 trips, whose carry XLA updates in
    place (a ``cond`` would copy every buffer its identity branch passes through)."""
    return jax.lax.while_loop(lambda s: s[0], lambda s: (jnp.zeros((), bool), fn(s[1])), (pred, carry))[1]


@dataclasses.dataclass(frozen=True)
class OwnActions:
    """A stage's tick: ``tick(c, a)`` runs the action's op on the ``Carry``, leaving what it sends in
    ``c.outbox``. ``forward(w, x, a) -> ((x_out, aux), stats)`` is the chunk's stack; ``embed(o, a)``
    chunk 0's input; ``loss(o, x, a) -> (ce + z, (ce, z))`` the head and loss."""

    forward: Callable
    embed: Callable
    loss: Callable
    sp: object
    op: object
    per_chunk: int
    microbatches: int
    split_backward: bool
    weight_only: list[bool]

    def tick(self, c: Carry, a) -> Carry:
        c = when(a.op == Op.F, lambda c: self.run_forward(c, a), c)
        c = when(a.op == Op.B, lambda c: self.run_backward(c, a, weights=not self.split_backward), c)
        if self.split_backward:
            c = when(a.op == Op.W, lambda c: self.run_weights(c, a), c)
        return c

    def _weights(self, a):
        return rows_of(self.sp, a.local_chunk, self.per_chunk)

    def _input(self, c: Carry, a):
        """The chunk's input: from its act slot; on chunk 0 in the forward, the embedding (filed there)."""
        x = c.chunk_inputs[a.act_slot]
        return jax.lax.cond(a.first & (a.op == Op.F), lambda: self.embed(self.op, a).astype(x.dtype), lambda: x)

    def _seed(self):
        return jnp.float32(1 / self.microbatches)

    def run_forward(self, c: Carry, a) -> Carry:
        """The chunk's forward; its residuals filed; on the last chunk the head and loss, both ways."""
        x = self._input(c, a)
        (y, _), kept, stats = kept_vjp(self.forward, self._weights(a), x, a, self.weight_only)
        c = dataclasses.replace(c, chunk_inputs=c.chunk_inputs.at[a.act_slot].set(x))  # chunk 0: the embedding
        residuals = tuple(r.at[a.act_slot].set(new) for r, new in zip(c.residuals, kept)) + c.residuals[len(kept) :]
        moe_stats = c.moe_stats
        if stats is not None:
            moe_stats = add_rows(moe_stats, stats, a.local_chunk, self.per_chunk, True)
        c = dataclasses.replace(c, residuals=residuals, moe_stats=moe_stats, outbox=(y, c.outbox[1]))
        return when(a.last, lambda c: self._head(c, y, a), c)

    def _head(self, c: Carry, y, a) -> Carry:
        _, pull, (ce, z) = jax.vjp(lambda o, y: self.loss(o, y, a), self.op, y, has_aux=True)
        do, dy = pull(self._seed())
        output_grads = c.residuals[-1].at[a.act_slot].set(dy.astype(c.residuals[-1].dtype))
        return dataclasses.replace(
            c,
            other_grads=_added(c.other_grads, do),
            residuals=(*c.residuals[:-1], output_grads),
            cross_entropy=c.cross_entropy + ce,
            z_loss=c.z_loss + z,
        )

    def _pullback(self, c: Carry, a):
        """The chunk's pullback with the residuals filed by its forward (those of the weights alone
        recomputed here), and its seed: the gradient of the chunk's output and of the auxiliary loss."""
        w, x = self._weights(a), self._input(c, a)
        _, pullback, _ = jax.vjp(lambda w, x: self.forward(w, x, a), w, x, has_aux=True)
        leaves, tree = jax.tree.flatten(pullback)
        filed = iter(self._filed(c, a))
        for k, known in zip(_arrays(pullback, (w, x)), self.weight_only):
            leaves[k] = leaves[k] if known else next(filed)
        dy = jnp.where(a.last, c.residuals[-1][a.act_slot], c.cotangents[a.grad_slot])
        return jax.tree.unflatten(tree, leaves), (dy, self._seed())

    def _filed(self, c: Carry, a) -> list:
        """The residuals the chunk's forward filed (in the slot of its input)."""
        return [r[a.act_slot] for r in c.residuals[:-1]]

    def run_backward(self, c: Carry, a, *, weights: bool) -> Carry:
        """The input gradient (sent back; on chunk 0 through the embedding) and, unless the schedule
        splits it off, the weight gradient; split, what W needs of B's work is filed in the act slot."""
        pullback, seed = self._pullback(c, a)
        if weights:
            dw, dx = pullback(seed)
            c = dataclasses.replace(c, stack_grads=add_rows(c.stack_grads, dw, a.local_chunk, self.per_chunk, True))
        elif c.handoff:
            cut, leaves = cut_pullback(pullback, seed)
            dx, handoff = cut.backward(leaves, seed)
            c = dataclasses.replace(c, handoff=tuple(h.at[a.act_slot].set(x) for h, x in zip(c.handoff, handoff)))
        else:
            dx = pullback(seed)[1]
        c = dataclasses.replace(c, outbox=(c.outbox[0], dx))
        return when(a.first, lambda c: self._embed_backward(c, dx, a), c)

    def _handed(self, c: Carry, a) -> list:
        """What the chunk's B handed its W (in the slot of its input)."""
        return [h[a.act_slot] for h in c.handoff]

    def _embed_backward(self, c: Carry, dx, a) -> Carry:
        x, pull = jax.vjp(lambda o: self.embed(o, a), self.op)
        return dataclasses.replace(c, other_grads=_added(c.other_grads, pull(dx.astype(x.dtype))[0]))

    def run_weights(self, c: Carry, a) -> Carry:
        pullback, seed = self._pullback(c, a)
        if c.handoff:
            cut, leaves = cut_pullback(pullback, seed)
            dw = cut.weights(leaves, seed, self._handed(c, a))
        else:
            dw, _ = pullback(seed)
        return dataclasses.replace(c, stack_grads=add_rows(c.stack_grads, dw, a.local_chunk, self.per_chunk, True))


# ------------------------------------------------------------------------------------------ the scan
@dataclasses.dataclass(frozen=True)
class ModelParts:
    """The model cut for a stage: its chunk's layers, chunk 0's embedding, the last chunk's head and loss,
    as functions of the parameters they differentiate (``OwnActions``). ``chunk``: the model's pieces and
    the microbatches (``jaxpar.pipeline.stage.ChunkPrograms``); ``sp``: the stage's rows of the stack's
    parameters; ``op``: the replicated ones."""

    chunk: ChunkPrograms
    sp: object
    op: object

    def _model(self, w, o, j):
        c = self.chunk
        return nnx.merge(c.graphdef, *here((w, o, rows_of(c.sr, j, c.per_chunk), c.orest)))

    def _any_rows(self):
        return rows_of(self.sp, 0, self.chunk.per_chunk)

    def chunk_input(self) -> jax.ShapeDtypeStruct:
        """The shape and dtype of a chunk's input (and output) for one microbatch."""
        b, t = self.chunk.rows
        model = self._model(self._any_rows(), self.op, 0)
        return jax.ShapeDtypeStruct((b, t, model.cfg.embed_dim), model.execution.dtype)

    def residual_split(self) -> list[bool]:
        """``split_residuals`` of the chunk's forward."""
        return split_residuals(self.forward, self._any_rows(), self.chunk_input(), ABSTRACT_ACTION)

    def forward(self, w, x, a):
        model = self._model(w, self.op, a.local_chunk)
        _, positions, index, segments = self.chunk.tokens(model, a.microbatch)
        x = constrain(x, ("batch", "length", "act_embed"))
        stack = getattr(model, self.chunk.stack_name)
        x, aux, stats = model.run_stack(stack, x, positions, index, self.chunk.rows_active(a.local_chunk), segments)
        return (x, aux), stats

    def embed(self, o, a):
        model = self._model(self._any_rows(), o, 0)
        return model.embed(self.chunk.tokens(model, a.microbatch)[0])

    def loss(self, o, x, a):
        ce, z = self.chunk.loss(self._model(self._any_rows(), o, 0).head, x, a.microbatch)
        return ce + z, (ce, z)


def cut_pullback(pullback, seed) -> tuple[WeightCut, list]:
    """``pullback`` (a ``jax.vjp`` pullback) cut into B and W for ``seed`` (``jaxpar.pipeline.wgrad``),
    and the arrays it closes over, which both parts take."""
    leaves, tree = jax.tree.flatten(pullback)
    return WeightCut.of(lambda leaves, seed: jax.tree.unflatten(tree, leaves)(seed), leaves, seed), leaves


def handoff_shapes(forward: Callable, w, x, a) -> list:
    """What B hands W (``cut_pullback``) for one microbatch of ``forward(w, x, a)``; empty where the cut
    saves nothing."""
    clean = []

    def handoff(w, x, a):
        (y, aux), pullback, _ = jax.vjp(lambda w, x: forward(w, x, a), w, x, has_aux=True)
        seed = (jnp.zeros(y.shape, y.dtype), jnp.zeros(aux.shape, aux.dtype))
        cut, leaves = cut_pullback(pullback, seed)
        clean.append(cut.clean)
        return cut.backward(leaves, seed)[1]

    shapes = jax.eval_shape(handoff, w, x, a)
    return shapes if clean[0] else []


def initial_carry(parts: ModelParts, table, weight_only: list[bool]) -> Carry:
    """Zeroed buffers and float32 accumulators; the residual buffers shaped as the forward's kept
    residuals, and (split schedules) the handoff's as what B hands W."""
    x, w = parts.chunk_input(), parts._any_rows()
    kept = lambda w, x, a: kept_vjp(parts.forward, w, x, a, weight_only)
    _, shapes, stats = jax.eval_shape(kept, w, x, ABSTRACT_ACTION)
    buffer = lambda s: jnp.zeros((table.act_slots + 1, *s.shape), s.dtype)
    handoff = handoff_shapes(parts.forward, w, x, ABSTRACT_ACTION) if table.split_backward else []
    return Carry(
        chunk_inputs=act_buffer(table.act_slots, x),
        cotangents=act_buffer(table.grad_slots, x),
        residuals=(*map(buffer, shapes), act_buffer(table.act_slots, x)),
        handoff=tuple(buffer(s) for s in jax.tree.leaves(handoff)),
        stack_grads=zeros_f32(parts.sp),
        other_grads=zeros_f32(parts.op),
        cross_entropy=jnp.zeros((), jnp.float32),
        z_loss=jnp.zeros((), jnp.float32),
        moe_stats=stats_zeros(stats, table.virtual_stages * parts.chunk.per_chunk),
        outbox=(jnp.zeros(x.shape, x.dtype), jnp.zeros(x.shape, x.dtype)),
    )


_I32, _BOOL = jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((), jnp.bool_)
ABSTRACT_ACTION = Action(
    op=_I32, microbatch=_I32, local_chunk=_I32, act_slot=_I32, grad_slot=_I32, first=_BOOL, last=_BOOL
)


def own_action_body(graphdef, stack_name: str, table, per_chunk: int, losses: Callable, active=None):
    """The per-stage program (inside ``shard_map``; ``stage`` and the batch axes manual) where each stage
    runs its own action; the same outputs as ``jaxpar.pipeline.stage.stage_body`` (no dense prefix).
    ``active``: the storage rows that hold a layer (None: all); padding rows are skipped, doing no work."""
    rows, fwd_pairs, bwd_pairs = tick_rows(table)
    last_chunk = table.stages * table.virtual_stages - 1

    def body(sp, op, sr, orest, ids, targets):
        stage = jax.lax.axis_index(AXIS)
        rows_on = stage_active(active, stage, table.stages)
        chunk = ChunkPrograms(graphdef, stack_name, sr, orest, ids, targets, losses, per_chunk, False, rows_on, True)
        parts = ModelParts(chunk, sp, op)
        weight_only = parts.residual_split()
        split, m = table.split_backward, table.microbatches
        actions = OwnActions(parts.forward, parts.embed, parts.loss, sp, op, per_chunk, m, split, weight_only)

        def tick(c: Carry, row: TickRow):
            a = action_of(row, stage, table.stages, last_chunk)
            c = actions.tick(c, a)
            fwd, bwd = send(row.fwd_send, fwd_pairs, c.outbox[0]), send(row.bwd_send, bwd_pairs, c.outbox[1])
            inputs = c.chunk_inputs.at[row.fwd_recv_slot[stage]].set(fwd)  # what arrived, filed
            cotangents = c.cotangents.at[row.bwd_recv_slot[stage]].set(bwd)
            return dataclasses.replace(c, chunk_inputs=inputs, cotangents=cotangents), None

        carry, _ = jax.lax.scan(tick, initial_carry(parts, table, weight_only), jax.tree.map(jnp.asarray, rows))
        psum = lambda x: jax.lax.psum(x, AXIS)
        return (
            carry.stack_grads,
            psum(carry.other_grads),
            psum(carry.cross_entropy),
            psum(carry.z_loss),
            carry.moe_stats,
        )

    return body
