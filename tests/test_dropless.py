"""Dropless experts under expert parallelism: the exchange of ragged assignment slices over ``expert``
equals the one-device grouped matmuls (forward and gradients) for expert = 1, 2, 4, 8, uniform or with
every assignment on one device's experts; the CPU exchange does what ``ragged_all_to_all`` documents;
the GPU/TPU path lowers to ``ragged_all_to_all`` (it cannot run on XLA:CPU). Tolerance: a multiple of
the oracle's own noise, its batch rows in another order (tests/noise.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from noise import array_ratios, check_arrays

from jaxpar.mesh import build_mesh
from jaxpar.meshes import resolve_mesh_arg
from jaxpar.parallel.dropless import dropless_apply, padded_ragged_all_to_all
from jaxpar.parallel.moe import expert_mlp
from jaxpar.rules import LayoutError, use_layout

B, T, K, E, D, F = 8, 6, 2, 8, 16, 8
RNG = np.random.default_rng(0)
X = RNG.normal(size=(B, T, D)).astype(np.float32)
GATE_UP = (RNG.normal(size=(E, D, 2, F)) / 4).astype(np.float32)
DOWN = (RNG.normal(size=(E, F, D)) / 3).astype(np.float32)
ROUTES = {
    "uniform": RNG.integers(0, E, (B, T, K)).astype(np.int32),
    "hot": RNG.integers(0, 2, (B, T, K)).astype(np.int32),
}  # all on experts 0, 1: one device's


def _oracle(x, idx, gate_up, down):
    """Each assignment through its expert, one at a time (the expert MLP on a [1, 1, 1, D] buffer)."""
    rows = [
        expert_mlp(x[b, t][None, None, None], gate_up[e][None], down[e][None])[0, 0, 0]
        for b in range(B)
        for t in range(T)
        for e in idx[b, t]
    ]
    return jnp.stack(rows).reshape(B, T, K, D)


WEIGHTS = np.cos(np.arange(B * T * K * D)).reshape(B, T, K, D).astype(np.float32)
NAMES = ("out", "dx", "d gate_up", "d down")


def _loss(fn, idx, weights=WEIGHTS):
    return lambda x, g, d: jnp.sum(fn(x, idx, g, d) * weights)


def _oracle_results(idx, rows=slice(None)):
    """(out, dx, d gate_up, d down) of the oracle on the batch rows in order ``rows``, put back."""
    x, idx, w = X[rows], idx[rows], WEIGHTS[rows]
    grads = [np.asarray(g) for g in jax.grad(_loss(_oracle, idx, w), argnums=(0, 1, 2))(x, GATE_UP, DOWN)]
    back = np.argsort(np.arange(B)[rows])
    return [np.asarray(_oracle(x, idx, GATE_UP, DOWN))[back], grads[0][back], *grads[1:]]


@pytest.fixture(scope="module", params=sorted(ROUTES))
def reference(request):
    """(routes, the oracle's results, its own noise: rows in another order, tests/noise.py)."""
    idx = ROUTES[request.param]
    want = _oracle_results(idx)
    other = _oracle_results(idx, np.random.default_rng(1).permutation(B))
    return request.param, idx, want, max(array_ratios(other, want, NAMES).values())


@pytest.mark.parametrize(
    "spec", ["data=8", "data=4,expert=2", "data=2,expert=4", "expert=8", "fsdp=2,expert=4", "data=2,expert=2,tensor=2"]
)
def test_dropless_expert_parallel_equals_oracle(reference, spec):
    route, idx, want, noise = reference
    preset = resolve_mesh_arg(spec)
    with use_layout(build_mesh(preset.mesh), preset.rules):
        out = jax.jit(dropless_apply)(X, idx, GATE_UP, DOWN)
        grads = jax.jit(jax.grad(_loss(dropless_apply, idx), argnums=(0, 1, 2)))(X, GATE_UP, DOWN)
    check_arrays([out, *grads], want, noise, "experts", f"dropless, {route} routes, on {spec}", NAMES)


def test_padded_exchange_follows_the_ragged_all_to_all_contract():
    """The two-device example of ``jax.lax.ragged_all_to_all``'s documentation."""
    mesh = jax.make_mesh((2,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    operand = jnp.array([1, 2, 2, 3, 4, 0], jnp.float32)
    per_device = dict(
        input_offsets=[0, 1, 0, 1], send_sizes=[1, 2, 1, 1], output_offsets=[0, 0, 1, 2], recv_sizes=[1, 1, 2, 1]
    )
    args = [jnp.array(v, jnp.int32) for v in per_device.values()]
    fn = jax.shard_map(
        lambda o, out, *a: padded_ragged_all_to_all(o, out, *a, axis_name="expert"),
        mesh=mesh,
        in_specs=P("expert"),
        out_specs=P("expert"),
    )
    got = jax.jit(fn)(operand, jnp.zeros(8, jnp.float32), *args)
    np.testing.assert_array_equal(np.asarray(got), [1, 3, 0, 0, 2, 2, 4, 0])


def test_gpu_and_tpu_lower_to_ragged_all_to_all():
    """Exported for cuda and tpu (not run: XLA:CPU has no ragged all-to-all), the forward holds the
    dispatch and the return exchange; the gradient holds the dispatch and both transposes (the loss is
    linear in the returned rows, so the forward return exchange is dead there)."""
    idx = ROUTES["uniform"]
    preset = resolve_mesh_arg("data=2,expert=4")
    allow = [jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")]
    with use_layout(build_mesh(preset.mesh), preset.rules):
        fwd = jax.jit(lambda x, g, d: dropless_apply(x, idx, g, d, exchange="ragged"))
        grad = jax.jit(jax.grad(_loss(lambda *a: dropless_apply(*a, exchange="ragged"), idx), argnums=(0, 1, 2)))
        texts = [
            jax.export.export(f, platforms=("cuda", "tpu"), disabled_checks=allow)(X, GATE_UP, DOWN).mlir_module()
            for f in (fwd, grad)
        ]
    assert [t.count("custom_call @ragged_all_to_all") for t in texts] == [2, 3]


def test_bad_exchange_and_indivisible_experts():
    preset = resolve_mesh_arg("data=2,expert=4")
    with use_layout(build_mesh(preset.mesh), preset.rules):
        with pytest.raises(LayoutError, match="exchange='nccl'"):
            dropless_apply(X, ROUTES["uniform"], GATE_UP, DOWN, exchange="nccl")
        with pytest.raises(LayoutError, match=r"experts \(6\) divisible by 4"):
            jax.eval_shape(dropless_apply, X, ROUTES["uniform"] % 6, GATE_UP[:6], DOWN[:6])
