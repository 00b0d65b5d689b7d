"""MoE layer against a loop-over-experts reference (single device, float32).

The reference decides routing in numpy (per token: its ranked choices, then the capacity rule walked
choice-major as the layer documents), then computes the output with jax.numpy by looping over experts
and the tokens each one serves, so ``jax.grad`` through it gives independent gradients.
"""

import dataclasses
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.errors import ConfigError
from jaxpar.execution import ExecutionConfig
from jaxpar.layers.moe import MoE, MoEConfig, RouterBias, check_execution, expert_slots, updated_bias
from jaxpar.rules import use_layout

D = 8  # width in every test but the hand-built one
TOL = dict(rtol=1e-5, atol=1e-5)


RUN = {f.name for f in dataclasses.fields(ExecutionConfig)}


def spec(**fields):
    """The layer's ``MoEConfig`` (``.layer``) and ``ExecutionConfig`` (``.run``: capacity, loss weights and
    bias rate are execution settings) from one set of fields, checked together; the namespace also holds
    every field, as the reference reads them."""
    layer = MoEConfig(**{k: v for k, v in fields.items() if k not in RUN})
    run = ExecutionConfig(**{k: v for k, v in fields.items() if k in RUN})
    check_execution(layer, run)
    return types.SimpleNamespace(**vars(layer), **vars(run), layer=layer, run=run)


def build(cfg, *, d=D, seed=0, scale=0.5, dtype="float32"):
    """A layer whose parameters are O(1) (the 0.02 init would make any comparison pass)."""
    m = MoE(d, cfg.layer, execution=cfg.run, dtype=dtype, param_dtype="float32", rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed + 100)
    for _, var in nnx.iter_graph(m):
        if isinstance(var, nnx.Param):
            var[...] = jnp.asarray(scale * rng.normal(size=var.shape), jnp.float32)
    return m


forward = nnx.jit(lambda m, x: m(x))


def params_of(m):
    return jax.tree.map(jnp.asarray, nnx.to_pure_dict(nnx.state(m, nnx.Param)))


# ------------------------------------------------------------------------------------ reference
def ref_swiglu(gate_up, down, v):
    """gate_up [D, 2, F], down [F, D], v [n, D]."""
    return (jax.nn.silu(v @ gate_up[:, 0]) * (v @ gate_up[:, 1])) @ down


