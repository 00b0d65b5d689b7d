"""What the context-parallel attention kernels share: masks from token indices, the zig-zag order, and
a grouped-query attention block that returns softmax statistics.

Masks are built from *token indices* (each token's place in the original, unpermuted sequence), not
from array positions: a device's query block and a visiting K/V block can come from anywhere in the
sequence (ring), and the sequence itself may be stored in zig-zag order. Index arrays travel with the
data they describe, so every kernel computes exactly the mask of plain causal attention.

Legend: B batch, T query positions, S key positions, N query heads, K kv heads, G = N / K, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -1e30  # finite "minus infinity": exp() underflows to 0 and fully masked rows stay NaN-free


def attention_mask(
    q_index: jax.Array,
    kv_index: jax.Array,
    q_segment: jax.Array | None = None,
    kv_segment: jax.Array | None = None,
    *,
    causal: bool = True,
    window: int | None = None,
) -> jax.Array:
    """bool [B, T, S]: query t may attend to key s.

    ``q_index`` [B, T] and ``kv_index`` [B, S] are int token indices in the original sequence;
    ``window`` w lets a token see itself and the w - 1 tokens before it; segments (packed documents)
    must be equal."""
    qi, ki = q_index[:, :, None], kv_index[:, None, :]
    mask = jnp.ones(jnp.broadcast_shapes(qi.shape, ki.shape), bool)
    if causal:
        mask &= ki <= qi
    if window is not None:
        mask &= qi - ki < window
    if q_segment is not None:
        mask &= q_segment[:, :, None] == kv_segment[:, None, :]
    return mask


def block_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float):
    """Unnormalised attention of one query block against one K/V block, in float32.

    q [B, T, N, H], k/v [B, S, K, H] (GQA: the N query heads are grouped over the K kv heads, K/V are
    never repeated), mask bool [B, T, S]. Returns ``(o, m, l)``: o [B, T, N, H] = Σ_s exp(x - m)·v,
    m [B, T, N] the row max of the masked scores x, l [B, T, N] = Σ_s exp(x - m). A fully masked row
    has m = NEG_INF, l = 0, o = 0. Combine blocks with ``merge``; the output is o / l."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, n // kh, h).astype(jnp.float32)
    x = jnp.einsum("btkgh,bskh->bkgts", qg, k.astype(jnp.float32)) * scale  # [B, K, G, T, S]
    x = jnp.where(mask[:, None, None], x, NEG_INF)
    m = jnp.max(x, axis=-1)  # [B, K, G, T]
    p = jnp.where(mask[:, None, None], jnp.exp(x - m[..., None]), 0.0)
    l = jnp.sum(p, axis=-1)
    o = jnp.einsum("bkgts,bskh->btkgh", p, v.astype(jnp.float32)).reshape(b, t, n, h)
    to_btn = lambda a: a.transpose(0, 3, 1, 2).reshape(b, t, n)
    return o, to_btn(m), to_btn(l)


def merge(acc, block):
    """Online-softmax combination of two partial results ``(o, m, l)`` (see ``block_attention``)."""
    o1, m1, l1 = acc
    o2, m2, l2 = block
    m = jnp.maximum(m1, m2)
    a1, a2 = jnp.exp(m1 - m), jnp.exp(m2 - m)
    return o1 * a1[..., None] + o2 * a2[..., None], m, l1 * a1 + l2 * a2


def finish(o: jax.Array, m: jax.Array, l: jax.Array):
    """``(out, lse)``: the normalised output [B, T, N, H] (0 for fully masked rows) and the log-sum-exp
    of each row's scores [B, T, N] (what a backward pass needs to recompute the probabilities)."""
    safe = jnp.where(l > 0, l, 1.0)
    return o / safe[..., None], jnp.where(l > 0, m + jnp.log(safe), NEG_INF)


def dense_attention(
    q, k, v, q_index, kv_index, q_segment=None, kv_segment=None, *, causal=True, window=None, scale=None
):
    """One-device attention with index masks: the oracle the kernels are tested against, and the core
    Ulysses runs after its all-to-all. Returns [B, T, N, H] in q's dtype."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    mask = attention_mask(q_index, kv_index, q_segment, kv_segment, causal=causal, window=window)
    out, _ = finish(*block_attention(q, k, v, mask, scale=scale))
    return out.astype(q.dtype)


def zigzag_order(length: int, n: int) -> np.ndarray:
    """The token order that, split contiguously over n devices, gives device i the chunks i and
    2n - 1 - i of the sequence (each of length / 2n): position p of the stored sequence holds token
    ``order[p]``. Balances causal attention: every device gets one early and one late chunk."""
    if length % (2 * n):
        raise ValueError(f"sequence length {length} is not divisible by 2 × {n} (zig-zag over {n} devices)")
    c = length // (2 * n)
    chunks = [(i, 2 * n - 1 - i) for i in range(n)]
    return np.concatenate([np.arange(j * c, (j + 1) * c) for pair in chunks for j in pair])


def inverse_order(order: np.ndarray) -> np.ndarray:
    """``inverse[order] = arange``: stored position of each original token."""
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size)
    return inverse
