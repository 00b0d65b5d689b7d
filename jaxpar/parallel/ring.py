"""Ring attention: context parallelism that never holds more than one K/V block per device.

The sequence is split over the mesh axis ``axis_name`` (n devices). Each device keeps its query block;
the K/V blocks, with their token indices and segment ids, travel around the ring (device i sends to
i + 1), so after n - 1 ``ppermute`` steps every query block has seen every key block. Partial results
are combined with the online softmax (``common.merge``) in float32.

The backward pass is a ring too (``jax.custom_vjp``): the residuals are only local (q, k, v, indices,
segments, out, lse), the probabilities are recomputed block by block from the saved log-sum-exp, dq
accumulates in place, and the dK/dV accumulators travel *with* their K/V block; one extra ``ppermute``
after the last block brings them home. Per-device memory is O(L / n) for arrays plus one
(L / 2n)² score tile per pair: nothing of length L exists on any device.

Causal work skipping: the local query block and each visiting K/V block are split in two halves (under
zig-zag storage each half is one chunk of the sequence) and a (q-half, kv-half) pair whose mask is
provably empty is skipped with ``lax.cond``. The rule (``pair_is_live``) is shared, line for line, by
the kernel and by ``ring_work``, the numpy count the imbalance benchmark and tests use.

Legend: B batch, T local query positions, S local key positions, N query heads, K kv heads,
G = N / K, H head dim, n ring size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.parallel.common import NEG_INF, attention_mask, block_attention, finish, merge, zigzag_order

__all__ = ["ring_attention", "pair_is_live", "ring_work"]


# --------------------------------------------------------------------------------------- skip rule
def pair_is_live(q_index, kv_index, *, causal: bool, window: int | None, xp=jnp):
    """Scalar bool: may any query of ``q_index`` [B, T] attend to any key of ``kv_index`` [B, S]?

    A sound test on index ranges (False only when the mask is empty for every batch row): causal and
    every key after every query, or a window and every key too far behind every query. Segments only
    remove entries, so they are not consulted. ``xp`` is ``jnp`` inside the kernel, ``np`` in
    ``ring_work``."""
    live = xp.ones(q_index.shape[:1], bool)
    if causal:
        live = live & (q_index.max(axis=1) >= kv_index.min(axis=1))
    if window is not None:
        live = live & (q_index.min(axis=1) - kv_index.max(axis=1) < window)
    return live.any()


def _can_skip(causal: bool, window: int | None) -> bool:
    return causal or window is not None


def _halves(length: int) -> int:
    return 2 if length % 2 == 0 and length >= 2 else 1


def _split(x, parts: int):
    """Static split of axis 1 into ``parts`` equal pieces; ``None`` stays ``None``."""
    if x is None:
        return [None] * parts
    t = x.shape[1] // parts
    return [x[:, j * t : (j + 1) * t] for j in range(parts)]


def _cat(xs):
    return xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=1)


def ring_work(
    length: int, n: int, layout: str = "zigzag", *, causal: bool = True, window: int | None = None
) -> np.ndarray:
    """int [n]: (q-half, kv-half) pairs each device computes over the whole ring (B = 1).

    ``layout`` is the storage order of the sequence before it is split contiguously over the devices:
    ``"zigzag"`` (``common.zigzag_order``) or ``"contiguous"``. Uses ``pair_is_live``, the kernel's
    rule, on the same halves the kernel uses."""
    if layout == "zigzag":
        order = zigzag_order(length, n)
    elif layout == "contiguous":
        if length % n:
            raise ValueError(f"sequence length {length} is not divisible by {n} devices")
        order = np.arange(length)
    else:
        raise ValueError(f"layout {layout!r}: expected 'zigzag' or 'contiguous'")
    blocks = order.reshape(n, 1, length // n)  # [device, B=1, T]: each block's indices
    parts = _halves(length // n)
    work = np.zeros(n, np.int64)
    for d in range(n):
        for step in range(n):
            visiting = blocks[(d - step) % n]  # after `step` hops device d holds d - step
            for qh in _split(blocks[d], parts):
                for kh in _split(visiting, parts):
                    live = not _can_skip(causal, window) or pair_is_live(qh, kh, causal=causal, window=window, xp=np)
                    work[d] += bool(live)
    return work


# --------------------------------------------------------------------------------------- kernel
def _ring_send(tree, axis_name: str, n: int):
    perm = [(i, (i + 1) % n) for i in range(n)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, axis_name, perm), tree)


def _kv_halves(k, v, kv_index, kv_segment):
    parts = _halves(k.shape[1])
    halves = []
    for kk, vv, ii, ss in zip(_split(k, parts), _split(v, parts), _split(kv_index, parts), _split(kv_segment, parts)):
        halves.append(dict(k=kk, v=vv, i=ii) if ss is None else dict(k=kk, v=vv, i=ii, s=ss))
    return halves


def _maybe(live_fn, compute, skip, operand, *, causal, window):
    """``compute(operand)`` unless the pair is provably masked; no collectives inside."""
    if not _can_skip(causal, window):
        return compute(operand)
    return jax.lax.cond(live_fn(), compute, skip, operand)


def _forward(q, k, v, q_index, kv_index, q_segment, kv_segment, *, axis_name, causal, window, scale):
    # q: [B, T, N, H]   k, v: [B, S, K, H]   indices, segments: [B, T] / [B, S]
    # The barrier ties the indices to q, k, v. Without it, a grad through a scan of layers (the model's
    # stack) splits off everything that depends on the indices alone as "known": every visit's masks
    # and -inf fills are computed ahead and kept, n-1 stacked [B, K, G, T/2, S/2] tiles per half pair
    # (measured: tiny's train step under cp, L = 2048: 48.7 MB of temp instead of 4.0 MB; tests/test_ring.py).
    q, k, v, q_index, kv_index, q_segment, kv_segment = jax.lax.optimization_barrier(
        (q, k, v, q_index, kv_index, q_segment, kv_segment)
    )
    n = jax.lax.axis_size(axis_name)
    qparts = _halves(q.shape[1])
    queries = list(zip(_split(q, qparts), _split(q_index, qparts), _split(q_segment, qparts)))
    kv = _kv_halves(k, v, kv_index, kv_segment)

    def init(qq):
        o = jnp.zeros_like(qq, dtype=jnp.float32)  # zeros_like keeps the varying type
        m = jnp.full_like(o[..., 0], NEG_INF)
        return o, m, jnp.zeros_like(o[..., 0])

    def visit(acc, kv):
        new = []
        for a, (qq, qi, qs) in zip(acc, queries):
            for blk in kv:

                def compute(a, qq=qq, qi=qi, qs=qs, blk=blk):
                    mask = attention_mask(qi, blk["i"], qs, blk.get("s"), causal=causal, window=window)
                    return merge(a, block_attention(qq, blk["k"], blk["v"], mask, scale=scale))

                live = functools.partial(pair_is_live, qi, blk["i"], causal=causal, window=window)
                a = _maybe(live, compute, lambda a: a, a, causal=causal, window=window)
            new.append(a)
        return new

    acc = [init(qq) for qq, _, _ in queries]
    if n > 1:

        def body(_, carry):
            acc, kv = carry
            nxt = _ring_send(kv, axis_name, n)  # independent of this step's compute
            return visit(acc, kv), nxt

        acc, kv = jax.lax.fori_loop(0, n - 1, body, (acc, kv))
    acc = visit(acc, kv)
    outs, lses = zip(*(finish(*a) for a in acc))
    return _cat(outs).astype(q.dtype), _cat(lses)  # [B, T, N, H], [B, T, N] fp32


def _pair_backward(carry, q, do, lse, delta, mask, k, v, *, scale):
    """Gradient contributions of one (query, key) block pair, probabilities recomputed from lse."""
    dq, dk, dv = carry
    b, t, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    as_group = lambda a: a.reshape(b, t, kh, g, h).astype(jnp.float32)
    row = lambda a: a.reshape(b, t, kh, g).transpose(0, 2, 3, 1)[..., None]  # [B,T,N] -> [B,K,G,T,1]
    qg, dog = as_group(q), as_group(do)
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
    x = jnp.einsum("btkgh,bskh->bkgts", qg, kf) * scale
    x = jnp.where(mask[:, None, None], x, NEG_INF)
    p = jnp.where(mask[:, None, None], jnp.exp(x - row(lse)), 0.0)  # [B, K, G, T, S]
    dv = dv + jnp.einsum("bkgts,btkgh->bskh", p, dog)  # GQA: sum over G
    dp = jnp.einsum("btkgh,bskh->bkgts", dog, vf)
    ds = p * (dp - row(delta)) * scale
    dq = dq + jnp.einsum("bkgts,bskh->btkgh", ds, kf).reshape(b, t, n, h)
    dk = dk + jnp.einsum("bkgts,btkgh->bskh", ds, qg)
    return dq, dk, dv


def _backward(res, dout, *, axis_name, causal, window, scale):
    q, k, v, q_index, kv_index, q_segment, kv_segment, out, lse = res
    n = jax.lax.axis_size(axis_name)
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # D: [B, T, N]
    qparts = _halves(q.shape[1])
    queries = list(zip(*(_split(a, qparts) for a in (q, q_index, q_segment, dout, lse, delta))))
    kv = _kv_halves(k, v, kv_index, kv_segment)
    for blk in kv:  # dK/dV travel with their block
        blk["dk"] = jnp.zeros_like(blk["k"], dtype=jnp.float32)
        blk["dv"] = jnp.zeros_like(blk["v"], dtype=jnp.float32)
    dq = [jnp.zeros_like(qq, dtype=jnp.float32) for qq, *_ in queries]

    def visit(dq, kv):
        dq, kv = list(dq), [dict(blk) for blk in kv]
        for a, (qq, qi, qs, do, ls, de) in enumerate(queries):
            for blk in kv:

                def compute(c, qq=qq, qi=qi, qs=qs, do=do, ls=ls, de=de, blk=blk):
                    mask = attention_mask(qi, blk["i"], qs, blk.get("s"), causal=causal, window=window)
                    return _pair_backward(c, qq, do, ls, de, mask, blk["k"], blk["v"], scale=scale)

                live = functools.partial(pair_is_live, qi, blk["i"], causal=causal, window=window)
                dq[a], blk["dk"], blk["dv"] = _maybe(
                    live, compute, lambda c: c, (dq[a], blk["dk"], blk["dv"]), causal=causal, window=window
                )
        return dq, kv

    if n > 1:

        def body(_, carry):
            dq, kv = visit(*carry)
            return dq, _ring_send(kv, axis_name, n)

        dq, kv = jax.lax.fori_loop(0, n - 1, body, (dq, kv))
    dq, kv = visit(dq, kv)
    dk, dv = _cat([blk["dk"] for blk in kv]), _cat([blk["dv"] for blk in kv])
    if n > 1:  # the block now here belongs to device + 1
        dk, dv = _ring_send((dk, dv), axis_name, n)
    return _cat(dq).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.cache
def _ring_fn(axis_name: str, causal: bool, window: int | None, scale: float, segments: bool):
    """A ``custom_vjp`` ring attention for one static configuration."""
    cfg = dict(axis_name=axis_name, causal=causal, window=window, scale=scale)

    def unpack(args):
        if segments:
            return args
        q, k, v, qi, ki = args
        return q, k, v, qi, ki, None, None

    @jax.custom_vjp
    def ring(*args):
        return _forward(*unpack(args), **cfg)[0]

    def ring_fwd(*args):
        full = unpack(args)
        out, lse = _forward(*full, **cfg)
        return out, (*full, out, lse)

    def ring_bwd(res, dout):
        dq, dk, dv = _backward(res, dout, **cfg)
        return (dq, dk, dv) + (None,) * (4 if segments else 2)  # no cotangent for indices/segments

    ring.defvjp(ring_fwd, ring_bwd)
    return ring


def ring_attention(
    q,
    k,
    v,
    q_index,
    kv_index,
    q_segment=None,
    kv_segment=None,
    *,
    axis_name: str,
    causal: bool = True,
    window: int | None = None,
    scale: float | None = None,
):
    """Per-device body, called INSIDE ``jax.shard_map`` over ``axis_name`` (the sequence axis).

    q [B, T, N, H], k/v [B, T, K, H] (the local blocks; N % K == 0), q_index/kv_index int32 [B, T]
    (each local token's index in the original sequence, so any storage order works, zig-zag included),
    segments int32 [B, T] or None (both or neither). Returns out [B, T, N, H] in q.dtype; the gradient
    with respect to q, k, v is a ring as well (``jax.custom_vjp``)."""
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} are not a multiple of kv heads {k.shape[2]}")
    if (q_segment is None) != (kv_segment is None):
        raise ValueError("q_segment and kv_segment must be given together")
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    fn = _ring_fn(axis_name, bool(causal), None if window is None else int(window), scale, q_segment is not None)
    args = (q, k, v, q_index, kv_index) + (() if q_segment is None else (q_segment, kv_segment))
    return fn(*args)
