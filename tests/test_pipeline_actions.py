"""Each stage runs only its own action (``jaxpar.pipeline.actions``): with the batch axes manual
(``grad_reduce=step``) and at most tensor and sequence split inside a stage, a forward tick runs the forward once and
files its residuals, a backward tick runs the pullback from them, the embedding runs only with chunk 0
and the head and loss only with the last chunk. Checked: the one-device losses and per-parameter
gradients for every schedule, with data, fsdp, tensor and sequence (``pipeline_cases``, bounds from
the reference's own noise), also in bfloat16 without remat; two mutations (a dropped microbatch, residuals
read from another slot); the residuals of the weights alone (their casts) are recomputed, not kept per
microbatch; 1F1B's memory stays flat in m and GPipe's grows by the formula.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from noise import check_mutation_caught
from pipeline_cases import check_case, check_dropped_microbatch, execution, reference, run_case
from pipeline_cases import model as case_model

from jaxpar.execution import ExecutionConfig
from jaxpar.layout import make_layout
from jaxpar.meshes import resolve_mesh_arg
from jaxpar.models import build_model, get_model_preset
from jaxpar.pipeline import build
from jaxpar.pipeline.actions import (
    ABSTRACT_ACTION,
    ModelParts,
    OwnActions,
    handoff_shapes,
    initial_carry,
    kept_vjp,
)
from jaxpar.pipeline.executor import own_actions
from jaxpar.pipeline.stage import Action, ChunkPrograms
from jaxpar.train.loss import head_losses

CASES = [  # (model, schedule, p, m, v, mesh): every schedule, p ∈ {2, 4}, with data, fsdp and tensor
    ("tiny", "gpipe", 4, 4, 1, "stage=4,data=2"),
    ("tiny", "1f1b", 4, 8, 1, "stage=4,fsdp=2"),
    ("tiny", "interleaved", 2, 4, 2, "stage=2,fsdp=4"),
    ("tiny", "interleaved", 4, 8, 2, "stage=4,data=2"),
    ("tiny", "zero_bubble", 4, 4, 1, "stage=4,data=2"),
    ("tiny", "1f1b", 2, 4, 1, "stage=2,data=2,tensor=2"),
    ("tiny", "interleaved", 4, 8, 2, "stage=4,tensor=2"),
    ("tiny", "zero_bubble", 2, 4, 1, "stage=2,fsdp=2,tensor=2"),
    ("tiny-bf16-keep", "1f1b", 2, 4, 1, "stage=2,data=2,fsdp=2"),  # bfloat16, remat none: casts recomputed
    ("tiny-bf16-keep", "zero_bubble", 2, 4, 1, "stage=2,fsdp=4"),
    ("tiny", "interleaved", 2, 4, 2, "stage=2,data=2,sequence=2"),  # attention as XLA partitions it
    ("tiny-ulysses", "zero_bubble", 2, 4, 1, "stage=2,fsdp=2,sequence=2"),
]


@pytest.mark.parametrize("name,schedule,p,m,v,mesh", CASES, ids=lambda x: str(x))
def test_own_actions_give_the_one_device_run(name, schedule, p, m, v, mesh):
    check_case(name, schedule, p, m, v, mesh, grad_reduce="step")


def test_a_dropped_microbatch_is_caught():
    """Mutation: the schedule fed microbatch 1 in place of microbatch 0 misses the bound."""
    check_dropped_microbatch("tiny", "1f1b", 2, 4, "stage=2,data=2,fsdp=2", grad_reduce="step")


def test_residuals_read_from_another_slot_are_caught(monkeypatch):
    """Mutation: each backward rebuilds its pullback from the residuals of the next slot (another
    microbatch in flight, or an empty slot): the run misses the bound."""

    def next_slot(self, c, a):
        return [r[(a.act_slot + 1) % (r.shape[0] - 1)] for r in c.residuals[:-1]]

    monkeypatch.setattr(OwnActions, "_filed", next_slot)
    got = run_case("tiny", "1f1b", 2, 4, 1, "stage=2,data=2,fsdp=2", grad_reduce="step")
    want, bound = reference("tiny", 4)
    check_mutation_caught(got, want, bound, "own actions: residuals of the next slot")


def test_a_handoff_read_from_another_slot_is_caught(monkeypatch):
    """Mutation: each W reads what B handed over from the next slot (another microbatch in flight, or an
    empty slot): the zero-bubble run misses the bound."""

    def next_slot(self, c, a):
        return [h[(a.act_slot + 1) % (h.shape[0] - 1)] for h in c.handoff]

    monkeypatch.setattr(OwnActions, "_handed", next_slot)
    got = run_case("tiny", "zero_bubble", 2, 4, 1, "stage=2,data=2,fsdp=2", grad_reduce="step")
    want, bound = reference("tiny", 4)
    check_mutation_caught(got, want, bound, "own actions: the handoff of the next slot")


@pytest.mark.parametrize(
    "mesh,context,own",
    [
        ("stage=2,data=2,fsdp=2", "none", True),
        ("stage=2,fsdp=2,tensor=2", "none", True),
        ("stage=2,fsdp=2,sequence=2", "none", True),
        ("stage=2,fsdp=2,sequence=2", "ulysses", True),
        ("stage=2,fsdp=2,sequence=2", "ring", False),
        ("stage=2,data=4", "ring", True),
    ],
)
def test_own_actions_run_where_a_stages_collectives_stay_among_its_devices(mesh, context, own):
    """Tensor's and sequence's collectives (all-reduces, all-gathers, Ulysses' all-to-alls) run among one
    stage's devices, which all run the same action. The ring's sends are a collective-permute, which
    every device enters: under the ring over a split sequence the executor runs one section a tick
    (``jaxpar.pipeline.stage``)."""
    layout = make_layout(case_model("tiny"), resolve_mesh_arg(mesh), batch=16, seq=16)
    assert own_actions(layout.mesh, layout.rules, context) is own


def _parts(name: str, rows: int = 2, seq: int = 16, per_chunk: int = 2) -> ModelParts:
    """``name``'s model cut as a stage holding its first ``per_chunk`` layers, on one device."""
    return _parts_of(case_model(name), execution(name), rows=rows, seq=seq, per_chunk=per_chunk)


def _parts_of(cfg, run, *, rows: int, seq: int, per_chunk: int) -> ModelParts:
    model = build_model(cfg, execution=run, rngs=nnx.Rngs(0))
    in_stack = nnx.PathContains(model.pipeline_stack)
    graphdef, sp, op, sr, orest = nnx.split(model, nnx.All(nnx.Param, in_stack), nnx.Param, in_stack, ...)
    ids = jnp.zeros((1, rows, seq), jnp.int32)
    first = lambda t: jax.tree.map(lambda a: a[:per_chunk], t)
    tokens, labels = {"ids": ids}, {"targets": ids}
    chunk = ChunkPrograms(
        graphdef, model.pipeline_stack, first(sr), orest, tokens, labels, head_losses, per_chunk, False
    )
    return ModelParts(chunk, first(sp), op)


def _kept_shapes(parts: ModelParts, weight_only: list[bool]) -> list[tuple]:
    kept = lambda w, x, a: kept_vjp(parts.forward, w, x, a, weight_only)[1]
    return [(s.shape, s.dtype) for s in jax.eval_shape(kept, parts.sp, parts.chunk_input(), ABSTRACT_ACTION)]


def test_residuals_of_the_weights_alone_are_recomputed_not_kept():
    """bfloat16 compute from float32 parameters without remat: the forward's residuals include each
    weight's bfloat16 cast. Kept per microbatch in flight they would be a copy of the stage's weights
    each; ``split_residuals`` finds them (they depend on the weights alone) and the backward recomputes
    them. Every kept residual is an activation: it has the microbatch's rows and length. Mutation:
    keeping every residual keeps the casts, and the same check fails."""
    parts = _parts("tiny-bf16-keep")
    split = parts.residual_split()
    x = parts.chunk_input()
    weights = {(v.shape, jnp.dtype(jnp.bfloat16)) for v in jax.tree.leaves(parts.sp)}

    def activations(shapes) -> bool:
        return all(x.shape[0] in s[1:] and x.shape[1] in s[1:] for s, _ in shapes)

    kept = _kept_shapes(parts, split)
    assert kept and activations(kept) and not weights & set(kept), kept
    everything = _kept_shapes(parts, [False] * len(split))
    assert weights & set(everything) and not activations(everything)


def test_residuals_under_full_remat_are_the_layer_inputs():
    """The formula of a microbatch in flight under remat=full (the default): each of the chunk's layers
    keeps its input [b, T, D] in the compute dtype, and nothing else of the size of an activation."""
    parts = _parts("tiny", per_chunk=2)
    x = parts.chunk_input()
    big = [s for s in _kept_shapes(parts, parts.residual_split()) if np.prod(s[0]) >= np.prod(x.shape)]
    assert big == [((2, *x.shape), x.dtype)], big


def _temp_bytes(schedule: str, p: int, m: int, rows: int, seq: int) -> int:
    from jaxpar.train.optim import OptimizerConfig, make_optimizer
    from jaxpar.train.step import batch_sharding, init_train_state, make_train_step

    cfg = case_model("tiny")
    devices = jax.devices()[: 2 * p]
    layout = make_layout(cfg, resolve_mesh_arg(f"stage={p},data=2"), batch=rows * m, seq=seq, devices=devices)
    ts = init_train_state(
        lambda r: build_model(cfg, rngs=r), functools.partial(make_optimizer, OptimizerConfig()), layout
    )
    batch = {k: jax.ShapeDtypeStruct((rows * m, seq), np.int32, sharding=s) for k, s in batch_sharding(layout).items()}
    step = make_train_step(ts, layout, pipeline=build(schedule, p, m), grad_reduce="step")
    return step.lower(ts.state, batch).compile().memory_analysis().temp_size_in_bytes


def test_1f1b_memory_stays_flat_in_microbatches_and_gpipe_grows_by_the_formula():
    """Compiled temp memory at p = 2 (data = 2, 2 rows a microbatch, one per device) from m = p to 4p:
    1F1B's stays within ±10% (it keeps p microbatches in flight). GPipe keeps all m, and each added
    microbatch adds the formula's bytes within ±10%: under remat=full its residuals, the input of each
    of the stage's layers [1, T, D] float32 (``test_residuals_under_full_remat_are_the_layer_inputs``),
    and its slots of the stage-input and output-gradient buffers."""
    p, rows, seq, cfg = 2, 2, 64, case_model("tiny")
    one_f = {m: _temp_bytes("1f1b", p, m, rows, seq) for m in (p, 4 * p)}
    gpipe = {m: _temp_bytes("gpipe", p, m, rows, seq) for m in (p, 4 * p)}
    per_microbatch = (cfg.num_layers // p + 2) * (rows // 2) * seq * cfg.embed_dim * 4
    assert abs(one_f[4 * p] / one_f[p] - 1) <= 0.10, one_f
    assert abs((gpipe[4 * p] - gpipe[p]) / (3 * p * per_microbatch) - 1) <= 0.10, (gpipe, per_microbatch)


def _op_flops(parts: ModelParts, op: str, *, split: bool = False, last: bool = False, cut: bool = True) -> float:
    """XLA's FLOPs of one op of ``OwnActions`` on ``parts`` (one device, compiled, not run); ``cut``
    False: W without the handoff (it runs the whole pullback)."""
    table = build("zero_bubble" if split else "1f1b", 2, 2)
    weight_only = parts.residual_split()
    c = initial_carry(parts, table, weight_only)  # an argument: zero buffers as constants would fold away
    c = c if cut else dataclasses.replace(c, handoff=())

    def run(sp, o, c):
        at = ModelParts(parts.chunk, sp, o)
        ops = OwnActions(at.forward, at.embed, at.loss, sp, o, parts.chunk.per_chunk, 2, split, weight_only)
        a = Action(*(jnp.int32(0),) * 5, first=jnp.bool_(False), last=jnp.bool_(last))
        backward = lambda c, a: ops.run_backward(c, a, weights=not split)
        return {"F": ops.run_forward, "W": ops.run_weights, "B": backward}[op](c, a)

    return jax.jit(run).lower(parts.sp, parts.op, c).compile().cost_analysis()["flops"]


def test_the_lab_durations_are_the_compiled_flops():
    """The lab prices each op of this executor in forwards of a chunk (``costmodel.own_action_durations``,
    remat none): B 2, split B 1 and W 1 (the weight gradient from the cotangents B hands over:
    ``jaxpar.pipeline.wgrad``), the head's forward and backward 3h with the last chunk's F. XLA's FLOPs of
    the compiled ops, at ``llama-100m``'s widths with one layer a chunk, give the same within 3% (the lab
    counts matmuls and attention; the norms and activations it leaves out are under 2% here). Mutation: a
    W that runs the whole pullback for the weight gradient (as where the cut saves nothing) costs 2."""
    from jaxpar.analysis.costmodel import own_action_durations

    big = dataclasses.replace(get_model_preset("llama-100m"), num_layers=1)
    parts = _parts_of(big, ExecutionConfig(remat="none"), rows=2, seq=64, per_chunk=1)
    f = _op_flops(parts, "F")
    head = 2.0 * big.padded_vocab * big.embed_dim  # the lab's forward FLOPs a token, as pipeline_costs counts
    head /= big.flops_per_token(64) / 3 - head
    for split in (False, True):
        _, t_b, t_w, t_h = own_action_durations(split, head, remat_full=False)
        assert _op_flops(parts, "B", split=split) / f == pytest.approx(t_b, rel=0.03), split
        if split:
            assert _op_flops(parts, "W", split=True) / f == pytest.approx(t_w, rel=0.03)
            assert _op_flops(parts, "W", split=True, cut=False) / f == pytest.approx(2.0, rel=0.03)
    assert (_op_flops(parts, "F", last=True) - f) / f == pytest.approx(t_h, rel=0.03)


def test_under_full_remat_the_cut_saves_the_input_gradients_chain():
    """Under full remat W recomputes the chunk's forward (it does not depend on the seeds, so it is run
    again rather than handed over) and then the weight gradient: the cut still saves B's chain, one
    forward's FLOPs of the two-layer chunk's, against a W that runs the whole pullback."""
    big = dataclasses.replace(get_model_preset("llama-100m"), num_layers=2)
    parts = _parts_of(big, ExecutionConfig(remat="full"), rows=2, seq=64, per_chunk=2)
    f = _op_flops(parts, "F")
    saved = (_op_flops(parts, "W", split=True, cut=False) - _op_flops(parts, "W", split=True)) / f
    assert saved == pytest.approx(1.0, rel=0.05), saved


@pytest.mark.parametrize("name", ["tiny", "tiny-bf16-keep"])
def test_the_lab_prices_what_b_hands_w(name):
    """What B hands W per layer and token (the program's own shapes, ``handoff_shapes``) is what the lab
    adds per act slot of a split schedule (``costmodel.handoff_bytes``), in float32 and in bfloat16."""
    from jaxpar.analysis.costmodel import handoff_bytes

    parts = _parts(name, rows=2, seq=16, per_chunk=2)
    shapes = handoff_shapes(parts.forward, parts._any_rows(), parts.chunk_input(), ABSTRACT_ACTION)
    got = sum(s.size * s.dtype.itemsize for s in shapes) / (2 * 2 * 16)  # 2 layers, 2 rows × 16 tokens
    itemsize = jnp.dtype(execution(name).dtype).itemsize
    assert got == handoff_bytes(case_model(name), itemsize, 1)
