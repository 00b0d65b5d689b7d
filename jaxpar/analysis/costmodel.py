"""The physical minimum of what a layout sends, per mesh-axis group, and a roofline step time.

Keys are mesh-axis groups: ``"fsdp"``, or ``"data+expert"`` when one collective spans both (the axes
in mesh order), as ``jaxpar.analysis`` labels the collectives it reads from the compiled program.
Bytes are what one device sends in one training step, with ring algorithms (all-reduce 2(n−1)/n of
the buffer, all-gather and reduce-scatter (n−1)/n of the full buffer, all-to-all (n−1)/n).

Weights and gradients, per parameter p with shard axes S (those of size > 1), token axes A (the axes
that split the batch or the positions) and E (the axis that holds whole experts, never gathered):
    G = (S ∩ A) − E    FSDP-style: all-gathered forward and again backward, gradient reduce-scattered:
                       (n−1)/n · (2·b_w + b_g) · |p| / |S − G|
    R = A − S − E(p)   gradient all-reduced over the token axes that do not shard p:
                       2(n−1)/n · b_g · |p| / |S|
Activations (b_a: compute dtype bytes; T_g = B·L / |A| tokens per device group):
    tensor    per layer 2 all-reduces forward, 2 backward of T_g·D, plus the embedding's and the LM
              head's input: (4·layers + 2) · 2(t−1)/t · T_g·D·b_a (sequence parallelism turns each into
              an all-gather + reduce-scatter pair of the same volume)
    sequence  ring: each device receives the other (n−1)/n of K and V per layer forward, twice that
              backward: 3 · (n−1)/n · 2·(B/|batch|)·L·H_kv/t·D_h·b_a per layer (GSPMD gather: 2×;
              Ulysses: 4 all-to-alls of the local q, k, v, o forward and backward)
    expert    dispatch and combine forward and backward: 4·(e−1)/e · T·k·cf·D·b_a per MoE layer
              (T tokens per device; cf the effective capacity factor; dropless: cf = 1)
Remat recomputation, optimizer work and scalar reductions are not part of the minimum: a measured ratio
above 1 names what the configuration adds (with full remat: 6 tensor all-reduces per layer, not 4).
"""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import numpy as np

from jaxpar.mesh import AXES as AXIS_ORDER      # outermost (slowest links) to innermost


def group_key(axes) -> str:
    return "+".join(a for a in AXIS_ORDER if a in set(axes))


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def weight_bytes(report, mesh: dict, token_axes: set[str], *, grad_bytes: int = 4) -> dict[str, float]:
    """The weight and gradient traffic per axis group (see the module docstring); ``report`` is a
    ``jaxpar.shardings.ShardingReport`` of the model under the layout."""
    out: dict[str, float] = defaultdict(float)
    size = lambda axes: math.prod(mesh[a] for a in axes)
    for p in report.params:
        held_by = {a for e in p.spec for a in _axes(e) if mesh[a] > 1}
        experts = {a for e, name in zip(p.spec, p.names) if name == "experts" for a in _axes(e)}
        gather = (held_by & token_axes) - experts
        reduce = token_axes - held_by - experts
        b_w = np.dtype(p.dtype).itemsize
        if gather:
            n = size(gather)
            out[group_key(gather)] += (n - 1) / n * (2 * b_w + grad_bytes) * p.size / size(held_by - gather)
        if reduce:
            n = size(reduce)
            out[group_key(reduce)] += 2 * (n - 1) / n * grad_bytes * p.size / size(held_by)
    return dict(out)


@dataclasses.dataclass(frozen=True)
class Activations:
    """What the activation formulas need of a model and a step."""
    batch: int
    seq: int
    embed_dim: int
    num_layers: int
    kv_heads: int
    head_dim: int
    num_heads: int
    act_bytes: int
    context_parallel: str = "none"
    moe_layers: int = 0
    top_k: int = 0
    capacity_slots: int | None = None      # per sequence, all experts (None: dropless)


