"""The attention oracle checked on its own, and the context-attention path where kv heads are replicated.

1. ``tests/attention_oracle.py`` against ``jax.nn.dot_product_attention`` on what that function
   supports: causal, local window, GQA/MQA, forward and gradients w.r.t. q, k, v, fp32, within a
   multiple of the oracle's own noise (its keys in another order: ``attention_oracle.own_noise``,
   tests/noise.py). Also its mask rules against a brute-force loop, its fully masked rows (0, with
   finite gradients), and mutants: a mask with one deliberate bug changes its results by far more
   than the bound, so a kernel with that bug would fail the comparison.
2. ``context_attention`` under ``make_layout(tiny, "sequence=2,tensor=4")``. tiny has 8 query heads and
   2 kv heads; 2 < tensor=4, so ``check_layout`` replicates kv heads over ``tensor`` and
   ``context_attention`` keeps each device's own kv head (``_own_kv_head``). Ring and "none" are
   compared with the oracle, forward and gradients, within the same bound. Ring is also run with
   zig-zag storage: the order is the model's ``storage_order``, ``index`` carries it, and the results
   are un-permuted. Ulysses cannot run this
   layout: each device keeps one kv head, which a sequence axis of 2 cannot split, and it refuses
   while tracing, before anything compiles.
"""

import functools

import attention_oracle as oracle
import jax
import numpy as np
import pytest
from noise import FLOOR, MULTIPLE, MUTATION_GAP, array_ratios, check_arrays, record

from jaxpar.execution import ExecutionConfig
from jaxpar.layout import make_layout
from jaxpar.meshes import resolve_mesh_arg
from jaxpar.models import get_model_preset
from jaxpar.parallel.attention import context_attention, storage_order
from jaxpar.rules import LayoutError

B, T = 2, 16
MESH = "sequence=2,tensor=4"


def _inputs(n_heads, n_kv, head_dim, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, n_heads, head_dim), np.float32)
    k, v = (rng.standard_normal((B, T, n_kv, head_dim), np.float32) for _ in range(2))
    ct = rng.standard_normal((B, T, n_heads, head_dim), np.float32)  # output cotangent
    return q, k, v, ct


NATURAL = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))


def _assert_close(got, q, k, v, ct, allowed, case):
    """``got`` (out, dq, dk, dv) within the oracle's noise bound of the oracle's on ``allowed``."""
    want = oracle.value_and_grads(q, k, v, ct, allowed)
    check_arrays(got, want, oracle.own_noise(q, k, v, ct, allowed), "context", case)


# ------------------------------------------------------------------------ the oracle on its own
@functools.partial(jax.jit, static_argnames=("causal", "window"))
def _jax_nn(q, k, v, ct, *, causal, window):
    local = None if window is None else (window - 1, 0 if causal else T)  # (left, right)
    attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, local_window_size=local)
    out, vjp = jax.vjp(attn, q, k, v)
    return (out, *vjp(ct))


JAX_NN_CASES = [  # kv heads, causal, window
    (8, True, None),
    (2, True, None),
    (1, True, 5),
    (2, False, None),
    (2, False, 6),
]


@pytest.mark.parametrize("n_kv,causal,window", JAX_NN_CASES)
def test_oracle_matches_jax_nn(n_kv, causal, window):
    q, k, v, ct = _inputs(8, n_kv, 8, seed=n_kv)
    got = _jax_nn(q, k, v, ct, causal=causal, window=window)
    allowed = oracle.mask(NATURAL, NATURAL, causal=causal, window=window)
    _assert_close(got, q, k, v, ct, allowed, f"jax.nn.dot_product_attention K={n_kv} causal={causal} w={window}")


def test_mask_rules_match_a_loop():
    """Each rule as the docstrings state it, token by token, on shuffled indices."""
    rng = np.random.default_rng(1)
    qi, ki = rng.permutation(12)[None], rng.permutation(12)[None]
    qs, ks = rng.integers(0, 3, (1, 12)), rng.integers(0, 3, (1, 12))
    for causal, window, segments in [(True, None, False), (True, 4, False), (False, 4, True), (True, 1, True)]:
        got = oracle.mask(qi, ki, *((qs, ks) if segments else ()), causal=causal, window=window)
        for t in range(12):
            for s in range(12):
                seen = ki[0, s] <= qi[0, t] if causal else True
                if window is not None:  # at most window - 1 tokens back (the past only)
                    seen = seen and qi[0, t] - ki[0, s] <= window - 1
                if segments:
                    seen = seen and qs[0, t] == ks[0, s]
                assert got[0, t, s] == seen, (causal, window, segments, t, s)


def test_fully_masked_rows_are_zero():
    """Queries whose segment has no key: output 0, gradients finite (no NaN from an all -inf row)."""
    q, k, v, ct = _inputs(4, 2, 8)
    q_seg = np.where(np.arange(T) < 5, 7, 0)[None].repeat(B, 0)  # segment 7 has no key
    kv_seg = np.zeros((B, T), np.int64)
    out, dq, dk, dv = oracle.value_and_grads(q, k, v, ct, oracle.mask(NATURAL, NATURAL, q_seg, kv_seg))
    assert np.all(np.asarray(out)[:, :5] == 0) and np.all(np.asarray(dq)[:, :5] == 0)
    assert np.abs(np.asarray(out)[:, 5:]).min() > 0
    assert all(np.isfinite(np.asarray(g)).all() for g in (dq, dk, dv))


def _segments(first_of_second: int):
    return np.broadcast_to((np.arange(T) >= first_of_second).astype(np.int32), (B, T))


