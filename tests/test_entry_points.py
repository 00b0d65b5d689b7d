"""Layouts fail loudly.

1. Every jitted entry point of ``jaxpar.train.step`` — sharded init, train step, eval step, gradient
   function — compiled under a layout contains the kernels that layout asks for (read from the compiled
   HLO, per mesh axis):
     ring + capacity EP   tiny-moe, ring attention, data=2 × expert=2 × sequence=2: collective-permutes
                          on ``sequence`` (the ring) and all-to-alls on ``expert`` (dispatch/combine)
     Ulysses + dropless   tiny-moe, Ulysses, dropless experts, same mesh: all-to-alls on ``sequence``
                          (Ulysses) and on ``expert`` (the padded ragged exchange XLA:CPU runs)
   Init has no kernels; its compiled outputs carry the layout's shardings (experts split over
   ``expert``), so no device ever holds a whole expert stack.
2. A model traced on a multi-device mesh without its layout raises ``NoLayoutError`` that says what to
   call — inside a user's own jit, eagerly, and under ``jax.set_mesh`` — instead of running without
   constraints and with the one-device attention and MoE paths. One device needs no layout.
Everything compiles from abstract inputs; the only real arrays are the eager cases' tiny models.
"""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpar.analysis import analyze_compiled
from jaxpar.checkpoint import abstract_like
from jaxpar.errors import NoLayoutError
from jaxpar.layout import make_layout
from jaxpar.meshes import resolve_mesh_arg
from jaxpar.models import build_model, get_execution_preset, get_model_preset
from jaxpar.train.optim import OptimizerConfig, make_optimizer
from jaxpar.train.step import TrainState, batch_sharding, init_program, make_eval_step, make_grad_fn, make_train_step

B, T = 8, 16
MESH = "data=2,expert=2,sequence=2"
LAYOUTS = {
    # name: (attention strategy, dropless experts, {(collective kind, mesh axis) the kernels emit})
    "ring+capacity-ep": ("ring", False, {("collective-permute", "sequence"), ("all-to-all", "expert")}),
    "ulysses+dropless-ep": ("ulysses", True, {("all-to-all", "sequence"), ("all-to-all", "expert")}),
}
ENTRY_POINTS = ("train_step", "eval_step", "grad_fn")


def execution(name):
    strategy, dropless, _ = LAYOUTS[name]
    dropless = dict(capacity_factor=None) if dropless else {}
    return get_execution_preset("tiny-moe", context_parallel=strategy, remat="none", **dropless)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def setup(request):
    cfg, run = get_model_preset("tiny-moe"), execution(request.param)
    layout = make_layout(cfg, resolve_mesh_arg(MESH), batch=B, seq=T, execution=run)
    program = init_program(
        lambda r: build_model(cfg, execution=run, rngs=r),
        lambda m: make_optimizer(OptimizerConfig(), m, total_steps=10),
        layout,
    )
    state = abstract_like(program.abstract, program.shardings)
    batch = {k: jax.ShapeDtypeStruct((B, T), np.int32, sharding=s) for k, s in batch_sharding(layout).items()}
    return request.param, layout, program, state, batch


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_compiled_entry_point_holds_the_layouts_kernels(setup, entry):
    name, layout, program, state, batch = setup
    ts = TrainState(program.graphdef, None, program.shardings)
    fn = {"train_step": make_train_step, "eval_step": make_eval_step, "grad_fn": make_grad_fn}[entry](ts, layout)
    report = analyze_compiled(fn.lower(state, batch).compile(), mesh=layout.mesh)
    for kind, axis in LAYOUTS[name][2]:
        assert report.collectives.count(kind, axes=(axis,)) > 0, (
            f"{name} {entry}: no {kind} over {axis}; the program's collectives: {report.collectives.to_json()}"
        )


def test_compiled_init_places_every_array_as_the_layout_says(setup):
    name, layout, program, _, _ = setup
    compiled = program.create.lower().compile()
    got = jax.tree.leaves(compiled.output_shardings)
    want = jax.tree.leaves(program.shardings)
    shapes = jax.tree.leaves(program.abstract)
    assert len(got) == len(want) == len(shapes)
    for g, w, a in zip(got, want, shapes):
        assert g.is_equivalent_to(w, len(a.shape)), (g, w, a.shape)
    flat = {"/".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(program.shardings)}
    gate_up = flat["0/moe_blocks/moe/gate_up"]  # [L, E, D, 2, F], E=4 over expert=2
    assert gate_up.shard_shape((2, 4, 64, 2, 64))[1] == 2


# ---------------------------------------------------------------------------- no layout: refused
@pytest.fixture(scope="module")
def sharded_tiny():
    """tiny, born sharded under fsdp=8 (real arrays), and its layout."""
    cfg = get_model_preset("tiny")
    layout = make_layout(cfg, resolve_mesh_arg("fsdp"), batch=B, seq=T)
    program = init_program(
        lambda r: build_model(cfg, rngs=r), lambda m: make_optimizer(OptimizerConfig(), m, total_steps=10), layout
    )
    with layout.activate():
        state = program.create()
    model, _ = nnx.merge(program.graphdef, state)
    return model, layout


IDS = np.zeros((B, T), np.int32)
SAYS = r"no jaxpar layout is active.*`layout\.activate\(\)`.*`layout\.activate_trace\(\)`"


def test_a_users_jit_without_the_layout_is_refused(sharded_tiny):
    model, layout = sharded_tiny
    graphdef, state = nnx.split(model)
    ids = jax.device_put(IDS, layout.sharding(("batch", "length")))
    forward = jax.jit(lambda s, i: nnx.merge(graphdef, s)(i))
    with pytest.raises(NoLayoutError, match="traced on a mesh of 8 devices but " + SAYS):
        forward.lower(state, ids)
    with layout.activate():  # what the message says to do
        assert forward.lower(state, ids) is not None


def test_eager_and_set_mesh_without_the_layout_are_refused(sharded_tiny):
    model, layout = sharded_tiny
    with pytest.raises(NoLayoutError, match=SAYS):
        model(IDS)  # the parameters live on 8 devices
    one_device = build_model(get_model_preset("tiny"), rngs=nnx.Rngs(0))
    with jax.set_mesh(layout.mesh), pytest.raises(NoLayoutError, match=SAYS):
        jax.jit(lambda m, i: m(i)).lower(one_device, IDS)  # a multi-device mesh in context


def test_one_device_needs_no_layout():
    model = build_model(get_model_preset("tiny"), rngs=nnx.Rngs(0))
    logits = jax.jit(lambda m, i: m(i))(model, IDS[:1])
    assert logits.shape == (1, T, 256) and np.isfinite(np.asarray(logits)).all()
