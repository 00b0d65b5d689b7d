"""The pipeline executor: any schedule table (``jaxpar.pipeline.schedules``) run inside the jitted step.

The step is one program on every device. ``shard_map`` makes ``stage`` manual and leaves every other
mesh axis automatic, so data, fsdp, tensor, expert and sequence work inside a stage as they do without
pipelining. The model's pipelined stack (its stacked ``layers`` axis, split over ``stage`` by the rules)
arrives as each stage's own layers; everything else (embedding, final norm, LM head, a router's
non-trained state) is replicated over ``stage``.

A ``lax.scan`` runs the table's ticks, so compile time does not grow with the number of microbatches.
A tick runs one section on *every* stage, chosen by the tick alone (``tick_sections``): forward only
when the tick has F actions and no backward one; otherwise one ``vjp`` of each stage's chunk from its
own input, from which an F stage keeps the output, a B stage the input gradient (and the weight gradient
unless the schedule splits it off) and a W stage the weight gradient; the rest is masked away. (Split
schedules run the input-gradient-only vjp in ticks without W.) So a tick costs its most expensive action,
never the sum of F and B. The reason for one section everywhere: an automatic axis's collective (an FSDP
gather, a tensor all-reduce) is one operation over all stages' groups, so a branch that some stages skip
would leave the others waiting for ever (XLA:CPU hangs in its rendezvous).
After the sections each stage sends its forward output to the next stage and its input gradient to the
previous one (``ppermute``) and files what arrives in the buffer slot the table names. Only the pairs
whose message is used at that tick send (one ``ppermute`` per distinct pair list, chosen by a switch on
the tick), so the bytes are exactly one activation forward and one gradient back per microbatch and
chunk boundary.

What a stage keeps per microbatch in flight is its chunk's *input* (``acts``, as many slots as the table
needs: O(p) for 1F1B-like schedules, m for GPipe) and the cotangent that came back (``grads``). B and W
recompute the chunk's forward from the input (remat at stage granularity; the model's remat policy still
applies inside), so no residuals outlive a tick; that recomputed forward is also the F stages' forward in
a mixed tick. The embedding runs with model chunk 0 and the final norm, LM head and loss with the last
chunk: in every vjp section on every stage (masked), since they hold collectives of the automatic axes.
Weight gradients accumulate in float32. Layers before the pipelined stack (DeepSeek's dense prefix) run
before the schedule with the embedding, each stage taking m/p of the microbatches (``_prologue``); model
chunk 0 starts from their output, and its input gradients flow back through them after the schedule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar.errors import ConfigError
from jaxpar.model_api import LanguageModel
from jaxpar.pipeline.ops import Op
from jaxpar.pipeline.timing import executor_bubble_fraction, tick_sections  # noqa: F401  (re-exported)
from jaxpar.rules import constrain

AXIS = "stage"
F, B, W = Op.F, Op.B, Op.W


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PipelineResult:
    cross_entropy: jax.Array  # mean over microbatches
    z_loss: jax.Array
    moe: object  # statistics stacked over the stack's layers, mean over microbatches (or None)
    grads: nnx.State  # mean over microbatches, in the parameters' dtypes


def check_stack(model_cfg, stages: int, virtual: int, microbatches: int | None = None) -> None:
    """Refuses, naming the fields, a model whose pipelined stack does not split into stages × virtual
    stages equal chunks, or (with a dense prefix) whose microbatches do not split over the stages."""
    prefix = model_cfg.first_dense_layers
    layers = model_cfg.num_layers - prefix
    if layers % (stages * virtual):
        field = "model.num_layers - first_dense_layers" if prefix else "model.num_layers"
        raise ConfigError(
            f"{field}={layers} is not divisible by mesh stage={stages} × "
            f"pipeline.virtual_stages={virtual} = {stages * virtual}: every model chunk needs the "
            "same number of layers"
        )
    if prefix and microbatches is not None and microbatches % stages:
        raise ConfigError(
            f"model.first_dense_layers={prefix}: the dense prefix runs before the schedule with the "
            f"microbatches split over the stages, so pipeline.microbatches={microbatches} must be "
            f"divisible by mesh stage={stages}"
        )


def layer_order(num_layers: int, stages: int, virtual: int) -> np.ndarray:
    """Storage order of the stack's layers for the executor: stage s holds model chunks s, s+p, ... as its
    local chunks 0, 1, ... (``order[k]`` = the model layer at stored row k). The identity when v = 1."""
    per_chunk = num_layers // (stages * virtual)
    return np.array(
        [(j * stages + s) * per_chunk + l for s in range(stages) for j in range(virtual) for l in range(per_chunk)]
    )


def _table_arrays(table) -> dict:
    clamp = lambda a, k: np.where(a < 0, k, a).astype(np.int32)  # -1 -> the trash slot k
    return dict(
        op=table.op.astype(np.int32),
        mb=np.maximum(table.mb, 0).astype(np.int32),
        chunk=np.maximum(table.chunk, 0).astype(np.int32),
        act=clamp(table.act_slot, table.act_slots),
        grad=clamp(table.grad_slot, table.grad_slots),
        frecv=clamp(table.fwd_recv_slot, table.act_slots),
        brecv=clamp(table.bwd_recv_slot, table.grad_slots),
        section=tick_sections(table),
    )


def pipeline_grads(
    model: LanguageModel, ids: jax.Array, targets: jax.Array, table, /, *, mesh, losses: Callable
) -> PipelineResult:
    """Loss parts and gradients of ``model`` over microbatches ``ids``/``targets`` [m, b, T], by
    ``table``; the same as accumulating over the m microbatches on one device.

    ``losses(logits, targets) -> (cross_entropy, z_loss)`` (float32 scalars, means over the microbatch).
    ``mesh``: the layout's mesh, with ``stage`` = ``table.stages``."""
    p, v, m = table.stages, table.virtual_stages, table.microbatches
    in_stack = nnx.PathContains(model.pipeline_stack)
    graphdef, sp, op, sr, orest = nnx.split(model, nnx.All(nnx.Param, in_stack), nnx.Param, in_stack, ...)
    num_layers = jax.tree.leaves(sp)[0].shape[0]
    order = layer_order(num_layers, p, v)
    if v > 1:  # interleaved: stage s's chunks side by side
        sp, sr = jax.tree.map(lambda a: jnp.take(a, order, axis=0), (sp, sr))
    stored = model.storage_order(ids.shape[-1])
    if stored is not None:  # zig-zag: tokens and targets in storage order, once, outside the stages
        ids, targets = ids[..., stored], targets[..., stored]
    prefixed = model.prefix_stack is not None
    body = _stage_body(graphdef, model.pipeline_stack, table, num_layers // (p * v), losses, prefixed)
    specs = (P(AXIS), P(), P(AXIS), P(), P(), P())
    run = jax.shard_map(
        body,
        mesh=mesh,
        axis_names={AXIS},
        check_vma=False,
        in_specs=specs + (P(),) * prefixed,
        out_specs=(P(AXIS), P(), P(), P(), P(AXIS)) + (P(AXIS),) * prefixed,
    )
    if prefixed:  # the embedding and the dense prefix, before the schedule
        start, prologue_vjp = jax.vjp(lambda o: _prologue(graphdef, sp, o, sr, orest, ids, mesh=mesh), op)
        dsp, dop, ce, z, stats, dstart = run(sp, op, sr, orest, ids, targets, start)
        dop = jax.tree.map(jnp.add, dop, prologue_vjp(dstart[0])[0])
    else:
        dsp, dop, ce, z, stats = run(sp, op, sr, orest, ids, targets)
    if v > 1:
        inverse = np.argsort(order)
        dsp, stats = jax.tree.map(lambda a: jnp.take(a, inverse, axis=0), (dsp, stats))
    grads = nnx.merge_state(dsp, dop)
    grads = jax.tree.map(lambda g, w: g.astype(w.dtype), grads, nnx.merge_state(sp, op))  # seeded with 1/m
    stats = None if stats is None else jax.tree.map(lambda a: a / m, stats)
    return PipelineResult(ce / m, z / m, stats, grads)


def _prologue(graphdef, sp, op, sr, orest, ids, *, mesh):
    """What enters model chunk 0 for every microbatch, ids [m, b, T] -> [m, b, T, D]: the embedding and
    the layers before the pipelined stack. Each stage runs m/p of the microbatches (the stage axis is a
    batch axis here); the result is gathered for stage 0."""

    def local(sp, op, sr, orest, ids):
        def one(ids_i):
            model = nnx.merge(graphdef, *_here((sp, op, sr, orest)))
            ids_i, positions, index, _ = model.inputs(ids_i, stored=True)
            return model.prefix(model.embed(ids_i), positions, index)

        return jax.lax.map(one, ids)

    return jax.shard_map(
        local,
        mesh=mesh,
        axis_names={AXIS},
        check_vma=False,
        in_specs=(P(AXIS), P(), P(AXIS), P(), P(AXIS)),
        out_specs=P(AXIS),
    )(sp, op, sr, orest, ids)


def _here(tree):
    """The same state with its Variables rebuilt at the current trace level (nnx refuses Variables made
    outside a transform it runs, e.g. its scan inside our vjp)."""
    return jax.tree.map(lambda a: a, tree)


def _rows(tree, j, n: int):
    """Rows [j·n, (j+1)·n) of every leaf (local chunk j of a stage's layers)."""
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, j * n, n, axis=0), tree)