def np_scores(p, x, router):
    logits = np.asarray(x, np.float32).reshape(-1, x.shape[-1]) @ np.asarray(p["router"], np.float32)
    if router == "sigmoid":
        return 1 / (1 + np.exp(-logits))
    z = np.exp(logits - logits.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def ref_plan(p, x, cfg, bias):
    """Token choice in numpy: choices [N][k] (best first) and kept [N, k] under the capacity rule."""
    sel = np_scores(p, x, cfg.router) + np.asarray(bias)
    n, e, k = sel.shape[0], cfg.num_experts, cfg.top_k
    per_group = e // cfg.num_groups
    choices = []
    for i in range(n):
        allowed = list(range(e))
        if cfg.router == "sigmoid" and cfg.topk_groups < cfg.num_groups:
            group_score = [sum(sorted(sel[i, g * per_group : (g + 1) * per_group])[-2:]) for g in range(cfg.num_groups)]
            best = sorted(range(cfg.num_groups), key=lambda g: -group_score[g])[: cfg.topk_groups]
            allowed = [x for g in best for x in range(g * per_group, (g + 1) * per_group)]
        choices.append(sorted(allowed, key=lambda x: -sel[i, x])[:k])
    kept = np.ones((n, k), bool)
    if cfg.capacity_factor is not None:
        t = x.shape[1]  # a group is one sequence: capacity and priority per row
        cap = max(1, math.ceil(cfg.capacity_factor * t * k / e))
        for row in range(n // t):
            used = [0] * e
            for j in range(k):  # every token's 1st choice, then every token's 2nd, ...
                for i in range(row * t, (row + 1) * t):
                    kept[i, j] = used[choices[i][j]] < cap
                    used[choices[i][j]] += kept[i, j]
    return choices, kept


def ref_token_choice(p, x, cfg, choices, kept):
    """-> y [B, T, D], aux, z: loop over experts; only jax.numpy on the traced values."""
    xs = x.reshape(-1, x.shape[-1])
    n, e, k = xs.shape[0], cfg.num_experts, cfg.top_k
    logits = xs @ p["router"]
    scores = jax.nn.softmax(logits) if cfg.router == "softmax" else jax.nn.sigmoid(logits)
    weight = scores[np.arange(n)[:, None], np.array(choices)]  # [N, k]
    weight = weight / weight.sum(-1, keepdims=True) if cfg.norm_topk else weight
    weight = weight * cfg.routed_scale
    y = jnp.zeros_like(xs)
    for ex in range(e):
        pairs = [(i, j) for i in range(n) for j in range(k) if choices[i][j] == ex and kept[i, j]]
        if pairs:
            rows, cols = np.array(pairs).T
            out = ref_swiglu(p["gate_up"][ex], p["down"][ex], xs[rows])
            y = y.at[rows].add(weight[rows, cols][:, None] * out)
    if "shared" in p:
        y = y + ref_swiglu(p["shared"]["gate_up"], p["shared"]["down"], xs)
    probs = scores if cfg.router == "softmax" else scores / scores.sum(-1, keepdims=True)
    f = np.bincount(np.ravel(choices), minlength=e) / (n * k)
    aux = cfg.aux_loss_weight * e * jnp.sum(f * probs.mean(0))
    z = cfg.router_z_loss_weight * jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    return y.reshape(x.shape), aux, z


def ref_choice_plan(p, x, cfg):
    """Expert choice in numpy: [(expert, tokens)] — in each sequence, each expert's C best tokens."""
    s = np_scores(p, x, "softmax")
    t = x.shape[1]
    cap = min(t, max(1, math.ceil(cfg.capacity_factor * t * cfg.top_k / cfg.num_experts)))
    return [
        (ex, list(row * t + np.argsort(-s[row * t : (row + 1) * t, ex], kind="stable")[:cap]))
        for row in range(s.shape[0] // t)
        for ex in range(cfg.num_experts)
    ]


def ref_expert_choice(p, x, cfg, picks):
    xs = x.reshape(-1, x.shape[-1])
    logits = xs @ p["router"]
    scores = jax.nn.softmax(logits)
    y = jnp.zeros_like(xs)
    for ex, tokens in picks:
        rows = np.array(tokens)
        out = ref_swiglu(p["gate_up"][ex], p["down"][ex], xs[rows])
        y = y.at[rows].add(scores[rows, ex][:, None] * out)
    z = cfg.router_z_loss_weight * jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    return y.reshape(x.shape), jnp.zeros(()), z


# ------------------------------------------------------------------------------------- harness
def layer_run(m, x, r):
    """Output, stats and gradients of sum(y·r) + aux + z w.r.t. every parameter and x."""
    graphdef, params, rest = nnx.split(m, nnx.Param, ...)

    def loss(params, x):
        y, stats = nnx.merge(graphdef, params, rest)(x)
        return jnp.sum(y * r) + stats.aux_loss + stats.router_z_loss, (y, stats)

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (_, (y, stats)), (gp, gx) = grad(params, x)
    return y, stats, nnx.to_pure_dict(gp), gx


def ref_run(fn, p, x, r):
    def loss(p, x):
        y, aux, z = fn(p, x)
        return jnp.sum(y * r) + aux + z, (y, aux, z)

    (_, (y, aux, z)), (gp, gx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(p, x)
    return y, aux, z, gp, gx


def assert_matches_reference(m, x, fn):
    r = jax.random.normal(jax.random.key(7), x.shape)
    p = params_of(m)
    y, stats, gp, gx = layer_run(m, x, r)
    ry, raux, rz, rgp, rgx = ref_run(fn, p, x, r)
    np.testing.assert_allclose(y, ry, **TOL)
    np.testing.assert_allclose(stats.aux_loss, raux, **TOL)
    np.testing.assert_allclose(stats.router_z_loss, rz, **TOL)
    np.testing.assert_allclose(gx, rgx, **TOL)
    flat, ref_flat = jax.tree_util.tree_leaves_with_path(gp), dict(jax.tree_util.tree_leaves_with_path(rgp))
    assert len(flat) == len(ref_flat) >= 3
    for path, g in flat:
        assert float(jnp.abs(g).max()) > 0, path
        np.testing.assert_allclose(g, ref_flat[path], err_msg=str(path), **TOL)
    return stats


def random_x(seed=1, b=2, t=6, d=D):
    return jax.random.normal(jax.random.key(seed), (b, t, d))


# ----------------------------------------------------------------------------------------- tests
def test_capacity_drops_follow_choice_major_priority():
    """Capacity is per sequence (2 rows of 6 tokens): C = ceil(1.25·6·2/4) = 4. In each row tokens 0-2
    rank expert 1 then 0, tokens 3-5 expert 0 then 1. Choice-major: expert 1 serves the 1st choices of
    0-2, then the 2nd choice of 3 only; expert 0 the 1st choices of 3-5, then the 2nd choice of 0 only.
    (Token-major would drop the 1st choices of tokens 4 and 5.)"""
    cfg = spec(num_experts=4, top_k=2, mlp_dim=6, capacity_factor=1.25)
    m = build(cfg, scale=0.3)
    m.router[0] = jnp.array([-2.0, 2.0, 0.0, 0.0])
    m.router[1] = jnp.array([4.0, 4.0, -4.0, -4.0])
    x = random_x().reshape(12, D)
    x = x.at[:, 0].set(jnp.where(jnp.arange(12) % 6 < 3, 1.0, -1.0)).at[:, 1].set(1.0).reshape(2, 6, D)
    choices, kept = ref_plan(params_of(m), x, cfg, np.zeros(4))
    assert choices == ([[1, 0]] * 3 + [[0, 1]] * 3) * 2
    want = {(i, 1) for i in (1, 2, 4, 5, 7, 8, 10, 11)}
    assert {(i, j) for i, j in zip(*np.nonzero(~kept))} == want
    idx = jnp.array(choices, jnp.int32).reshape(2, 6, 2)
    layer_kept = np.asarray(expert_slots(idx, 4) < 4).reshape(12, 2)
    assert {(i, j) for i, j in zip(*np.nonzero(~layer_kept))} == want
    stats = assert_matches_reference(m, x, lambda p, x: ref_token_choice(p, x, cfg, choices, kept))
    assert float(stats.dropped_fraction) == pytest.approx(8 / 24)
    np.testing.assert_array_equal(stats.expert_load, [12, 12, 0, 0])


def test_capacity_drops_the_same_assignments_in_any_storage_order():
    """The zig-zag order of context parallelism stores each sequence permuted; ``index`` gives every
    stored token's original place, and capacity ranks in that order. So a permuted sequence drops the
    same assignments and gives the same outputs, permuted (capacity 0.75: some must drop)."""
    cfg = spec(num_experts=4, top_k=2, mlp_dim=6, capacity_factor=0.75)
    m, x = build(cfg), random_x()
    order = np.random.default_rng(3).permutation(x.shape[1])
    index = jnp.broadcast_to(jnp.asarray(order, jnp.int32), x.shape[:2])
    y, stats = forward(m, x)
    y_perm, stats_perm = nnx.jit(lambda m, x, i: m(x, i))(m, x[:, order], index)
    assert float(stats.dropped_fraction) > 0.1  # 4 of the 24 assignments drop
    np.testing.assert_allclose(np.asarray(y_perm), np.asarray(y)[:, order], **TOL)
    assert float(stats_perm.dropped_fraction) == float(stats.dropped_fraction)
    idx = jnp.asarray(np.random.default_rng(4).integers(0, 4, (2, 6, 2)), jnp.int32)
    perm = np.random.default_rng(5).permutation(6)
    stored = expert_slots(idx[:, perm], 4, jnp.broadcast_to(jnp.asarray(perm, jnp.int32), (2, 6)))
    np.testing.assert_array_equal(np.asarray(stored), np.asarray(expert_slots(idx, 4))[:, perm])
    unranked = np.asarray(expert_slots(idx[:, perm], 4))  # stored order taken as token order
    assert not np.array_equal(unranked, np.asarray(stored))


def test_capacity_random_routing_matches_reference():
    cfg = spec(num_experts=4, top_k=2, mlp_dim=6, capacity_factor=0.75)
    m, x = build(cfg), random_x()
    choices, kept = ref_plan(params_of(m), x, cfg, np.zeros(4))
    stats = assert_matches_reference(m, x, lambda p, x: ref_token_choice(p, x, cfg, choices, kept))
    assert 0 < float(stats.dropped_fraction) == pytest.approx(1 - kept.mean())


@pytest.mark.parametrize("norm_topk, shared", [(True, 0), (False, 2)])
def test_softmax_dropless_matches_reference(norm_topk, shared):
    cfg = spec(
        num_experts=4,
        top_k=2,
        mlp_dim=6,
        capacity_factor=None,
        norm_topk=norm_topk,
        num_shared_experts=shared,
        shared_mlp_dim=3,
    )
    m, x = build(cfg), random_x()
    choices, kept = ref_plan(params_of(m), x, cfg, np.zeros(4))
    stats = assert_matches_reference(m, x, lambda p, x: ref_token_choice(p, x, cfg, choices, kept))
    assert float(stats.dropped_fraction) == 0.0
    np.testing.assert_array_equal(stats.expert_load, np.bincount(np.ravel(choices), minlength=4))


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_sigmoid_group_limited_with_selection_bias(capacity_factor):
    cfg = spec(
        num_experts=8,
        top_k=3,
        mlp_dim=6,
        router="sigmoid",
        num_groups=4,
        topk_groups=2,
        routed_scale=2.5,
        capacity_factor=capacity_factor,
    )
    m, x = build(cfg), random_x()
    bias = 0.4 * jax.random.normal(jax.random.key(3), (8,))
    m.router_bias[...] = bias
    p = params_of(m)
    choices, kept = ref_plan(p, x, cfg, bias)
    assert choices != ref_plan(p, x, cfg, np.zeros(8))[0], "the bias must change some selection"
    ungrouped = spec(num_experts=8, top_k=3, mlp_dim=6, router="sigmoid", capacity_factor=None)
    assert choices != ref_plan(p, x, ungrouped, bias)[0], "group limiting must change some selection"
    assert all(len({c // 2 for c in cs}) <= 2 for cs in choices)
    assert_matches_reference(m, x, lambda p, x: ref_token_choice(p, x, cfg, choices, kept))


def test_expert_choice_matches_reference():
    cfg = spec(num_experts=4, top_k=2, mlp_dim=6, router="expert_choice", capacity_factor=0.25)
    m, x = build(cfg), random_x()
    picks = ref_choice_plan(params_of(m), x, cfg)
    assert [len(t) for _, t in picks] == [1] * 8  # per sequence: C = ceil(0.25·6·2/4) = 1
    stats = assert_matches_reference(m, x, lambda p, x: ref_expert_choice(p, x, cfg, picks))
    unpicked = 1 - len({t for _, ts in picks for t in ts}) / 12
    assert unpicked > 0 and float(stats.dropped_fraction) == pytest.approx(unpicked)
    np.testing.assert_array_equal(stats.expert_load, [2] * 4)
    assert float(stats.aux_loss) == 0.0


def test_losses_and_load_on_hand_built_logits():
    """Router = identity, so each token's logits are its input row."""
    cfg = spec(num_experts=4, top_k=2, mlp_dim=3, capacity_factor=None, aux_loss_weight=0.5, router_z_loss_weight=0.25)
    m = MoE(4, cfg.layer, execution=cfg.run, dtype="float32", param_dtype="float32", rngs=nnx.Rngs(0))
    m.router[...] = jnp.eye(4)
    logits = np.array([[3, 2, 0, 0], [0, 3, 2, 0], [3, 0, 0, 2], [2, 0, 3, 0]], np.float32)
    _, stats = forward(m, jnp.asarray(logits)[None])
    np.testing.assert_array_equal(stats.expert_load, [3, 2, 2, 1])  # top-2 sets {0,1} {1,2} {0,3} {0,2}
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    aux = 0.5 * 4 * np.sum(np.array([3, 2, 2, 1]) / 8 * probs.mean(0))
    z = 0.25 * np.mean(np.log(np.exp(logits).sum(-1)) ** 2)
    assert float(stats.aux_loss) == pytest.approx(aux, rel=1e-6)
    assert float(stats.router_z_loss) == pytest.approx(z, rel=1e-6)
    assert float(stats.dropped_fraction) == 0.0


def test_shared_experts_add_their_swiglu_output():
    cfg = spec(num_experts=4, top_k=2, mlp_dim=6, num_shared_experts=2, shared_mlp_dim=3)
    m, x = build(cfg), random_x()
    assert m.shared.gate_up.shape == (D, 2, 6)
    y, _ = forward(m, x)
    shared = nnx.jit(lambda s, x: s(x))(m.shared, x)
    m.shared.down[...] = jnp.zeros_like(m.shared.down[...])
    np.testing.assert_allclose(y - forward(m, x)[0], shared, **TOL)


def test_bias_update_is_outside_the_parameters():
    np.testing.assert_allclose(updated_bias(jnp.zeros(4), jnp.array([3.0, 1, 2, 2]), 0.1), [-0.1, 0.1, 0, 0])
    stacked = updated_bias(jnp.zeros((2, 3)), jnp.array([[1.0, 2, 3], [0, 0, 3]]), 1.0)
    np.testing.assert_allclose(stacked, [[1, 0, -1], [1, 1, -1]])
    m = build(spec(num_experts=4, top_k=1, mlp_dim=6, bias_update_rate=0.5))
    assert "router_bias" not in nnx.to_pure_dict(nnx.state(m, nnx.Param))
    assert isinstance(m.router_bias, RouterBias) and not isinstance(m.router_bias, nnx.Param)
    nnx.jit(lambda m, load: m.update_bias(load))(m, jnp.array([4.0, 0, 0, 0]))
    np.testing.assert_allclose(m.router_bias[...], [-0.5, 0.5, 0.5, 0.5])


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(num_experts=4, top_k=5), ["model.moe.top_k=5 exceeds model.moe.num_experts=4"]),
        (dict(capacity_factor=0.0), ["execution.capacity_factor=0.0"]),
        (dict(capacity_factor=-1.0), ["execution.capacity_factor=-1.0"]),
        (dict(num_experts=6, num_groups=4), ["moe.num_groups=4", "moe.num_experts=6"]),
        (dict(num_groups=2, topk_groups=3), ["moe.topk_groups=3", "moe.num_groups=2"]),
        (dict(num_experts=8, num_groups=4, topk_groups=1, top_k=3), ["moe.top_k=3", "moe.topk_groups=1"]),
        (dict(router="sigmoyd"), ["moe.router='sigmoyd'", "did you mean 'sigmoid'"]),
        (dict(router="expert_choice", capacity_factor=None), ["execution.capacity_factor=None", "moe.router"]),
        (dict(num_shared_experts=1), ["moe.num_shared_experts=1", "moe.shared_mlp_dim"]),
    ],
)
def test_bad_config_names_the_field(kwargs, words):
    base = dict(num_experts=8, top_k=2, mlp_dim=4)
    with pytest.raises(ConfigError) as err:
        spec(**{**base, **kwargs})
    for w in words:
        assert w in str(err.value)


@pytest.mark.parametrize(
    "extra",
    [
        dict(),
        dict(capacity_factor=None),
        dict(router="expert_choice"),
        dict(router="sigmoid", num_groups=2, num_shared_experts=1, shared_mlp_dim=4),
    ],
)
def test_bf16_compute(extra):
    cfg = spec(**{**dict(num_experts=4, top_k=2, mlp_dim=6), **extra})
    m = MoE(D, cfg.layer, execution=cfg.run, dtype=jnp.bfloat16, param_dtype="float32", rngs=nnx.Rngs(0))
    y, stats = forward(m, random_x().astype(jnp.bfloat16))
    assert y.dtype == jnp.bfloat16 and y.shape == (2, 6, D) and bool(jnp.isfinite(y).all())
    assert stats.aux_loss.dtype == stats.router_z_loss.dtype == jnp.float32


def test_logical_names_under_a_mesh():
    """Experts split over ``expert`` (data=2 × expert=4, rules composed as for any mesh spec): the
    program with its all-to-alls gives the single-device answer, per-sequence capacity included."""
    from jaxpar.mesh import build_mesh
    from jaxpar.meshes import resolve_mesh_arg

    preset = resolve_mesh_arg("data=2,expert=4")
    cfg = spec(num_experts=4, top_k=2, mlp_dim=6, capacity_factor=1.0)
    m, x = build(cfg), random_x(b=8)
    want, want_stats = forward(m, x)
    assert float(want_stats.dropped_fraction) > 0  # capacity binds, so the grouping matters
    with use_layout(build_mesh(preset.mesh), preset.rules):
        got, stats = nnx.jit(lambda m, x: m(x))(m, x)
    np.testing.assert_allclose(got, want, **TOL)
    assert float(stats.dropped_fraction) == pytest.approx(float(want_stats.dropped_fraction))
