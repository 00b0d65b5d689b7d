"""A reference attention for the kernel tests that imports nothing from jaxpar.

The masks are numpy booleans built from *token indices*: each token's place in the original sequence,
not its position in the stored array. Each rule is written out on its own:

    causal     a query sees the keys whose index is not after its own
    window w   a query sees a key at most w - 1 indices before it: itself and the w - 1 before it.
               Only the past is limited, so with causal=False the later keys stay visible.
    segments   a query sees only keys of its own segment id (packed documents)

The attention is plain einsums over K/V repeated per query head. Grouped-query attention with N query
heads over K kv heads means query head n reads kv head n // (N / K), which is exactly what
``jnp.repeat(k, N // K, axis=2)`` lays out. The softmax is ``jax.nn.softmax`` over -inf masked scores.
A fully masked row is set to 0 explicitly. The default scale is H ** -0.5. Everything is
differentiable with ``jax.grad``/``jax.vjp`` in q, k and v (the mask is a constant).

Legend: B batch, T queries, S keys, N query heads, K kv heads, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def causal_mask(q_index, kv_index) -> np.ndarray:
    """bool [B, T, S]: key s is not after query t in the original sequence."""
    q_index, kv_index = np.asarray(q_index), np.asarray(kv_index)
    return kv_index[:, None, :] <= q_index[:, :, None]


def window_mask(q_index, kv_index, window: int) -> np.ndarray:
    """bool [B, T, S]: key s is at most ``window - 1`` indices before query t. Later keys are not limited."""
    q_index, kv_index = np.asarray(q_index), np.asarray(kv_index)
    earliest = q_index[:, :, None] - (window - 1)  # the first index the window still covers
    return kv_index[:, None, :] >= earliest


def segment_mask(q_segment, kv_segment) -> np.ndarray:
    """bool [B, T, S]: query t and key s belong to the same segment."""
    q_segment, kv_segment = np.asarray(q_segment), np.asarray(kv_segment)
    return q_segment[:, :, None] == kv_segment[:, None, :]


def mask(
    q_index, kv_index, q_segment=None, kv_segment=None, *, causal: bool = True, window: int | None = None
) -> np.ndarray:
    """bool [B, T, S]: the intersection of the requested rules (all keys visible when none applies)."""
    q_index, kv_index = np.asarray(q_index), np.asarray(kv_index)
    allowed = np.ones((q_index.shape[0], q_index.shape[1], kv_index.shape[1]), bool)
    if causal:
        allowed &= causal_mask(q_index, kv_index)
    if window is not None:
        allowed &= window_mask(q_index, kv_index, window)
    if q_segment is not None:
        allowed &= segment_mask(q_segment, kv_segment)
    return allowed


def attention(q, k, v, allowed, *, scale: float | None = None):
    """q [B, T, N, H], k/v [B, S, K, H], allowed bool [B, T, S] -> out [B, T, N, H] in float32."""
    n, kv = q.shape[2], k.shape[2]
    assert n % kv == 0, (n, kv)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k_per_head = jnp.repeat(jnp.asarray(k, jnp.float32), n // kv, axis=2)  # [B, S, N, H]
    v_per_head = jnp.repeat(jnp.asarray(v, jnp.float32), n // kv, axis=2)
    scores = jnp.einsum("btnh,bsnh->bnts", jnp.asarray(q, jnp.float32), k_per_head) * scale
    allowed = jnp.asarray(allowed)[:, None]  # [B, 1, T, S]
    row_has_key = allowed.any(axis=-1, keepdims=True)  # [B, 1, T, 1]
    scores = jnp.where(allowed, scores, -jnp.inf)
    scores = jnp.where(row_has_key, scores, 0.0)  # an all -inf row would make softmax NaN
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(row_has_key, probs, 0.0)  # fully masked rows output 0
    return jnp.einsum("bnts,bsnh->btnh", probs, v_per_head)


@jax.jit
def value_and_grads(q, k, v, cotangent, allowed):
    """``(out, dq, dk, dv)`` of ``attention`` with the default scale, for the loss sum(out · cotangent).
    Compiled once per shape and shared by every test that calls it."""
    out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, allowed), q, k, v)
    return (out, *vjp(cotangent))


def own_noise(q, k, v, cotangent, allowed, *, seed: int = 0) -> float:
    """The oracle's own float noise: ``value_and_grads`` again with the keys (and values, and the mask's
    key columns) in another order, which is the same attention summed in another order; the worst over
    out, dq, dk and dv of max |Δ| / max |first|."""
    perm = np.random.default_rng(seed).permutation(np.asarray(k).shape[1])
    inv = np.argsort(perm)
    first = [np.asarray(a) for a in value_and_grads(q, k, v, cotangent, allowed)]
    out, dq, dk, dv = (
        np.asarray(a) for a in value_and_grads(q, k[:, perm], v[:, perm], cotangent, allowed[:, :, perm])
    )
    second = [out, dq, dk[:, inv], dv[:, inv]]
    return max(float(np.max(np.abs(a - b)) / np.max(np.abs(b))) for a, b in zip(second, first))
