"""Collectives of the compiled train step against the physical formulas (docs/benchmarks.md; the formulas
themselves: ``jaxpar.analysis.costmodel``).

The tiny model (fp32, remat FULL), one step compiled per mesh preset on 8 simulated CPU devices.

Accounting (``jaxpar.analysis``): RESULT bytes of each collective on one device, times its executions
per step (the layer stack is one HLO while loop run L times). What a ring algorithm SENDS per device for
a result of R bytes on n devices (``Collective.sent_bytes``):
    all-reduce       2(n-1)/n · R     (R = the whole tensor)
    all-gather        (n-1)/n · R     (R = the whole gathered tensor)
    reduce-scatter    (n-1)   · R     (R = 1/n of the tensor)
    all-to-all        (n-1)/n · R
So a gradient reduction of P·b bytes shows up as R = P·b (all-reduce) or R = P·b/n (reduce-scatter);
"reduced bytes" below = all-reduce R + n · reduce-scatter R, the size of the tensors reduced, whichever
kind XLA picks. XLA:CPU writes every reduce-scatter of the SPMD partitioner as all-reduce + dynamic-slice
(a GPU would emit reduce-scatter), which sends twice the bytes: the tests check the reduced volume, and
the kinds only loosely. b = 4 (float32 everywhere).
"""

import functools
import math

import jax
import numpy as np
import pytest

from jaxpar.analysis import analyze_compiled
from jaxpar.layout import make_layout
from jaxpar.meshes import get_mesh_preset
from jaxpar.models import build_model, get_model_preset
from jaxpar.train.optim import OptimizerConfig, make_optimizer
from jaxpar.train.step import batch_sharding, init_train_state, make_train_step

CFG = get_model_preset("tiny")  # fp32, remat FULL
B, T, b, n = 8, 24, 4, 8  # batch, sequence, bytes per element, devices on the axis
D, V, L, F = CFG.embed_dim, CFG.padded_vocab, CFG.num_layers, CFG.mlp_dim
N, K, H = CFG.num_heads, CFG.num_kv_heads, CFG.head_dim
P = CFG.num_params(padded=True)
P_EMBED = P_HEAD = V * D  # embedding table, LM head
P_NORM = L * 2 * D + D  # norm scales: replicated in every preset here
P_BLOCKS = L * (D * H * (2 * N + 2 * K) + 3 * D * F)  # block matrices (scanned, [L, ...])
A = B * T * D  # one [B, T, D] activation, elements
MODEL_DIMS = {D, V, L, F, N, K, H}


def test_parameter_bookkeeping():
    assert P == P_EMBED + P_HEAD + P_NORM + P_BLOCKS == 102_720  # tiny's count (docs/models.md)
    assert T not in MODEL_DIMS  # so "has a T dimension" marks an activation below
    assert A < P_EMBED  # vocab-parallel embedding regime (see test_tp_*)


@functools.cache
def step_report(preset: str):
    """Compile one train step of the tiny model on ``preset``; its collectives (once per preset)."""
    layout = make_layout(CFG, get_mesh_preset(preset), batch=B, seq=T)
    opt = functools.partial(make_optimizer, OptimizerConfig())
    ts = init_train_state(lambda r: build_model(CFG, rngs=r), opt, layout, seed=0)
    batch = {k: jax.ShapeDtypeStruct((B, T), np.int32, sharding=s) for k, s in batch_sharding(layout).items()}
    return analyze_compiled(make_train_step(ts, layout).lower(ts.state, batch).compile())


@pytest.fixture(scope="module")
def dp():
    return step_report("dp")


@pytest.fixture(scope="module")
def fsdp():
    return step_report("fsdp")


@pytest.fixture(scope="module")
def tp():
    return step_report("tp")


def on(ops, axis, *kinds):
    return [c for c in ops if c.axes == (axis,) and (not kinds or c.kind in kinds)]


def reduced(ops, axis):
    """Elements of every tensor reduced over ``axis``, with its executions per step."""
    return [
        (math.prod(s) * (c.group_size if c.kind == "reduce-scatter" else 1), c.executions)
        for c in on(ops, axis, "all-reduce", "reduce-scatter")
        for s in c.shapes
    ]


