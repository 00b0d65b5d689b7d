"""A backward cut in two (``jaxpar.pipeline.wgrad``): B computes the input gradient and hands W what
it needs; W computes the weight gradient from it. Checked on a layer scan: B and W together give the
pullback's own values (eagerly the same ops on the same arrays: the same bits); W's matmuls are the
weight gradients' alone (as many FLOPs as the forward's), B's none of them; a branch is cut in each
branch; an equation that computes both and cannot be cut leaves nothing for W to do on its own, and
the cut says so (``clean``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpar.pipeline.wgrad import WeightCut


def _weights(layers: int = 3, d: int = 8, f: int = 16):
    k = jax.random.split(jax.random.key(0), 3)
    w = {"a": jax.random.normal(k[0], (layers, d, f)), "b": jax.random.normal(k[1], (layers, f, d)) / 4}
    return w, jax.random.normal(k[2], (4, d))


def _layer(x, w):
    return x + jnp.tanh(x @ w["a"]) @ w["b"]


def _stack(w, x, layer=_layer):
    return jax.lax.scan(lambda x, w: (layer(x, w), None), x, w)[0]


def _cut(forward, w, x):
    y, pullback = jax.vjp(forward, w, x)
    seed = jnp.cos(y)
    leaves, tree = jax.tree.flatten(pullback)
    cut = WeightCut.of(lambda leaves, seed: jax.tree.unflatten(tree, leaves)(seed), leaves, seed)
    return cut, leaves, seed, pullback(seed)


def _dot_flops(jaxpr, times: int = 1) -> float:
    """The FLOPs of the jaxpr's matmuls, scan bodies counted once a trip, every branch of a cond."""
    total = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2.0 * times * np.prod(eqn.outvars[0].aval.shape) * np.prod([lhs[i] for i in contract])
        for param in eqn.params.values():
            for p in param if isinstance(param, tuple) else (param,):  # a cond's branches: each counted
                inner = getattr(p, "jaxpr", p)
                if hasattr(inner, "eqns"):
                    total += _dot_flops(inner, times * eqn.params.get("length", 1))
    return total


def test_b_and_w_give_the_pullbacks_values():
    w, x = _weights()
    cut, leaves, seed, (want_w, want_x) = _cut(_stack, w, x)
    assert cut.clean
    dx, handoff = cut.backward(leaves, seed)
    dw = cut.weights(leaves, seed, handoff)
    for got, want in zip(jax.tree.leaves((dw, dx)), jax.tree.leaves((want_w, want_x))):
        np.testing.assert_array_equal(got, want)
    # what B hands over: the cotangent of each layer's two matmul outputs, stacked over the layers
    assert sorted(h.shape for h in handoff) == [(3, 4, 8), (3, 4, 16)], [h.shape for h in handoff]


def test_w_runs_the_weight_gradients_matmuls_alone():
    """The forward's matmuls cost F; the pullback's 2F (input and weight gradients). B's are the input
    gradient's (F) and W's the weight gradient's (F). Mutation: W without the handoff, the whole
    pullback run for the weight gradient, costs 2F."""
    w, x = _weights()
    cut, leaves, seed, _ = _cut(_stack, w, x)
    _, handoff = cut.backward(leaves, seed)
    f = _dot_flops(jax.make_jaxpr(_stack)(w, x).jaxpr)
    b = _dot_flops(jax.make_jaxpr(cut.backward)(leaves, seed).jaxpr)
    wg = _dot_flops(jax.make_jaxpr(cut.weights)(leaves, seed, handoff).jaxpr)
    assert (b / f, wg / f) == (1.0, 1.0)
    whole = _dot_flops(cut.jaxpr.jaxpr)
    assert whole / f == 2.0


def test_a_branch_is_cut_in_each_branch():
    """A layer run inside a ``cond`` (a pipeline's padding rows skipped) is cut in each branch: the values
    are still the pullback's, and W's matmuls are still the weight gradient's alone (one forward's;
    the skipping branch has none). The handoff holds the layer branch's slots."""

    def layer(x, w):
        return jax.lax.cond(jnp.sum(w["a"]) > -1e9, _layer, lambda x, w: x, x, w)

    w, x = _weights()
    forward = lambda w, x: _stack(w, x, layer)
    cut, leaves, seed, (want_w, want_x) = _cut(forward, w, x)
    assert cut.clean
    dx, handoff = cut.backward(leaves, seed)
    got = jax.tree.leaves((cut.weights(leaves, seed, handoff), dx))
    for g, want in zip(got, jax.tree.leaves((want_w, want_x))):
        np.testing.assert_array_equal(g, want)
    assert sorted(h.shape for h in handoff) == [(3, 4, 8), (3, 4, 16)], [h.shape for h in handoff]
    f = _dot_flops(jax.make_jaxpr(forward)(w, x).jaxpr)
    assert _dot_flops(jax.make_jaxpr(cut.weights)(leaves, seed, handoff).jaxpr) / f == 1.0


def test_an_equation_computing_both_is_not_a_clean_cut():
    """An equation that computes both gradients and is not a scan or a branch (here a ``shard_map``
    around the layer) runs whole in B: the weight gradient itself would be handed over, so ``clean`` is
    False, and the values are still the pullback's."""
    mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])

    def layer(x, w):
        return jax.shard_map(_layer, mesh=mesh, in_specs=P(), out_specs=P())(x, w)

    w, x = _weights()
    cut, leaves, seed, (want_w, want_x) = _cut(lambda w, x: _stack(w, x, layer), w, x)
    assert not cut.clean
    dx, handoff = cut.backward(leaves, seed)
    got = jax.tree.leaves((cut.weights(leaves, seed, handoff), dx))
    for g, want in zip(got, jax.tree.leaves((want_w, want_x))):
        np.testing.assert_array_equal(g, want)