def _add_rows(acc, tree, j, n: int, keep):
    """acc[j·n:(j+1)·n] += tree where ``keep`` (float32 accumulators)."""

    def add(a, g):
        part = jax.lax.dynamic_slice_in_dim(a, j * n, n, axis=0) + jnp.where(keep, g.astype(a.dtype), 0)
        return jax.lax.dynamic_update_slice_in_dim(a, part, j * n, axis=0)

    return jax.tree.map(add, acc, tree)


def _add(acc, tree, keep):
    return jax.tree.map(lambda a, g: a + jnp.where(keep, g.astype(a.dtype), 0), acc, tree)


def _zeros_f32(tree):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)


def _chunk_programs(graphdef, stack_name: str, sr, orest, ids, targets, losses: Callable, n: int, prefixed: bool):
    """(forward, objective) of one model chunk on this stage, for the action ``k`` (a dict of the tick's
    microbatch i, local chunk j and whether the chunk is the model's first or last)."""

    def forward(sp_c, op_, x_in, k):
        """Chunk ``k["j"]`` from x_in (or microbatch i's embedding on model chunk 0):
        (model, x_out, weighted auxiliary loss, MoE statistics); ids and targets are in storage order."""
        model = nnx.merge(graphdef, *_here((sp_c, op_, _rows(sr, k["j"], n), orest)))
        ids_i, positions, index, _ = model.inputs(ids[k["i"]], stored=True)
        x = x_in if prefixed else jnp.where(k["first"], model.embed(ids_i), x_in)
        x = constrain(x, ("batch", "length", "act_embed"))
        x, aux, stats = model.run_stack(getattr(model, stack_name), x, positions, index)
        return model, x, aux, stats

    def objective(sp_c, op_, x_in, k):
        """``forward`` and the loss on the last model chunk:
        ((x_out, objective), (cross_entropy, z_loss, MoE statistics))."""
        model, x, aux, stats = forward(sp_c, op_, x_in, k)
        ce, z = losses(model.head(x), targets[k["i"]])
        ce, z = jnp.where(k["last"], ce, 0.0), jnp.where(k["last"], z, 0.0)
        return (x, ce + z + aux), (ce, z, stats)

    return forward, objective