def reduced_bytes(ops, axis):
    return b * sum(e * x for e, x in reduced(ops, axis))


def scalars_reduced(ops, axis):
    """How many scalars (loss, norm partial sums) are reduced over ``axis`` per step."""
    return sum(c.executions for c in on(ops, axis, "all-reduce", "reduce-scatter") for s in c.shapes if s == ())


def gradient_check(report, axis):
    """The DP expectation: the gradients are reduced once, P·b bytes (relative error)."""
    return reduced_bytes(report.ops, axis) / (P * b) - 1


def gathered_bytes(report, axis):
    return report.collectives.bytes("all-gather", axes=(axis,))


# ------------------------------------------------------------------------------------------ dp
def test_dp_gradient_all_reduce(dp):
    """data=8: one all-reduce of all gradients, P·b result bytes, plus the loss scalar: 410,884 B,
    exactly (docs/benchmarks.md); a ring sends 2(n-1)/n of that. Block gradients are reduced inside the scanned
    backward loop, L times."""
    assert dp.collectives.trip_counts_known
    assert {c.axes for c in dp.ops} == {("data",)} and {c.kind for c in dp.ops} <= {
        "all-reduce",
        "reduce-scatter",
        "all-gather",
    }
    assert scalars_reduced(dp.ops, "data") == 1  # the loss
    assert reduced_bytes(dp.ops, "data") == P * b + 4 == 410_884
    assert dp.collectives.total_bytes == P * b + 4  # nothing else moves
    sent = sum(c.sent_bytes * c.executions for c in dp.ops)
    assert sent == 2 * (n - 1) / n * (P * b + 4) == 719_047
    in_loop = [c for c in dp.ops if c.executions == L]
    assert sum(c.total_bytes for c in in_loop) == (P_BLOCKS + L * 2 * D) * b  # matrices + norms
    # Counting each instruction once (no loop multiplicity) would miss (L-1) layers' gradients.
    assert sum(c.bytes for c in dp.ops) < 0.95 * P * b


# ---------------------------------------------------------------------------------------- fsdp
def test_fsdp_gathers_and_gradient_reduction(fsdp):
    """fsdp=8 (ZeRO-3). Formula: gathered + reduced bytes = (2·b_w + b_g)·P (all-gather the
    weights forward and backward, reduce-scatter the gradients; a ring sends (n-1)/n of that).
    What XLA compiles:
      * block matrices: gathered once in the forward loop and once in the backward loop: the
        remat=FULL recompute and the backward share one gather per weight, so 2x, not 3x;
      * LM head [D, V]: outside the loop, gathered once; the backward reuses the gathered copy;
      * embedding [V, D]: never gathered: the lookup runs on the local D/n columns for all B·T
        tokens and one all-to-all of the [B, T, D] activation returns it to batch sharding; the
        gradient takes the reverse all-to-all and is scatter-added locally (no reduction);
      * norm scales: replicated, never gathered, gradients all-reduced;
      * plus the token ids gathered ([B, T] int32) and the loss / grad-norm scalars reduced.
    """
    ops = fsdp.ops
    assert fsdp.collectives.trip_counts_known and {c.axes for c in ops} == {("fsdp",)}
    ids = B * T * 4  # the token ids, gathered once
    scalars = b * scalars_reduced(ops, "fsdp")  # loss, grad-norm partial sums
    assert scalars == 68  # 17 scalars, as measured
    assert gathered_bytes(fsdp, "fsdp") == b * (2 * P_BLOCKS + P_HEAD) + ids
    assert reduced_bytes(ops, "fsdp") == b * (P - P_EMBED) + scalars
    assert fsdp.collectives.bytes("all-to-all", axes=("fsdp",)) == 2 * A * b // n
    # Against the formula: equal, byte for byte, once the embedding (3·b·P_embed), the LM head's
    # second gather (b·P_head) and the replicated norms (2·b·P_norm gathers) are taken out and the
    # ids and scalars (836 B) added (measured/formula is 0.79 for tiny: the vocabulary is a third
    # of its parameters).
    formula = (2 * b + b) * P
    measured = gathered_bytes(fsdp, "fsdp") + reduced_bytes(ops, "fsdp")
    assert measured <= formula
    saved = 3 * b * P_EMBED + b * P_HEAD + 2 * b * P_NORM
    assert measured == formula - saved + ids + scalars == 968_772
    assert ids + scalars == 836
    # Each of the 6 block matrices (q, k, v, o, gate_up, down) is gathered by one instruction in
    # the forward loop and one in the backward loop, each run L times.
    loop_gathers = [c for c in on(ops, "fsdp", "all-gather") if c.executions == L]
    assert len(loop_gathers) == 2 * 6
    assert sum(c.total_bytes for c in loop_gathers) == 2 * P_BLOCKS * b


