"""Ulysses attention (jaxpar.parallel.ulysses) against ``tests/attention_oracle.py``.

The oracle shares no code with jaxpar: explicit numpy masks from token indices and einsums over
repeated K/V. Every case runs the kernel inside ``jax.shard_map`` over a 1-D ``sequence`` mesh of n
simulated CPU devices, in float32, and compares the output and the gradients of sum(out · cotangent)
with respect to q, k and v with the oracle on the full arrays (natural token order), within a multiple
of the oracle's own noise (its keys in another order: ``attention_oracle.own_noise``, tests/noise.py).
Zig-zag cases store the sequence permuted by ``zigzag_order`` (inputs, indices and segments) and
un-permute the results.
GQA cases also check the head bookkeeping directly: with v constant per kv head, query head h must
output the value of kv head h // G.
"""

import functools
import zlib

import attention_oracle as oracle
import jax
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from noise import FLOOR, MULTIPLE, MUTATION_GAP, array_ratios, check_arrays, record

from jaxpar.analysis.hlo import parse_collectives
from jaxpar.parallel.common import zigzag_order
from jaxpar.parallel.ulysses import ulysses_attention, ulysses_check
from jaxpar.rules import LayoutError

B, T, H = 2, 32, 8
SEQ = P(None, "sequence", None, None)
IDX = P(None, "sequence")


def seq_mesh(n):
    return jax.make_mesh((n,), ("sequence",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])


def sharded_fn(n, *, segments, **kw):
    """jit(shard_map(ulysses)) over n devices: (q, k, v, q_index, kv_index[, q_seg, kv_seg]) -> out."""
    body = functools.partial(ulysses_attention, axis_name="sequence", **kw)
    n_args = 7 if segments else 5
    specs = dict(in_specs=(SEQ,) * 3 + (IDX,) * (n_args - 3), out_specs=SEQ)
    return jax.shard_map(body, mesh=seq_mesh(n), check_vma=kw.get("implementation") != "splash", **specs)


def value_and_grads(f):
    """(q, k, v, ct, *rest) -> (out, (dq, dk, dv)) with the loss sum(f(q, k, v, *rest) · ct)."""

    def run(q, k, v, ct, *rest):
        out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, *rest), q, k, v)
        return out, vjp(ct)

    return jax.jit(run)


def make_inputs(seed, n_heads, n_kv, segments):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, n_heads, H), np.float32)
    k = rng.standard_normal((B, T, n_kv, H), np.float32)
    v = rng.standard_normal((B, T, n_kv, H), np.float32)
    ct = rng.standard_normal((B, T, n_heads, H), np.float32)
    index = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy()
    seg = None
    if segments:  # packed documents: 1-3 boundaries per row, at random places
        starts = np.zeros((B, T), np.int32)
        for b in range(B):
            starts[b, rng.choice(np.arange(1, T), size=rng.integers(1, 4), replace=False)] = 1
        seg = np.cumsum(starts, axis=1, dtype=np.int32)
    return q, k, v, ct, index, seg


CASES = [
    # id,                    n, N, K, causal, window, segments, zigzag, replicate_kv
    ("mha-n2-causal", 2, 8, 8, True, None, False, False, False),
    ("mha-n4-full-zigzag", 4, 8, 8, False, None, False, True, False),
    ("mha-n8-causal-zigzag", 8, 8, 8, True, None, True, True, False),
    ("gqa84-n2-segments", 2, 8, 4, True, None, True, False, False),
    ("gqa84-n4-window-zz", 4, 8, 4, True, 5, True, True, False),
    ("gqa82-n2-full-window", 2, 8, 2, False, 7, False, False, False),
    ("rep-k2-n4-causal-zz", 4, 8, 2, True, None, False, True, True),
    ("rep-mqa-n4-segments", 4, 8, 1, True, None, True, False, True),
    ("rep-k6-n4-straddle", 4, 12, 6, True, 9, False, True, True),
]


SPLASH_CASES = [c for c in CASES if c[0] in ("mha-n8-causal-zigzag", "gqa84-n2-segments", "gqa84-n4-window-zz")]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_oracle(case):
    check_case(case)


@pytest.mark.parametrize("case", SPLASH_CASES, ids=[c[0] for c in SPLASH_CASES])
def test_splash_on_the_gathered_heads_matches_oracle(case):
    """``implementation="splash"``: the Pallas kernel (interpreted) on the gathered sequence, put back in
    its original order from zig-zag storage first."""
    check_case(case, implementation="splash")


def test_splash_in_stored_order_is_caught(monkeypatch):
    """The mutation: splash over the zig-zag stored order as if it were the original (a wrong
    permutation). Its errors miss the bound by MUTATION_GAP× or more."""
    import jaxpar.parallel.ulysses as ulysses
    from jaxpar.parallel.flash import splash_attention

    stored = lambda q, k, v, index, segments, **kw: splash_attention(q, k, v, segments=segments, **kw)
    monkeypatch.setattr(ulysses, "_splash_in_order", stored)
    got, want, noise = run_case(SPLASH_CASES[0], implementation="splash")
    factor = max(array_ratios(got, want, ("out", "dq", "dk", "dv")).values()) / max(MULTIPLE * noise, FLOOR["grad"])
    record("context", "mutation: ulysses splash in stored order", factor=factor)
    assert factor >= MUTATION_GAP, factor


