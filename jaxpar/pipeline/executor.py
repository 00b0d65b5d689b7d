"""The pipeline executor: any schedule table (``jaxpar.pipeline.schedules``) run inside the jitted step.

The step is one program on every device. ``shard_map`` makes ``stage`` manual and leaves every other
mesh axis automatic, so data, fsdp, tensor, expert and sequence work inside a stage as they do without
pipelining. The model's pipelined stack (its stacked ``layers`` axis, split over ``stage`` by the rules)
arrives as each stage's own layers; everything else (embedding, final norm, LM head, a router's
non-trained state) is replicated over ``stage``.

A ``lax.scan`` runs the table's ticks, so compile time does not grow with the number of microbatches.
A tick has up to three sections: F (forward), B (backward: the input gradient, and the weight gradient
too unless the schedule splits it off) and W (weight gradient). A section runs when *any* stage has that
action in the tick, and then on *every* stage; a stage keeps the result only when the action is its own.
The reason: an automatic axis's collective (an FSDP gather, a tensor all-reduce) is one operation over
all stages' groups, so a branch that some stages skip would leave the others waiting for ever (XLA:CPU
hangs in its rendezvous). A section's predicate depends on the tick only, so every device branches alike.
After the sections each stage sends its forward output to the next stage and its input gradient to the
previous one (``ppermute``) and files what arrives in the buffer slot the table names. Only the pairs
whose message is used at that tick send (one ``ppermute`` per distinct pair list, chosen by a switch on
the tick), so the bytes are exactly one activation forward and one gradient back per microbatch and
chunk boundary.

What a stage keeps per microbatch in flight is its chunk's *input* (``acts``, as many slots as the table
needs: O(p) for 1F1B-like schedules, m for GPipe) and the cotangent that came back (``grads``). B and W
recompute the chunk's forward from the input (remat at stage granularity; the model's remat policy still
applies inside), so no residuals outlive a tick. The embedding runs in the F and B of model chunk 0 and
the final norm, LM head and loss in those of the last chunk: on every stage (masked), since they hold
collectives of the automatic axes. Weight gradients accumulate in float32.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar.errors import ConfigError
from jaxpar.rules import constrain

AXIS = "stage"
F, B, W = 1, 2, 3                      # jaxpar.pipeline.schedules.Op


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PipelineResult:
    cross_entropy: jax.Array     # mean over microbatches
    z_loss: jax.Array
    moe: object                  # statistics stacked over the stack's layers, mean over microbatches (or None)
    grads: nnx.State             # mean over microbatches, in the parameters' dtypes


def check_stack(model_cfg, stages: int, virtual: int) -> None:
    """Refuses, naming the fields, a model whose pipelined stack does not split into stages × virtual
    stages equal chunks, or whose layers are not one stack."""
    if getattr(model_cfg, "first_dense_layers", 0):
        raise ConfigError(f"model.first_dense_layers={model_cfg.first_dense_layers}: a stack of dense layers before "
                          f"the MoE layers is not pipelined yet (mesh stage={stages}); set "
                          "model.first_dense_layers=0 or use a mesh without stage")
    layers = getattr(model_cfg, "num_moe_layers", model_cfg.num_layers)
    if layers % (stages * virtual):
        raise ConfigError(f"model.num_layers={model_cfg.num_layers} is not divisible by mesh stage={stages} × "
                          f"pipeline.virtual_stages={virtual} = {stages * virtual}: every model chunk needs the "
                          "same number of layers")


def layer_order(num_layers: int, stages: int, virtual: int) -> np.ndarray:
    """Storage order of the stack's layers for the executor: stage s holds model chunks s, s+p, ... as its
    local chunks 0, 1, ... (``order[k]`` = the model layer at stored row k). The identity when v = 1."""
    per_chunk = num_layers // (stages * virtual)
    return np.array([(j * stages + s) * per_chunk + l
                     for s in range(stages) for j in range(virtual) for l in range(per_chunk)])


def _table_arrays(table) -> dict:
    clamp = lambda a, k: np.where(a < 0, k, a).astype(np.int32)     # -1 -> the trash slot k
    return dict(op=table.op.astype(np.int32), mb=np.maximum(table.mb, 0).astype(np.int32),
                chunk=np.maximum(table.chunk, 0).astype(np.int32),
                act=clamp(table.act_slot, table.act_slots), grad=clamp(table.grad_slot, table.grad_slots),
                frecv=clamp(table.fwd_recv_slot, table.act_slots), brecv=clamp(table.bwd_recv_slot, table.grad_slots),
                any_f=(table.op == F).any(1), any_b=(table.op == B).any(1), any_w=(table.op == W).any(1))


def pipeline_grads(model: nnx.Module, ids: jax.Array, targets: jax.Array, table, /, *, mesh,
                   losses: Callable) -> PipelineResult:
    """Loss parts and gradients of ``model`` over microbatches ``ids``/``targets`` [m, b, T], by
    ``table``; the same as accumulating over the m microbatches on one device.

    ``losses(logits, targets) -> (cross_entropy, z_loss)`` (float32 scalars, means over the microbatch).
    ``mesh``: the layout's mesh, with ``stage`` = ``table.stages``."""
    p, v, m = table.stages, table.virtual_stages, table.microbatches
    in_stack = nnx.PathContains(model.pipeline_stack)
    graphdef, sp, op, sr, orest = nnx.split(model, nnx.All(nnx.Param, in_stack), nnx.Param, in_stack, ...)
    num_layers = jax.tree.leaves(sp)[0].shape[0]
    order = layer_order(num_layers, p, v)
    if v > 1:                                     # interleaved: stage s's chunks side by side
        sp, sr = jax.tree.map(lambda a: jnp.take(a, order, axis=0), (sp, sr))
    body = _stage_body(graphdef, model.pipeline_stack, table, num_layers // (p * v), losses)
    run = jax.shard_map(body, mesh=mesh, axis_names={AXIS}, check_vma=False,
                        in_specs=(P(AXIS), P(), P(AXIS), P(), P(), P()),
                        out_specs=(P(AXIS), P(), P(), P(), P(AXIS)))
    dsp, dop, ce, z, stats = run(sp, op, sr, orest, ids, targets)
    if v > 1:
        inverse = np.argsort(order)
        dsp, stats = jax.tree.map(lambda a: jnp.take(a, inverse, axis=0), (dsp, stats))
    grads = nnx.merge_state(dsp, dop)
    grads = jax.tree.map(lambda g, w: g.astype(w.dtype), grads, nnx.merge_state(sp, op))   # seeded with 1/m
    stats = None if stats is None else jax.tree.map(lambda a: a / m, stats)
    return PipelineResult(ce / m, z / m, stats, grads)


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


def _stage_body(graphdef, stack_name: str, table, per_chunk: int, losses: Callable):
    """The per-stage program (inside ``shard_map``, manual over ``stage``)."""
    p, v, m = table.stages, table.virtual_stages, table.microbatches
    last_chunk, split = p * v - 1, table.split_backward
    xs = _table_arrays(table)
    fwd_sends, xs["send_f"] = send_patterns(table.fwd_recv_slot, -1)
    bwd_sends, xs["send_b"] = send_patterns(table.bwd_recv_slot, +1)
    n = per_chunk

    def body(sp, op, sr, orest, ids, targets):
        s = jax.lax.axis_index(AXIS)

        def forward(sp_c, op_, x_in, k):
            """Chunk ``k["j"]`` from x_in (or microbatch i's embedding on model chunk 0):
            (model, x_out, weighted auxiliary loss, MoE statistics, storage order)."""
            model = nnx.merge(graphdef, *_here((sp_c, op_, _rows(sr, k["j"], n), orest)))
            ids_i, positions, index, order = model.inputs(ids[k["i"]])
            x = constrain(jnp.where(k["first"], model.embed(ids_i), x_in), ("batch", "length", "act_embed"))
            x, aux, stats = model.run_stack(getattr(model, stack_name), x, positions, index)
            return model, x, aux, stats, order

        def objective(sp_c, op_, x_in, k):
            """``forward`` and the loss on the last model chunk:
            ((x_out, objective), (cross_entropy, z_loss, MoE statistics))."""
            model, x, aux, stats, order = forward(sp_c, op_, x_in, k)
            targets_i = targets[k["i"]] if order is None else targets[k["i"]][:, order]
            ce, z = losses(model.head(x), targets_i)
            ce, z = jnp.where(k["last"], ce, 0.0), jnp.where(k["last"], z, 0.0)
            return (x, ce + z + aux), (ce, z, stats)

        def f_section(c, k):
            _, x, _, stats, _ = forward(_rows(sp, k["j"], n), op, c["acts"][k["act"]], k)
            if stats is not None:
                c = c | {"stats": _add_rows(c["stats"], stats, k["j"], n, k["op"] == F)}
            return c, x

        def b_section(c, k):
            x_in, dy = c["acts"][k["act"]], _cotangent(c, k)
            keep = k["op"] == B
            if split:                             # input gradient only: the weights are constants here
                _, vjp, (ce, z, _) = jax.vjp(lambda x: objective(_rows(sp, k["j"], n), op, x, k), x_in, has_aux=True)
                (dx,) = vjp((dy, jnp.float32(1 / m)))
            else:
                _, vjp, (ce, z, _) = jax.vjp(lambda w, o, x: objective(w, o, x, k), _rows(sp, k["j"], n), op, x_in,
                                             has_aux=True)
                dw, do, dx = vjp((dy, jnp.float32(1 / m)))
                c = c | {"dsp": _add_rows(c["dsp"], dw, k["j"], n, keep), "dop": _add(c["dop"], do, keep)}
            return c | {"ce": c["ce"] + jnp.where(keep, ce, 0.0), "z": c["z"] + jnp.where(keep, z, 0.0)}, dx

        def w_section(c, k):
            x_in, dy = c["acts"][k["act"]], _cotangent(c, k)
            _, vjp, _ = jax.vjp(lambda w, o: objective(w, o, x_in, k), _rows(sp, k["j"], n), op, has_aux=True)
            dw, do = vjp((dy, jnp.float32(1 / m)))
            keep = k["op"] == W
            return c | {"dsp": _add_rows(c["dsp"], dw, k["j"], n, keep), "dop": _add(c["dop"], do, keep)}, None

        def _cotangent(c, k):             # the last chunk's output goes nowhere: its loss is the seed
            return jnp.where(k["last"], jnp.zeros_like(c["grads"][0]), c["grads"][k["grad"]])

        def tick(c, row):
            k = {name: row[name][s] for name in ("op", "mb", "chunk", "act", "grad")}
            g = k["chunk"] * p + s
            k |= {"i": k["mb"], "j": k["chunk"], "first": g == 0, "last": g == last_chunk}
            zero = jnp.zeros_like(c["grads"][0])
            c, send_f = _section(row["any_f"], f_section, c, k, zero)
            c, send_b = _section(row["any_b"], b_section, c, k, zero)
            if split:
                c, _ = _section(row["any_w"], w_section, c, k, None)
            fwd, bwd = _send(row["send_f"], fwd_sends, send_f), _send(row["send_b"], bwd_sends, send_b)
            return c | {"acts": c["acts"].at[row["frecv"][s]].set(fwd),
                        "grads": c["grads"].at[row["brecv"][s]].set(bwd)}, None

        carry = _initial_carry(graphdef, stack_name, sp, op, sr, orest, ids, table, n)
        carry, _ = jax.lax.scan(tick, carry, {k: jnp.asarray(a) for k, a in xs.items()})
        psum = lambda x: jax.lax.psum(x, AXIS)
        return carry["dsp"], psum(carry["dop"]), psum(carry["ce"]), psum(carry["z"]), carry["stats"]
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


def _section(run, fn, c, k, zero):
    """``fn(c, k)`` on every stage when ``run`` (the same on all devices), else ``(c, zero)``."""
    if zero is None:
        return jax.lax.cond(run, lambda c: (fn(c, k)[0], None), lambda c: (c, None), c)
    return jax.lax.cond(run, lambda c: fn(c, k), lambda c: (c, zero), c)


def _initial_carry(graphdef, stack_name, sp, op, sr, orest, ids, table, n: int) -> dict:
    """Zeroed buffers (one trash slot at the end for "nothing") and float32 accumulators."""
    parts = (_rows(sp, 0, n), op, _rows(sr, 0, n), orest)
    cfg = nnx.merge(graphdef, *_here(parts)).cfg
    b, t = ids.shape[1:]
    x = jax.ShapeDtypeStruct((b, t, cfg.embed_dim), cfg.dtype)

    def stack_stats(parts):
        model = nnx.merge(graphdef, *_here(parts))
        index = jnp.zeros((b, t), jnp.int32)
        return model.run_stack(getattr(model, stack_name), jnp.zeros(x.shape, x.dtype), index, index)[2]
    stats = jax.eval_shape(stack_stats, parts)
    stats = None if stats is None else jax.tree.map(
        lambda a: jnp.zeros((table.virtual_stages * n, *a.shape[1:]), jnp.float32), stats)
    buffer = lambda k: constrain(jnp.zeros((k + 1, *x.shape), x.dtype), (None, "batch", "length", "act_embed"))
    return {"acts": buffer(table.act_slots), "grads": buffer(table.grad_slots), "dsp": _zeros_f32(sp),
            "dop": _zeros_f32(op), "ce": jnp.zeros((), jnp.float32), "z": jnp.zeros((), jnp.float32),
            "stats": stats}