# ------------------------------------------------------------------------------------------ tp
def test_tp_activation_collectives_per_layer(tp):
    """tensor=8, Megatron with sequence parallelism: the residual stream is [B, T/n, D] between
    blocks. Per layer, with A = B·T·D·b:
      forward   2 all-gathers of A (before attention, before the MLP) + 2 reductions of A
                (attention out-projection, MLP down-projection; reduce-scatter, here
                all-reduce + dynamic-slice),
      recompute (remat FULL) the block up to the MLP input again: 2 all-gathers + 1 reduction
                (the MLP output's reduction is not needed by the backward),
      backward  the transposes: 2 all-gathers of dY (transpose of the reductions) + 2 reductions
                of dX (transpose of the gathers). Gate and up are one fused [D, 2, F] weight, so
                the MLP input gradient is reduced once; with two separate weights XLA:CPU reduced
                both dX tensors (3 per layer, measured before the fusion).
    """
    assert tp.collectives.trip_counts_known and {c.axes for c in tp.ops} == {("tensor",)}
    loop = [c for c in tp.ops if c.executions == L]
    act_gathers = [c for c in on(loop, "tensor", "all-gather") if c.shapes == ((B, T, D),)]
    assert len(act_gathers) == 2 + 2 + 2
    act_reduced = [x for x, _ in reduced(loop, "tensor") if x == A]
    assert len(act_reduced) == 2 + 1 + 2
    # The rest of the loop: K < n so K/V heads are replicated over tensor: dK and dV (B·T·H each
    # per kv head) are reduced over the n/K devices sharing a head, then gathered over the K heads
    # (B·T·K·H each); and the norm-scale gradients (2·D) are all-reduced.
    rest = sum(c.total_bytes for c in loop) - L * b * (len(act_gathers) + len(act_reduced)) * A
    assert rest == L * b * (2 * B * T * H + 2 * B * T * K * H + 2 * D)


def test_tp_weights_stay_sharded(tp):
    """Every all-gather on tensor carries the T dimension (an activation or token ids), so no
    parameter is gathered; the embedding lookup is vocab-parallel (partial [B, T, D] rows reduced)."""
    gathers = on(tp.ops, "tensor", "all-gather")
    assert gathers and all(T in s for c in gathers for s in c.shapes)
    # Whole step: the loop's 6 per layer, plus 2 outside: the final norm's output for the LM
    # head and the embedding's dX for the vocab-parallel scatter-add; plus [B, T] ids/softmax stats.
    act = sum(c.executions for c in gathers if c.shapes == ((B, T, D),))
    assert act == 6 * L + 2
    small = L * 2 * B * T * K * H * b + 4 * B * T * 4  # GQA dK/dV (above); ids x2, softmax stats x2
    assert sum(c.total_bytes for c in gathers) == (6 * L + 2) * A * b + small
    # Reductions outside the loop: the embedding's partial rows and the LM head's dX, A each.
    outside = [x for x, e in reduced(tp.ops, "tensor") if e == 1 and x == A]
    assert len(outside) == 2


# ------------------------------------------------------------------------- the checks can fail
def test_expectations_tell_presets_apart(dp, fsdp, tp):
    assert abs(gradient_check(dp, "data")) < 0.05
    assert gradient_check(fsdp, "fsdp") < -0.05  # fsdp reduces no embedding gradient
    assert gradient_check(tp, "tensor") > 0.05  # tp reduces activations, not gradients
    assert gathered_bytes(dp, "data") == 0 < gathered_bytes(fsdp, "fsdp")
    # fsdp gathers parameters: its gathers have no T dimension, so the tp check would fail.
    assert not all(T in s for c in on(fsdp.ops, "fsdp", "all-gather") for s in c.shapes)
