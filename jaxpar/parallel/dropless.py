"""Dropless experts: every assignment runs, grouped by expert through ``jax.lax.ragged_dot``; with the
experts split over a mesh axis, the assignments travel to their expert's device and back.

One device (or experts not split): sort the N·k assignments by expert, run the two grouped matmuls of
the SwiGLU with the per-expert counts as group sizes, unsort.

Split over ``expert`` (size ep, E_l = E/ep experts per device), per device of the batch axes:

    sort       the local a = N_l·k assignments by expert; slice j (experts j·E_l … (j+1)·E_l − 1)
               goes to device j, so the send sizes are the per-device sums of the expert counts
    exchange   ragged all-to-all of the rows; the per-expert counts travel by a small all-to-all
    group      the received rows come ordered (source, local expert): a stable sort by local expert
               makes them ragged_dot's groups
    experts    SwiGLU by two ragged_dots over the local experts
    return     the inverse exchange, then the inverse of the first sort

Static shapes: a device may receive every assignment of every device (all routed to its experts),
so the receive buffer holds ep·a rows — the memory price of never dropping; rows past the received
count are zero and stay out of every group.

The exchange is ``jax.lax.ragged_all_to_all`` where the backend has it (GPU, TPU). XLA:CPU does not, so
there ``padded_ragged_all_to_all`` does the same with a dense all-to-all of worst-case slices: equal
results, ep× the bytes. On CPU, expert parallelism at scale is the capacity path
(``jaxpar.parallel.moe``); this one is for correctness there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxpar.parallel.moe import ExpertAdapters, expert_axis
from jaxpar.rules import LayoutError, active_layout

EXCHANGES = ("auto", "ragged", "padded")


def padded_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """``jax.lax.ragged_all_to_all`` (one slice per device) from a dense all-to-all: each slice is
    padded to the operand's length, exchanged, and scattered at its offset on the receiver."""
    n, rest = operand.shape[0], operand.shape[1:]
    ep = send_sizes.shape[0]
    t = jnp.arange(n)
    live = t[None, :] < send_sizes[:, None]  # [ep, n]
    rows = operand[jnp.clip(input_offsets[:, None] + t, 0, n - 1)]  # [ep, n, ...]
    packed = jnp.where(live.reshape(ep, n, *(1,) * len(rest)), rows, 0)
    got = jax.lax.all_to_all(packed, axis_name, 0, 0, tiled=True)  # [ep(source), n, ...]
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where each source's go
    dest = jnp.where(t[None, :] < recv_sizes[:, None], at[:, None] + t, output.shape[0])  # past end: dropped
    return output.at[dest.reshape(-1)].set(got.reshape(ep * n, *rest), mode="drop")


def ragged_exchange_available(mesh) -> bool:
    """Whether the mesh's backend runs ``ragged_all_to_all`` (GPU and TPU do, XLA:CPU does not). An
    abstract mesh (inside the pipeline's ``shard_map``) runs on the default backend."""
    concrete = isinstance(mesh, jax.sharding.Mesh)
    return (mesh.devices.flat[0].platform if concrete else jax.default_backend()) != "cpu"


def grouped_swiglu(
    rows: jax.Array, sizes: jax.Array, gate_up: jax.Array, down: jax.Array, adapters: ExpertAdapters | None = None
) -> jax.Array:
    """rows [R, D] sorted by expert, sizes [E] (sum ≤ R) -> [R, D]; gate_up [E, D, 2, F], down [E, F, D];
    ``adapters``: their terms beside each product. Rows past sum(sizes) come out zero. The weights are
    cast to the rows' dtype here, inside the kernel."""
    e, d, _, f = gate_up.shape
    h = jax.lax.ragged_dot(rows, gate_up.reshape(e, d, 2 * f).astype(rows.dtype), sizes).reshape(-1, 2, f)
    if adapters is not None:
        h = h + adapters.grouped_gate_up(rows, sizes)
    act = jax.nn.silu(h[:, 0]) * h[:, 1]
    out = jax.lax.ragged_dot(act, down.astype(rows.dtype), sizes)
    return out if adapters is None else out + adapters.grouped_down(act, sizes)


def _sort_by_expert(ids: jax.Array, num_experts: int):
    order = jnp.argsort(ids, stable=True)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
    return order, inverse, jnp.bincount(ids, length=num_experts).astype(jnp.int32)


