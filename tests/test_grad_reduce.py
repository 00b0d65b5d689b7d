"""Gradient accumulation with the gradients reduced once a step (``grad_reduce=step``,
``jaxpar.train.accumulate``): the one-device run's losses and per-parameter gradients within a multiple
of its own noise (tests/noise.py) on the batch layouts it runs; in the compiled step no reduction over
the batch axes inside the slices' loop and one per gradient after it, where per slice (the default)
reduces in every trip; a dropped reduction term and the layouts it does not run are caught."""

import functools

import jax
import numpy as np
import pytest
from invariance import reference, train_steps
from noise import check_mutation_caught, check_run

from jaxpar.analysis.hlo import analyze_compiled
from jaxpar.errors import ConfigError
from jaxpar.layout import make_layout
from jaxpar.meshes import resolve_mesh_arg
from jaxpar.models import build_model, get_model_preset
from jaxpar.parallel import manual
from jaxpar.train import accumulate
from jaxpar.train.optim import OptimizerConfig, make_optimizer
from jaxpar.train.step import batch_sharding, init_train_state, make_train_step

BATCH, SEQ, STEPS, K = 32, 16, 3, 4
CFG = get_model_preset("tiny")
TOKENS = np.random.default_rng(0).integers(0, CFG.vocab_size, (STEPS, BATCH, SEQ + 1), dtype=np.int32)
BATCH_AXES = ("data", "fsdp")


@pytest.fixture(scope="module")
def accumulated():
    """(the one-device run accumulating over K slices, its noise bound)."""
    return reference(CFG, TOKENS, "grad_reduce", grad_accum=K)


@pytest.mark.parametrize(
    "mesh", ["data=8", "fsdp=8", "data=2,fsdp=4", "data=2,fsdp=2,tensor=2", "data=2,fsdp=2,sequence=2"]
)
def test_reduced_once_equals_one_device(mesh, accumulated):
    ref, bound = accumulated
    got = train_steps(CFG, resolve_mesh_arg(mesh), TOKENS, grad_accum=K, grad_reduce="step")
    check_run(got, ref, bound, f"grad_reduce=step on {mesh}")


def test_a_dropped_reduction_term_is_caught(accumulated, monkeypatch):
    """The mutation: the sum over the batch axes that do not split a parameter left out (each data
    replica keeps its own rows' gradient)."""
    ref, bound = accumulated

    def without_sum(g, spec, axes):
        for dim, entry in enumerate(spec):
            for axis in manual.axes_of(entry):
                g = jax.lax.psum_scatter(g, axis, scatter_dimension=dim, tiled=True)
        return g

    monkeypatch.setattr(accumulate, "reduced", without_sum)
    mutant = train_steps(CFG, resolve_mesh_arg("data=2,fsdp=4"), TOKENS, grad_accum=K, grad_reduce="step")
    check_mutation_caught(mutant, ref, bound, "grad_reduce=step: the sum over data left out")


def _reductions(grad_reduce: str) -> tuple[list, int]:
    """(the all-reduces and reduce-scatters over data or fsdp of tiny's step on data=2,fsdp=4 accumulating
    over K slices, how many parameters fsdp splits)."""
    from flax import nnx

    layout = make_layout(CFG, resolve_mesh_arg("data=2,fsdp=4"), batch=BATCH, seq=SEQ)
    ts = init_train_state(
        lambda r: build_model(CFG, rngs=r), functools.partial(make_optimizer, OptimizerConfig()), layout
    )
    batch = {k: jax.ShapeDtypeStruct((BATCH, SEQ), np.int32, sharding=s) for k, s in batch_sharding(layout).items()}
    step = make_train_step(ts, layout, grad_accum=K, grad_reduce=grad_reduce)
    ops = analyze_compiled(step.lower(ts.state, batch).compile(), mesh=layout.mesh).ops
    params = nnx.state(nnx.eval_shape(lambda: build_model(CFG, rngs=nnx.Rngs(0))), nnx.Param)
    variables = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    split = sum("fsdp" in str(layout.rules.spec(v.out_sharding)) for v in variables)
    return [o for o in ops if o.kind in ("all-reduce", "reduce-scatter") and set(o.axes) & set(BATCH_AXES)], split


def test_reduced_once_read_from_the_program():
    """``step``: every reduction over data or fsdp runs once a step (none inside the slices' loop), one
    reduce-scatter over fsdp for each parameter fsdp splits; ``slice`` (the default) reduces in every one
    of the K trips."""
    (once, split), (per_slice, _) = _reductions("step"), _reductions("slice")
    assert once and all(o.executions == 1 for o in once), [(o.kind, o.axes, o.executions) for o in once]
    assert sum(o.kind == "reduce-scatter" and o.axes == ("fsdp",) for o in once) == split > 0
    assert any(o.executions == K for o in per_slice)


@pytest.mark.parametrize(
    "preset,mesh,why",
    [("tiny-moe", "data=2,fsdp=4", "a mixture of experts"), ("tiny", "data=2,expert=4", "expert=4")],
)
def test_layouts_it_does_not_run_are_refused(preset, mesh, why):
    cfg = get_model_preset(preset)
    with pytest.raises(ConfigError, match=f"grad_reduce=step with {why}"):
        accumulate.check_reduce_once(cfg, make_layout(cfg, resolve_mesh_arg(mesh), batch=BATCH, seq=SEQ).mesh.shape)
