"""Expert parallelism: the experts' MLP over capacity-padded buffers, with tokens exchanged by all-to-all.

The MoE layer gathers each group's tokens (a group is one sequence of the batch) into a buffer
``[B, E, C, D]``: for every expert e, the C tokens of the group routed to it (capacity-padded, so the
shape is static and the buffer works on every backend, CPU included). Outside this function the batch
is split over the mesh axes of ``batch`` (expert among them); inside, expert e's weights live on one
slice of the ``expert`` axis. So the buffer crosses the axis twice:

    dispatch  all_to_all: [B/ep, E, C, D] -> [B, E/ep, C, D]     (split experts, gather groups)
    experts   SwiGLU of each local expert on its ep·C tokens per group
    combine   all_to_all: [B, E/ep, C, D] -> [B/ep, E, C, D]     (the inverse)

Each all-to-all sends (ep−1)/ep of the local buffer, T·k·cf·D·b per device (T local tokens, k choices,
cf capacity factor, b bytes); with the two of the backward pass, 4·(ep−1)/ep·T·k·cf·D·b per MoE layer
per step. ``shard_map`` is manual over ``expert`` only: ``fsdp``/``tensor`` sharding *within* an expert's
weights stays automatic (GSPMD gathers or splits them as for a dense MLP).

Legend: B groups (sequences), E experts, C capacity per expert per group, D width, F expert MLP width.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxpar.rules import LayoutError, active_layout


class ExpertAdapters(NamedTuple):
    """LoRA adapters on the routed experts (``jaxpar.layers.lora``), (A, B) of each adapted weight or
    None: gate_up's A [E, 2, D, r] and B [E, 2, r, F], down's A [E, F, r] and B [E, r, D], one per
    expert and split over the expert axis as the weights are; or, without the leading E, one adapter
    that every expert shares. ``scale``: alpha / rank (a scalar). The adapter's path runs beside the
    weights' in every kernel, never merged into them (in bf16, a merged W + scale·A·B would round the
    adapter's small update away). Each term below is 0 for a weight without an adapter."""

    gate_up_ab: tuple[jax.Array, jax.Array] | None
    down_ab: tuple[jax.Array, jax.Array] | None
    scale: jax.Array

    @property
    def each(self) -> str:
        """The expert letter of the einsums: ``"e"`` for an adapter per expert, ``""`` for a shared one."""
        per_expert = self.gate_up_ab[0].ndim == 4 if self.gate_up_ab else self.down_ab[0].ndim == 3
        return "e" if per_expert else ""

    def specs(self, axis: str) -> ExpertAdapters:
        """``shard_map`` in_specs: split over ``axis`` as the experts' weights, or whole when shared."""
        split = PartitionSpec(axis) if self.each else PartitionSpec()
        pair = lambda ab: None if ab is None else (split, split)  # noqa: E731
        return ExpertAdapters(pair(self.gate_up_ab), pair(self.down_ab), PartitionSpec())

    def _factors(self, ab, dtype):
        return ab[0].astype(dtype), ab[1].astype(dtype), self.scale.astype(dtype)

    def gate_up(self, x: jax.Array, xs: str):
        """The adapter's term of ``einsum(xs, x, gate_up)`` (x's letters ``xs``, the contracted ``d``
        last): ``[..., 2, F]``."""
        if self.gate_up_ab is None:
            return 0
        a, b, scale = self._factors(self.gate_up_ab, x.dtype)
        e, lead = self.each, xs[:-1]
        low = jnp.einsum(f"{xs},{e}kdz->{lead}kz", x, a)
        return jnp.einsum(f"{lead}kz,{e}kzf->{lead}kf", low, b) * scale

    def down(self, act: jax.Array, xs: str, ys: str):
        """The adapter's term of ``einsum(f"{xs},efd->{ys}", act, down)`` (the contracted ``f`` last)."""
        if self.down_ab is None:
            return 0
        a, b, scale = self._factors(self.down_ab, act.dtype)
        e, lead = self.each, xs[:-1]
        return jnp.einsum(f"{lead}z,{e}zd->{ys}", jnp.einsum(f"{xs},{e}fz->{lead}z", act, a), b) * scale

    def grouped_gate_up(self, rows: jax.Array, sizes: jax.Array):
        """The adapter's term for rows [R, D] grouped by expert (``sizes``): [R, 2, F]."""
        if self.gate_up_ab is None:
            return 0
        a, b, scale = self._factors(self.gate_up_ab, rows.dtype)
        if not self.each:
            return jnp.einsum("rkz,kzf->rkf", jnp.einsum("rd,kdz->rkz", rows, a), b) * scale
        e, k, d, z = a.shape
        low = jax.lax.ragged_dot(rows, jnp.einsum("ekdz->edkz", a).reshape(e, d, k * z), sizes).reshape(-1, k, z)
        return jnp.stack([jax.lax.ragged_dot(low[:, i], b[:, i], sizes) for i in range(k)], axis=1) * scale

    def grouped_down(self, act: jax.Array, sizes: jax.Array):
        """The adapter's term for rows [R, F] grouped by expert: [R, D]."""
        if self.down_ab is None:
            return 0
        a, b, scale = self._factors(self.down_ab, act.dtype)
        if not self.each:
            return act @ a @ b * scale
        return jax.lax.ragged_dot(jax.lax.ragged_dot(act, a, sizes), b, sizes) * scale