MUTANTS = {  # name: () -> (the rule's mask, the mask of a kernel with one deliberate bug)
    "window-off-by-one": lambda: (oracle.mask(NATURAL, NATURAL, window=5), oracle.mask(NATURAL, NATURAL, window=6)),
    "causal-without-diagonal": lambda: (
        oracle.mask(NATURAL, NATURAL),
        oracle.mask(NATURAL, NATURAL) & ~np.eye(T, dtype=bool),
    ),
    "segment-boundary-moved": lambda: (
        oracle.mask(NATURAL, NATURAL, _segments(9), _segments(9)),
        oracle.mask(NATURAL, NATURAL, _segments(10), _segments(10)),
    ),
}


@pytest.mark.parametrize("name", MUTANTS)
def test_oracle_catches_a_mutant_mask(name):
    """A kernel with the bug computes the mutant; it misses the oracle's noise bound by MUTATION_GAP× or
    more in out, dq, dk or dv."""
    q, k, v, ct = _inputs(8, 2, 8)
    rule, bug = MUTANTS[name]()
    right, wrong = (oracle.value_and_grads(q, k, v, ct, m) for m in (rule, bug))
    noise = oracle.own_noise(q, k, v, ct, rule)
    tol = max(MULTIPLE * noise, FLOOR["grad"])
    factor = max(array_ratios(wrong, right, ("out", "dq", "dk", "dv")).values()) / tol
    record(
        "context",
        f"mutation: {name}",
        noise=dict(array=noise),
        tolerance=dict(array=tol),
        factor=factor,
        error=dict(array=factor * tol),
    )
    assert factor >= MUTATION_GAP, (name, factor)


# ------------------------------------------------------------- context attention, kv heads replicated
@functools.cache
def _layout(strategy):
    cfg, execution = get_model_preset("tiny"), ExecutionConfig(context_parallel=strategy)
    return cfg, make_layout(cfg, resolve_mesh_arg(MESH), batch=B, seq=T, execution=execution)


@functools.cache
def _context_fn(strategy, window):
    """jit: (q, k, v, ct, index) -> (out, dq, dk, dv) of context_attention under the layout's rules."""
    _, layout = _layout(strategy)

    @jax.jit
    def run(q, k, v, ct, index):
        with layout.activate_trace():
            attn = lambda q, k, v: context_attention(q, k, v, index, strategy=strategy, window=window)
            out, vjp = jax.vjp(attn, q, k, v)
            return (out, *vjp(ct))

    return run


def _place(layout, q, k, v, ct, index):
    qs = layout.sharding(("batch", "inner_length", "act_heads", None))
    kvs = layout.sharding(("batch", "inner_length", "act_kv_heads", None))
    return (
        *(jax.device_put(a, s) for a, s in ((q, qs), (k, kvs), (v, kvs), (ct, qs))),
        jax.device_put(index, layout.sharding(("batch", "inner_length"))),
    )


CONTEXT_CASES = [("none", False, None), ("ring", False, None), ("ring", True, None), ("ring", True, 5)]


@pytest.mark.parametrize(
    "strategy,zigzag,window",
    CONTEXT_CASES,
    ids=[f"{s}-{'zigzag' if z else 'natural'}{'-w' + str(w) if w else ''}" for s, z, w in CONTEXT_CASES],
)
def test_context_attention_with_replicated_kv_heads(strategy, zigzag, window):
    cfg, layout = _layout(strategy)
    rules = layout.rules
    assert (rules["act_heads"], rules["act_kv_heads"], rules["inner_length"]) == (("tensor",), (), ("sequence",))
    q, k, v, ct = _inputs(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, seed=3)
    with layout.activate():
        order = storage_order(T, strategy, "zigzag") if zigzag else np.arange(T)
    assert sorted(order) == list(range(T)) and (list(order) != list(range(T))) == zigzag
    store = lambda a: np.ascontiguousarray(a[:, order])
    index = np.broadcast_to(order.astype(np.int32), (B, T))
    got = _context_fn(strategy, window)(*_place(layout, *map(store, (q, k, v, ct)), index))
    got = [np.asarray(a)[:, np.argsort(order)] for a in got]
    allowed = oracle.mask(NATURAL, NATURAL, window=window)
    _assert_close(got, q, k, v, ct, allowed, f"context_attention {strategy} zigzag={zigzag} w={window}")


def test_ulysses_refuses_replicated_kv_heads_before_compiling():
    """Each device keeps one of the 2 kv heads (tensor=4), and one head cannot be split over sequence=2.
    The refusal comes from ``ulysses_check`` while tracing (``jax.eval_shape``: nothing compiles)."""
    cfg, ulysses = get_model_preset("tiny"), ExecutionConfig(context_parallel="ulysses")
    q, k, v, ct = _inputs(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    with pytest.raises(LayoutError, match=r"ulysses over sequence=2 needs num_kv_heads"):
        layout = make_layout(cfg, resolve_mesh_arg(MESH), batch=B, seq=T, execution=ulysses)
        assert layout.rules["act_kv_heads"] == ()
        placed = _place(layout, q, k, v, ct, NATURAL)

        def attend(q, k, v, index):
            with layout.activate_trace():
                return context_attention(q, k, v, index, strategy="ulysses")

        jax.eval_shape(jax.jit(attend), *placed[:3], placed[4])


def test_make_layout_refuses_ulysses_with_replicated_kv_heads():
    """Refused before anything compiles: with kv heads replicated over tensor each device keeps one kv
    head (``_own_kv_head``), which sequence=2 cannot split."""
    cfg, ulysses = get_model_preset("tiny"), ExecutionConfig(context_parallel="ulysses")
    with pytest.raises(LayoutError, match=r"ulysses over sequence=2 needs num_kv_heads"):
        make_layout(cfg, resolve_mesh_arg(MESH), batch=B, seq=T, execution=ulysses)