def activation_bytes(a: Activations, mesh: dict, rules) -> dict[str, float]:
    size = lambda axes: math.prod(mesh[x] for x in axes)
    batch_axes = [x for x in rules["batch"] if mesh[x] > 1]
    seq_axes = [x for x in rules["inner_length"] if mesh[x] > 1]
    tokens_per_group = a.batch * a.seq / (size(batch_axes) * size(seq_axes))
    out = {}
    t = mesh.get("tensor", 1)
    if t > 1:
        out["tensor"] = (4 * a.num_layers + 2) * 2 * (t - 1) / t * tokens_per_group * a.embed_dim * a.act_bytes
    s = size(seq_axes)
    if s > 1:
        kv_heads = a.kv_heads / t if a.kv_heads % t == 0 else a.kv_heads
        sequences = a.batch / size(batch_axes)
        kv = (s - 1) / s * 2 * sequences * a.seq * kv_heads * a.head_dim * a.act_bytes
        if a.context_parallel == "ulysses":
            local = sequences * a.seq / s * a.head_dim * a.act_bytes
            per_layer = 2 * (s - 1) / s * local * (2 * a.num_heads + 2 * a.kv_heads) / t
        else:
            per_layer = kv * (3 if a.context_parallel == "ring" else 2)
        out[group_key(seq_axes)] = a.num_layers * per_layer
    e = mesh.get("expert", 1)
    if e > 1 and a.moe_layers:
        per_device_rows = (a.batch / size(batch_axes)) * (a.capacity_slots or a.seq * a.top_k) / s
        out["expert"] = a.moe_layers * 4 * (e - 1) / e * per_device_rows * a.embed_dim * a.act_bytes
    return out


def minimum_bytes(report, activations: Activations, mesh: dict, rules) -> dict[str, float]:
    """Weights, gradients and activations together, per axis group."""
    token_axes = {x for x in (*rules["batch"], *rules["inner_length"]) if mesh[x] > 1}
    out = defaultdict(float, weight_bytes(report, mesh, token_axes))
    for key, value in activation_bytes(activations, mesh, rules).items():
        out[key] += value
    return dict(out)


def hbm_bytes(report, a: Activations, mesh: dict, token_axes: set[str]) -> float:
    """HBM traffic of one step per device, estimated: the weights a device computes with (gathered over
    the token axes, float32) read 3 times (forward, remat recompute, backward), the optimizer reading and
    writing its shard (parameter, gradient, two moments: 28 bytes per element), and about 20 reads or
    writes of a [tokens, D] activation per layer."""
    size = lambda axes: math.prod(mesh[x] for x in axes)
    used = local = 0.0
    for p in report.params:
        held_by = {x for e in p.spec for x in _axes(e) if mesh[x] > 1}
        used += p.size / size(held_by - token_axes) * np.dtype(p.dtype).itemsize
        local += math.prod(p.shard_shape)
    tokens = a.batch * a.seq / size(token_axes)
    return 3 * used + 28 * local + 20 * a.num_layers * tokens * a.embed_dim * a.act_bytes


def memory_estimate(cfg, report, acts: Activations, mesh: dict, token_axes: set) -> float:
    """Bytes per device: 16 per local parameter element (float32 parameter, gradient, two Adam moments),
    the layer inputs kept under remat (layers × tokens × D × b_a, split by tensor's sequence
    parallelism), one layer's working set (16 × tokens × max(D, F/t) × b_a), and float32 logits with
    their gradient (8 × tokens × V/t)."""
    local = sum(math.prod(p.shard_shape) for p in report.params)
    t = mesh.get("tensor", 1)
    tokens = acts.batch * acts.seq / math.prod(mesh[a] for a in token_axes)
    width = max(cfg.embed_dim, cfg.mlp_dim / t)
    activations = (acts.num_layers * tokens * cfg.embed_dim * acts.act_bytes / t
                   + 16 * tokens * width * acts.act_bytes + 8 * tokens * cfg.padded_vocab / t)
    return 16 * local + activations


ACTIVATION_AXES = {"tensor", "sequence", "expert"}


def measured_bytes(ops, *, activation_scale: float = 1.0) -> dict[str, float]:
    """Sent bytes per axis group of the collectives read from a compiled program; a group with an
    activation axis is scaled by ``activation_scale`` (XLA:CPU moves bf16 activations as f32: 0.5)."""
    out: dict[str, float] = defaultdict(float)
    for op in ops:
        if op.axes:
            scale = activation_scale if set(op.axes) & ACTIVATION_AXES else 1.0
            out[group_key(op.axes)] += op.sent_bytes * op.executions * scale
    return dict(out)