def expert_mlp(
    buf: jax.Array, gate_up: jax.Array, down: jax.Array, adapters: ExpertAdapters | None = None, /
) -> jax.Array:
    """SwiGLU of every expert on its tokens: buf [B, E, C, D], gate_up [E, D, 2, F], down [E, F, D]; with
    ``adapters``, their terms beside each product."""
    h = jnp.einsum("becd,edkf->beckf", buf, gate_up.astype(buf.dtype))
    if adapters is not None:
        h = h + adapters.gate_up(buf, "becd")
    act = jax.nn.silu(h[..., 0, :]) * h[..., 1, :]
    out = jnp.einsum("becf,efd->becd", act, down.astype(buf.dtype))
    return out if adapters is None else out + adapters.down(act, "becf", "becd")


def expert_axis(rules, mesh_shape, /) -> str | None:
    """The mesh axis that splits the experts, or None when they are not split."""
    axes = [a for a in rules["act_experts"] if mesh_shape[a] > 1]
    if len(axes) > 1:
        raise LayoutError(
            f"rules {rules.name!r}: act_experts is split over {axes}; expert parallelism supports one mesh axis"
        )
    return axes[0] if axes else None


def experts_apply(
    buf: jax.Array, gate_up: jax.Array, down: jax.Array, adapters: ExpertAdapters | None = None, /
) -> jax.Array:
    """``expert_mlp`` under the current layout: plain when the experts are not split, else with the
    dispatch and combine all-to-alls over the expert axis (see the module docstring)."""
    layout = active_layout(buf, gate_up, down)
    axis = None if layout is None else expert_axis(layout[1], layout[0].shape)
    if axis is None:
        return expert_mlp(buf, gate_up, down, adapters)
    mesh = layout[0]
    ep = mesh.shape[axis]
    if buf.shape[1] % ep:
        raise LayoutError(f"expert parallelism over {axis}={ep} needs the experts ({buf.shape[1]}) divisible by {ep}")

    def body(buf, gate_up, down, adapters):  # buf [B/g, E, C, D] (g: batch shards); gate_up [E/ep, D, 2, F]
        local = jax.lax.all_to_all(buf, axis, split_axis=1, concat_axis=0, tiled=True)  # [B·ep/g, E/ep, C, D]
        out = expert_mlp(local, gate_up, down, adapters)
        return jax.lax.all_to_all(out, axis, split_axis=0, concat_axis=1, tiled=True)  # [B/g, E, C, D]

    # Manual over every axis that splits the groups (else the all-to-all's concatenation over a dim
    # that is still automatically split makes GSPMD gather it first); the weights are split over the
    # expert axis only, so their fsdp shards are gathered on entry (FSDP) and tensor stays automatic.
    batch = tuple(layout[1]["batch"])
    if axis not in batch:
        raise LayoutError(f"rules {layout[1].name!r}: the expert axis {axis!r} must also split the batch")
    groups = PartitionSpec(batch)
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(
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
    )(buf, gate_up, down, adapters)


def a2a_bytes_formula(
    *,
    tokens_per_device: int,
    top_k: int,
    capacity_factor: float,
    embed_dim: int,
    ep: int,
    bytes_per_element: int,
    backward: bool = True,
) -> float:
    """Bytes one device sends in the MoE all-to-alls of one layer: 2 forward (+2 backward) of
    (ep−1)/ep · T·k·cf·D·b."""
    one = (ep - 1) / ep * tokens_per_device * top_k * capacity_factor * embed_dim * bytes_per_element
    return (4 if backward else 2) * one