def _stored(case, implementation):
    """(inputs, the kernel over n devices, the storage order) of ``case``."""
    _, n, nh, nkv, causal, window, segments, zigzag, replicate = case
    inputs = make_inputs(zlib.crc32(case[0].encode()), nh, nkv, segments)
    order = zigzag_order(T, n) if zigzag else np.arange(T)
    f = sharded_fn(
        n, segments=segments, replicate_kv=replicate, implementation=implementation, causal=causal, window=window
    )
    return inputs, value_and_grads(f), order


def run_case(case, *, implementation=None):
    """(the kernel's out and gradients in natural order, the oracle's, the oracle's own noise)."""
    (q, k, v, ct, index, seg), kernel, order = _stored(case, implementation)
    allowed = oracle.mask(index, index, seg, seg, causal=case[4], window=case[5])  # natural order, one device
    store = lambda x: x[:, order]
    seg_args = (store(seg), store(seg)) if seg is not None else ()
    out, grads = kernel(store(q), store(k), store(v), store(ct), store(index), store(index), *seg_args)
    got = [np.asarray(a)[:, np.argsort(order)] for a in (out, *grads)]
    return got, oracle.value_and_grads(q, k, v, ct, allowed), oracle.own_noise(q, k, v, ct, allowed)


def check_case(case, *, implementation=None):
    got, want, noise = run_case(case, implementation=implementation)
    check_arrays(got, want, noise, "context", f"ulysses {case[0]}" + (f" {implementation}" if implementation else ""))

    # Head bookkeeping: v = kv-head number everywhere, so query head h must output h // G.
    (q, k, v, ct, index, seg), kernel, order = _stored(case, implementation)
    store, nh, nkv = (lambda x: x[:, order]), case[2], case[3]
    seg_args = (store(seg), store(seg)) if seg is not None else ()
    v_label = np.broadcast_to(np.arange(nkv, dtype=np.float32)[None, None, :, None], v.shape).copy()
    out, _ = kernel(store(q), store(k), v_label, store(ct), store(index), store(index), *seg_args)
    want = np.broadcast_to((np.arange(nh) // (nh // nkv)).astype(np.float32)[None, None, :, None], q.shape)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6, atol=1e-6)


def test_too_few_kv_heads_is_a_layout_error():
    q, k, v, _, index, _ = make_inputs(0, 8, 2, False)
    f = sharded_fn(4, segments=False)
    with pytest.raises(LayoutError, match=r"sequence=4.*num_kv_heads \(2 on this device\).*replicate_kv"):
        jax.eval_shape(f, q, k, v, index, index)  # trace time: nothing compiled or run
    with pytest.raises(LayoutError, match=r"num_kv_heads \(2 on this device\)"):
        ulysses_check(8, 2, 4, replicate_kv=False)
    ulysses_check(8, 2, 4, replicate_kv=True)
    ulysses_check(8, 4, 4, replicate_kv=False)


def test_query_heads_not_divisible_is_a_layout_error():
    q, k, v, _, index, _ = make_inputs(0, 6, 6, False)
    f = sharded_fn(4, segments=False, replicate_kv=True)
    with pytest.raises(LayoutError, match=r"sequence=4 needs num_heads \(6 on this device\)"):
        jax.eval_shape(f, q, k, v, index, index)
    with pytest.raises(LayoutError, match=r"num_heads \(6 on this device\)"):
        ulysses_check(6, 2, 4, replicate_kv=True)


def test_compiled_forward_has_four_all_to_alls_of_the_local_shard():
    n, nh = 4, 8
    q, k, v, ct, index, _ = make_inputs(0, nh, nh, False)
    mesh = seq_mesh(n)
    f = sharded_fn(n, segments=False)
    shard_bytes = B * (T // n) * nh * H * 4  # one local [B, Tl, N, H] float32 block

    def all_to_alls(compiled):
        colls = parse_collectives(compiled.as_text(), mesh=mesh)
        a2a = [c for c in colls if c.kind == "all-to-all"]
        assert all(c.bytes == shard_bytes and c.group_size == n and c.axes == ("sequence",) for c in a2a), a2a
        # Everything else is the (int32) index all-gather: no float K/V is gathered.
        others = [c for c in colls if c.kind != "all-to-all"]
        assert all(c.kind == "all-gather" and c.bytes == B * T * 4 for c in others), others
        return len(a2a)

    assert all_to_alls(jax.jit(f).lower(q, k, v, index, index).compile()) == 4  # q, k, v in; out back
    # Backward: dO in; dQ, dK, dV back.
    assert all_to_alls(value_and_grads(f).lower(q, k, v, ct, index, index).compile()) == 8


def test_compiled_forward_with_replicated_kv():
    """K=2 over n=4: q and out take the all-to-all, K and V are all-gathered whole ([B, T, K, H])."""
    n, nh, nkv = 4, 8, 2
    q, k, v, _, index, _ = make_inputs(0, nh, nkv, False)
    f = sharded_fn(n, segments=False, replicate_kv=True)
    colls = parse_collectives(jax.jit(f).lower(q, k, v, index, index).compile().as_text(), mesh=seq_mesh(n))
    kinds = sorted((c.kind, c.bytes) for c in colls)
    assert kinds == sorted(
        [("all-to-all", B * (T // n) * nh * H * 4)] * 2
        + [("all-gather", B * T * nkv * H * 4)] * 2
        + [("all-gather", B * T * 4)] * 2
    ), kinds
