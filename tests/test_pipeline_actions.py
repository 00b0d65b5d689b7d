"""Each stage runs only its own action (``jaxpar.pipeline.actions``): with the batch axes manual
(``grad_reduce=step``) and at most tensor split inside a stage, a forward tick runs the forward once and
files its residuals, a backward tick runs the pullback from them, the embedding runs only with chunk 0
and the head and loss only with the last chunk. Checked: the one-device losses and per-parameter
gradients for every schedule, with data, fsdp and tensor (``pipeline_cases``, bounds from the
reference's own noise), also in bfloat16 without remat; two mutations (a dropped microbatch, residuals
read from another slot); the residuals of the weights alone (their casts) are recomputed, not kept per
microbatch; 1F1B's memory stays flat in m and GPipe's grows by the formula.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from noise import check_mutation_caught
from pipeline_cases import check_case, check_dropped_microbatch, execution, reference, run_case
from pipeline_cases import model as case_model

from jaxpar.layout import make_layout
from jaxpar.meshes import resolve_mesh_arg
from jaxpar.models import build_model
from jaxpar.pipeline import build
from jaxpar.pipeline.actions import ABSTRACT_ACTION, ModelParts, OwnActions, kept_vjp
from jaxpar.pipeline.executor import own_actions
from jaxpar.pipeline.stage import ChunkPrograms

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


@pytest.mark.parametrize(
    "mesh,own",
    [("stage=2,data=2,fsdp=2", True), ("stage=2,fsdp=2,tensor=2", True), ("stage=2,fsdp=2,sequence=2", False)],
)
def test_own_actions_run_where_only_tensor_is_split_automatically(mesh, own):
    """Tensor's collectives run among one stage's devices, which all run the same action; sequence
    parallelism keeps the executor's one section a tick (``jaxpar.pipeline.stage``)."""
    layout = make_layout(case_model("tiny"), resolve_mesh_arg(mesh), batch=16, seq=16)
    assert own_actions(layout.mesh, layout.rules) is own


def _parts(name: str, rows: int = 2, seq: int = 16, per_chunk: int = 2) -> ModelParts:
    """``name``'s model cut as a stage holding its first ``per_chunk`` layers, on one device."""
    cfg = case_model(name)
    model = build_model(cfg, execution=execution(name), rngs=nnx.Rngs(0))
    in_stack = nnx.PathContains(model.pipeline_stack)
    graphdef, sp, op, sr, orest = nnx.split(model, nnx.All(nnx.Param, in_stack), nnx.Param, in_stack, ...)
    ids = jnp.zeros((1, rows, seq), jnp.int32)
    first = lambda t: jax.tree.map(lambda a: a[:per_chunk], t)
    losses = lambda logits, targets: (jnp.mean(logits), jnp.float32(0))
    chunk = ChunkPrograms(graphdef, model.pipeline_stack, first(sr), orest, ids, ids, losses, per_chunk, False)
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