def _stage_body(graphdef, stack_name: str, table, per_chunk: int, losses: Callable, prefixed: bool):
    """The per-stage program (inside ``shard_map``, manual over ``stage``). ``prefixed``: model chunk 0
    starts from ``start`` [m, b, T, D] (``_prologue``), and the program also returns its gradient."""
    p, v, m = table.stages, table.virtual_stages, table.microbatches
    last_chunk, split = p * v - 1, table.split_backward
    xs = _table_arrays(table)
    fwd_sends, xs["send_f"] = send_patterns(table.fwd_recv_slot, -1)
    bwd_sends, xs["send_b"] = send_patterns(table.bwd_recv_slot, +1)
    n = per_chunk

    def body(sp, op, sr, orest, ids, targets, start=None):
        s = jax.lax.axis_index(AXIS)

        def chunk_input(c, k):
            x = c["acts"][k["act"]]
            return jnp.where(k["first"], start[k["i"]], x) if prefixed else x

        forward, objective = _chunk_programs(graphdef, stack_name, sr, orest, ids, targets, losses, n, prefixed)

        def f_section(c, k):
            _, x, _, stats = forward(_rows(sp, k["j"], n), op, chunk_input(c, k), k)
            return _kept_stats(c, k, stats), x, jnp.zeros_like(x)

        def vjp_section(c, k, weights: bool):
            """Every stage's chunk forward and backward from its own input: F keeps the output, B the input
            gradient (and the weight gradient unless the schedule splits it off), W the weight gradient."""
            x_in, dy, w = chunk_input(c, k), _cotangent(c, k), _rows(sp, k["j"], n)
            if weights:
                (x, _), vjp, (ce, z, stats) = jax.vjp(lambda w, o, x: objective(w, o, x, k), w, op, x_in, has_aux=True)
                dw, do, dx = vjp((dy, jnp.float32(1 / m)))
                keep = k["op"] == (W if split else B)
                c = c | {"dsp": _add_rows(c["dsp"], dw, k["j"], n, keep), "dop": _add(c["dop"], do, keep)}
            else:  # input gradients only: the weights are constants here
                (x, _), vjp, (ce, z, stats) = jax.vjp(lambda x: objective(w, op, x, k), x_in, has_aux=True)
                (dx,) = vjp((dy, jnp.float32(1 / m)))
            keep = k["op"] == B
            if prefixed:
                c = c | {"dstart": c["dstart"].at[k["i"]].add(jnp.where(keep & k["first"], dx, 0))}
            c = c | {"ce": c["ce"] + jnp.where(keep, ce, 0.0), "z": c["z"] + jnp.where(keep, z, 0.0)}
            return _kept_stats(c, k, stats), x, dx

        def _kept_stats(c, k, stats):  # MoE statistics count at the microbatch's forward
            if stats is None:
                return c
            return c | {"stats": _add_rows(c["stats"], stats, k["j"], n, k["op"] == F)}

        def _cotangent(c, k):  # the last chunk's output goes nowhere: its loss is the seed
            return jnp.where(k["last"], jnp.zeros_like(c["grads"][0]), c["grads"][k["grad"]])

        def idle(c, k):
            zero = jnp.zeros_like(c["grads"][0])
            return c, zero, zero

        sections = (
            [idle, f_section] + [lambda c, k: vjp_section(c, k, False)] * split + [lambda c, k: vjp_section(c, k, True)]
        )

        def tick(c, row):
            k = {name: row[name][s] for name in ("op", "mb", "chunk", "act", "grad")}
            g = k["chunk"] * p + s
            k |= {"i": k["mb"], "j": k["chunk"], "first": g == 0, "last": g == last_chunk}
            c, send_f, send_b = jax.lax.switch(row["section"], sections, c, k)
            fwd, bwd = _send(row["send_f"], fwd_sends, send_f), _send(row["send_b"], bwd_sends, send_b)
            return c | {
                "acts": c["acts"].at[row["frecv"][s]].set(fwd),
                "grads": c["grads"].at[row["brecv"][s]].set(bwd),
            }, None

        carry = _initial_carry(graphdef, stack_name, sp, op, sr, orest, ids, table, n)
        if prefixed:
            carry["dstart"] = jnp.zeros_like(start)
        carry, _ = jax.lax.scan(tick, carry, {k: jnp.asarray(a) for k, a in xs.items()})
        psum = lambda x: jax.lax.psum(x, AXIS)
        out = carry["dsp"], psum(carry["dop"]), psum(carry["ce"]), psum(carry["z"]), carry["stats"]
        return out + ((carry["dstart"][None],) if prefixed else ())

    return body


