"""Expert parallelism: the all-to-all expert MLP equals the one-device MLP (forward and gradients) for
expert = 1, 2, 4, 8, composes with data and tensor sharding, and moves the bytes the formula says.
Tolerance: a multiple of the one-device MLP's own noise, its batch rows in another order (tests/noise.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from noise import array_ratios, check_arrays

from jaxpar.analysis import analyze_compiled
from jaxpar.mesh import build_mesh
from jaxpar.meshes import resolve_mesh_arg
from jaxpar.parallel.moe import a2a_bytes_formula, expert_mlp, experts_apply
from jaxpar.rules import LayoutError, use_layout

B, E, C, D, F = 8, 8, 3, 16, 8
NAMES = ("out", "d buffer", "d gate_up", "d down")
RNG = np.random.default_rng(0)
BUF = RNG.normal(size=(B, E, C, D)).astype(np.float32)
GATE_UP = (RNG.normal(size=(E, D, 2, F)) / 4).astype(np.float32)
DOWN = (RNG.normal(size=(E, F, D)) / 3).astype(np.float32)
COT = RNG.normal(size=(B, E, C, D)).astype(np.float32)


def _loss(fn, cot=COT):
    return lambda b, g, d: jnp.sum(fn(b, g, d) * cot)


def _one_device(rows=slice(None)):
    """(out, d buffer, d gate_up, d down) of the one-device MLP on the batch rows in order ``rows``,
    the rows put back in their places."""
    out = np.asarray(expert_mlp(BUF[rows], GATE_UP, DOWN))
    grads = [np.asarray(g) for g in jax.grad(_loss(expert_mlp, COT[rows]), argnums=(0, 1, 2))(BUF[rows], GATE_UP, DOWN)]
    back = np.argsort(np.arange(B)[rows])
    return [out[back], grads[0][back], *grads[1:]]


@pytest.fixture(scope="module")
def dense():
    """The one-device results and their own noise (rows in another order)."""
    want = _one_device()
    other = _one_device(np.random.default_rng(1).permutation(B))
    return want, max(array_ratios(other, want, NAMES).values())


def _sharded(spec):
    preset = resolve_mesh_arg(spec)
    mesh = build_mesh(preset.mesh)
    rules = preset.rules
    s = lambda names: jax.sharding.NamedSharding(mesh, rules.spec(names))
    shardings = (
        s(("batch", None, None, "act_embed")),
        s(("experts", "embed", None, "mlp")),
        s(("experts", "mlp", "embed")),
    )
    return mesh, rules, shardings


@pytest.mark.parametrize(
    "spec", ["data=8", "data=4,expert=2", "data=2,expert=4", "expert=8", "data=2,expert=2,tensor=2", "fsdp=2,expert=4"]
)
def test_expert_parallel_equals_one_device(dense, spec):
    want, noise = dense
    mesh, rules, shardings = _sharded(spec)
    with use_layout(mesh, rules):
        out = jax.jit(experts_apply, in_shardings=shardings)(BUF, GATE_UP, DOWN)
        grads = jax.jit(jax.grad(_loss(experts_apply), argnums=(0, 1, 2)), in_shardings=shardings)(BUF, GATE_UP, DOWN)
    check_arrays([out, *grads], want, noise, "experts", f"expert MLP on {spec}", NAMES)


def test_all_to_all_bytes_match_the_formula():
    """Forward and gradient under data=2 × expert=4: 4 all-to-alls that send exactly the formula's bytes."""
    mesh, rules, shardings = _sharded("data=2,expert=4")
    with use_layout(mesh, rules):
        fn = jax.jit(jax.value_and_grad(_loss(experts_apply), argnums=(0, 1, 2)), in_shardings=shardings)
        report = analyze_compiled(fn.lower(BUF, GATE_UP, DOWN).compile(), mesh=mesh)
    ep = 4
    sent = sum(c.sent_bytes * c.executions for c in report.ops if c.kind == "all-to-all")
    # the buffer holds T·k·cf tokens per device: here B/8 groups × E × C slots
    slots_per_device = B // 8 * E * C
    want = a2a_bytes_formula(
        tokens_per_device=slots_per_device, top_k=1, capacity_factor=1.0, embed_dim=D, ep=ep, bytes_per_element=4
    )
    assert report.collectives.count("all-to-all") == 4
    assert sent == want, (sent, want)  # exactly: 4,608 bytes here


def test_groups_or_experts_not_divisible_by_the_expert_axis():
    mesh, rules, _ = _sharded("data=2,expert=4")
    with use_layout(mesh, rules), pytest.raises(LayoutError, match=r"experts \(6\) divisible by 4"):
        jax.eval_shape(experts_apply, BUF[:, :6], GATE_UP[:6], DOWN[:6])