def _local(x: jax.Array, idx: jax.Array, gate_up: jax.Array, down: jax.Array, adapters=None) -> jax.Array:
    """x [B, T, D], idx [B, T, k] -> [B, T, k, D]: each assignment through its expert, one device."""
    b, t, d = x.shape
    k = idx.shape[-1]
    order, inverse, sizes = _sort_by_expert(idx.reshape(-1), gate_up.shape[0])
    out = grouped_swiglu(x.reshape(b * t, d)[order // k], sizes, gate_up, down, adapters)
    return out[inverse].reshape(b, t, k, d)


def _exclusive_cumsum(v: jax.Array) -> jax.Array:
    return jnp.cumsum(v) - v


def _expert_parallel(x, idx, gate_up, down, adapters, *, axis: str, ep: int, exchange):
    """Per-device body (see the module docstring); gate_up, down hold the E_l local experts."""
    b, t, d = x.shape
    k, e_l = idx.shape[-1], gate_up.shape[0]
    a = b * t * k
    order, inverse, sizes = _sort_by_expert(idx.reshape(-1), e_l * ep)
    rows = x.reshape(b * t, d)[order // k]  # [a, D] by expert
    send = sizes.reshape(ep, e_l).sum(1)  # rows to each device
    send_at = _exclusive_cumsum(send)
    counts = jax.lax.all_to_all(sizes.reshape(ep, e_l), axis, 0, 0, tiled=True)  # [source, E_l]
    recv = counts.sum(1)
    recv_at = _exclusive_cumsum(recv)  # where each source's land
    land_at = jax.lax.all_to_all(recv_at, axis, 0, 0, tiled=True)  # where mine land there
    came_from = jax.lax.all_to_all(send_at, axis, 0, 0, tiled=True)  # where theirs came from
    got = exchange(rows, jnp.zeros((ep * a, d), rows.dtype), send_at, send, land_at, recv, axis_name=axis)
    # received rows are ordered (source, local expert): label each, then group by local expert
    label = jnp.repeat(jnp.tile(jnp.arange(e_l), ep), counts.reshape(-1), total_repeat_length=ep * a)
    label = jnp.where(jnp.arange(ep * a) < recv.sum(), label, e_l)  # padding sorts last
    local_order, local_inverse, _ = _sort_by_expert(label, e_l + 1)
    out = grouped_swiglu(got[local_order], counts.sum(0), gate_up, down, adapters)[local_inverse]
    back = exchange(out, jnp.zeros_like(rows), recv_at, recv, came_from, send, axis_name=axis)
    return back[inverse].reshape(b, t, k, d)


def dropless_apply(
    x: jax.Array,
    idx: jax.Array,
    gate_up: jax.Array,
    down: jax.Array,
    adapters: ExpertAdapters | None = None,
    /,
    *,
    exchange: str = "auto",
) -> jax.Array:
    """x [B, T, D], idx [B, T, k] expert ids, gate_up [E, D, 2, F], down [E, F, D] -> [B, T, k, D], each
    assignment's expert output (unweighted), under the current layout; ``adapters``: LoRA on the
    experts. ``exchange``: auto (ragged all-to-all where the backend has it, padded elsewhere), ragged,
    or padded."""
    if exchange not in EXCHANGES:
        raise LayoutError(f"exchange={exchange!r} is not one of {EXCHANGES}")
    layout = active_layout(x, gate_up, down)
    axis = None if layout is None else expert_axis(layout[1], layout[0].shape)
    if axis is None:
        return _local(x, idx, gate_up, down, adapters)
    mesh, rules = layout
    ep = mesh.shape[axis]
    if gate_up.shape[0] % ep:
        raise LayoutError(
            f"expert parallelism over {axis}={ep} needs the experts ({gate_up.shape[0]}) divisible by {ep}"
        )
    batch = tuple(rules["batch"])
    if axis not in batch:
        raise LayoutError(f"rules {rules.name!r}: the expert axis {axis!r} must also split the batch")
    if exchange == "auto":
        exchange = "ragged" if ragged_exchange_available(mesh) else "padded"
    fn = jax.lax.ragged_all_to_all if exchange == "ragged" else padded_ragged_all_to_all

    def body(x, idx, gate_up, down, adapters):
        return _expert_parallel(x, idx, gate_up, down, adapters, axis=axis, ep=ep, exchange=fn)

    groups = PartitionSpec(batch)
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(
            groups,
            groups,
            PartitionSpec(axis),
            PartitionSpec(axis),
            PartitionSpec() if adapters is None else adapters.specs(axis),
        ),
        out_specs=groups,
        axis_names=frozenset(batch),
        # Unchecked: the weights enter as stored and are cast to the compute dtype inside, and with vma
        # checking JAX reduces their cotangents over the other batch axes inside the map, after that cast:
        # in bf16, which XLA:CPU aborts on ("Invalid binary instruction opcode copy") and which would sum
        # gradients in bf16. Unchecked, the reduction happens where they enter, in the parameter dtype.
        check_vma=False,
    )(x, idx, gate_up, down, adapters)