def send_patterns(recv_slot: np.ndarray, source: int) -> tuple[list[tuple], np.ndarray]:
    """The (sender, receiver) pairs whose send is used, per tick: stage r receives from r + ``source``
    (mod p) when its recv slot is set. Returns the distinct non-empty pair lists and, per tick, 1 + the
    index of its list (0: nobody sends). Sending only these pairs moves exactly what the schedule needs:
    per microbatch, one activation forward and one gradient back over each chunk boundary."""
    ticks, p = recv_slot.shape
    per_tick = [tuple(((r + source) % p, r) for r in range(p) if recv_slot[t, r] >= 0) for t in range(ticks)]
    patterns = sorted({pairs for pairs in per_tick if pairs})
    return patterns, np.array([patterns.index(pairs) + 1 if pairs else 0 for pairs in per_tick], np.int32)


def _send(which, patterns: list[tuple], x):
    """``ppermute`` of x over the pairs ``patterns[which - 1]`` (zeros when ``which`` is 0); ``which``
    depends on the tick only, so every device takes the same branch."""
    branches = [jnp.zeros_like] + [lambda x, pairs=pairs: jax.lax.ppermute(x, AXIS, list(pairs)) for pairs in patterns]
    return jax.lax.switch(which, branches, x)


def _initial_carry(graphdef, stack_name, sp, op, sr, orest, ids, table, n: int) -> dict:
    """Zeroed buffers (one trash slot at the end for "nothing") and float32 accumulators."""
    parts = (_rows(sp, 0, n), op, _rows(sr, 0, n), orest)
    model = nnx.merge(graphdef, *_here(parts))
    b, t = ids.shape[1:]
    x = jax.ShapeDtypeStruct((b, t, model.cfg.embed_dim), model.execution.dtype)

    def stack_stats(parts):
        model = nnx.merge(graphdef, *_here(parts))
        index = jnp.zeros((b, t), jnp.int32)
        return model.run_stack(getattr(model, stack_name), jnp.zeros(x.shape, x.dtype), index, index)[2]

    stats = jax.eval_shape(stack_stats, parts)
    stats = (
        None
        if stats is None
        else jax.tree.map(lambda a: jnp.zeros((table.virtual_stages * n, *a.shape[1:]), jnp.float32), stats)
    )
    buffer = lambda k: constrain(jnp.zeros((k + 1, *x.shape), x.dtype), (None, "batch", "length", "act_embed"))
    return {
        "acts": buffer(table.act_slots),
        "grads": buffer(table.grad_slots),
        "dsp": _zeros_f32(sp),
        "dop": _zeros_f32(op),
        "ce": jnp.zeros((), jnp.float32),
        "z": jnp.zeros((), jnp.float32),
        "stats": stats,
    }
