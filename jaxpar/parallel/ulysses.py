"""Ulysses (DeepSpeed-style) context-parallel attention: trade sequence sharding for head sharding.

Each of the n devices on the sequence axis holds a contiguous block of Tl = T / n stored positions
(natural or zig-zag order) with all of its local heads. One all-to-all per tensor splits the heads
into n groups and gathers the sequence, so device j then holds the *whole* sequence for query heads
[j·Nl/n, (j+1)·Nl/n) and runs ordinary attention on them; a final all-to-all of the output goes back
to sequence sharding. Forward collectives: 4 all-to-alls (Q, K, V in, O out), each moving the local
shard; the token indices (and segments) are all-gathered so the masks are exact in any storage order.

GQA: query head h reads kv head h // G with G = Nl / Kl. With Kl % n == 0 the head split keeps the
groups together (device j gets kv heads [j·Kl/n, (j+1)·Kl/n), exactly the ones its query heads use).
With fewer kv heads than devices the K/V cannot be split by head; ``replicate_kv=True`` then
all-gathers K/V along the sequence (every device gets all Kl heads) and each device keeps the kv
heads its query heads use.

Legend: B batch, T sequence, Tl = T / n local positions, Nl / Kl local query / kv heads, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.parallel.common import dense_attention
from jaxpar.parallel.flash import splash_attention
from jaxpar.rules import LayoutError

__all__ = ["ulysses_attention", "ulysses_check"]


def ulysses_check(num_heads_local: int, num_kv_heads_local: int, n: int, *, replicate_kv: bool) -> None:
    """Raise ``LayoutError`` unless Ulysses over a sequence axis of size ``n`` can run with these
    per-device head counts (query heads ``num_heads_local``, kv heads ``num_kv_heads_local``)."""
    nl, kl = num_heads_local, num_kv_heads_local
    if n < 1 or nl < 1 or kl < 1:
        raise LayoutError(f"ulysses: sizes must be positive (num_heads {nl}, num_kv_heads {kl}, sequence={n})")
    if nl % kl:
        raise LayoutError(
            f"ulysses: num_heads ({nl} on this device) is not a multiple of num_kv_heads ({kl} on this device)"
        )
    if nl % n:
        raise LayoutError(
            f"ulysses over sequence={n} needs num_heads ({nl} on this device) divisible "
            f"by {n}: each device takes num_heads/{n} query heads; use attention 'ring' "
            f"or a sequence axis that divides {nl}"
        )
    if kl % n and not replicate_kv:
        raise LayoutError(
            f"ulysses over sequence={n} needs num_kv_heads ({kl} on this device) divisible "
            f"by {n}; use attention 'ring', a smaller sequence axis, or replicate_kv=True "
            f"(all-gathers K/V along the sequence)"
        )


def _kv_for_local_heads(k_full: jax.Array, num_heads: int, n: int, axis_name: str) -> jax.Array:
    """From the replicated K or V [B, T, Kl, H], the kv heads this device's query heads use, in the
    standard grouped order (local query head i reads returned head i // (returned G))."""
    kl = k_full.shape[2]
    g, per = num_heads // kl, num_heads // n  # query heads per kv head; per device
    j = jax.lax.axis_index(axis_name)
    if g % per == 0:  # n % Kl == 0: all of this device's query heads read one kv head
        return jax.lax.dynamic_slice_in_dim(k_full, (j * per) // g, 1, axis=2)
    # n % Kl != 0 (e.g. Kl=6 or 3, n=4): groups straddle devices; one kv head per query head.
    heads = (j * per + jnp.arange(per)) // g
    return jnp.take(k_full, heads, axis=2)


def ulysses_attention(
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
    replicate_kv: bool = False,
    implementation: str | None = None,
):
    """Per-device body, called INSIDE ``jax.shard_map`` over ``axis_name`` (the sequence axis, size n).

    q [B, Tl, Nl, H], k/v [B, Tl, Kl, H] local blocks (Nl % Kl == 0), q_index/kv_index int32 [B, Tl]:
    each local token's index in the original sequence; segments int32 [B, Tl] or None (both or
    neither). Requires Nl % n == 0 and Kl % n == 0; with ``replicate_kv=True`` Kl % n != 0 is allowed
    (K/V are all-gathered instead of split by head). Raises ``LayoutError`` at trace time otherwise.
    ``implementation="splash"``: the gathered heads run the Pallas kernel (``jaxpar.parallel.flash``) in
    the sequence's original order (self-attention: kv_index is q_index). Returns out [B, Tl, Nl, H] in
    q.dtype."""
    n = jax.lax.axis_size(axis_name)
    nl, kl = q.shape[2], k.shape[2]
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"ulysses: q {q.shape}, k {k.shape}, v {v.shape} must be [B, Tl, N, H] and "
            f"[B, Tl, K, H] with equal B, Tl, H"
        )
    if (q_segment is None) != (kv_segment is None):
        raise ValueError("ulysses: pass both q_segment and kv_segment, or neither")
    ulysses_check(nl, kl, n, replicate_kv=replicate_kv)

    def seq_to_heads(x):  # [B, Tl, X, H] -> [B, T, X/n, H]
        return jax.lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)

    def gather_seq(x):  # [B, Tl, ...] -> [B, T, ...], stored order (device blocks in order)
        return jax.lax.all_gather(x, axis_name, axis=1, tiled=True)

    qh = seq_to_heads(q)
    if kl % n == 0:
        kh, vh = seq_to_heads(k), seq_to_heads(v)
    else:  # replicate_kv (checked above)
        kh = _kv_for_local_heads(gather_seq(k), nl, n, axis_name)
        vh = _kv_for_local_heads(gather_seq(v), nl, n, axis_name)
    segs = (None, None) if q_segment is None else (gather_seq(q_segment), gather_seq(kv_segment))
    if implementation == "splash":
        out = _splash_in_order(qh, kh, vh, gather_seq(q_index), segs[0], causal=causal, window=window, scale=scale)
    else:
        out = dense_attention(
            qh, kh, vh, gather_seq(q_index), gather_seq(kv_index), *segs, causal=causal, window=window, scale=scale
        )
    # Inverse: split the sequence back into device blocks, gather the heads.
    return jax.lax.all_to_all(out, axis_name, split_axis=1, concat_axis=2, tiled=True)


def _splash_in_order(q, k, v, index, segments, *, causal, window, scale):
    """Splash attention over the gathered sequence [B, T, ...] stored in any order (zig-zag): put in the
    original order (``index``: each stored token's place in it), attended, put back."""
    order = jnp.argsort(index, axis=1)  # [B, T]: the stored position of the t-th token
    back = jnp.argsort(order, axis=1)
    take = lambda x, at: jnp.take_along_axis(x, at.reshape(*at.shape, *(1,) * (x.ndim - 2)), axis=1)
    segments = None if segments is None else take(segments, order)
    out = splash_attention(
        take(q, order), take(k, order), take(v, order), causal=causal, window=window, segments=segments, scale=scale
    )
    return take(out, back)
