"""Paged attention against a one-device oracle: shuffled pages, NaN garbage in every unused slot.

Pools are read a block of pages at a time (a partial softmax per block, merged as it goes), so their
sums run in another order than the dense cache's: both are checked against ``attention_oracle`` (which
imports nothing from jaxpar) within a multiple of the oracle's own noise (the same attention with its
keys in another order, tests/noise.py), and a wrong page table must miss that bound.
"""

import attention_oracle
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from noise import FLOOR, MULTIPLE, MUTATION_GAP, check_arrays, record

from jaxpar.layers.kvcache import (
    KVCache,
    LatentCache,
    PagedKVCache,
    PagedLatentCache,
    gqa_decode,
    keys_layout,
    mla_decode,
    values_layout,
)
from jaxpar.parallel import decode

B, W, PAGE, K, G, H = 3, 4, 4, 2, 3, 8  # 3 rows, 4 pages of 4 slots each, GQA 6 query heads over 2
S = W * PAGE


def _pages(rng, pool_pages: int, used):
    """Row b's table: used[b] distinct shuffled page ids from 1..pool_pages-1, then the null page 0."""
    ids = rng.permutation(np.arange(1, pool_pages))[: B * W].reshape(B, W)
    ids[np.arange(W)[None, :] >= np.asarray(used)[:, None]] = 0
    return jnp.asarray(ids, jnp.int32)


def _dense_to_pool(dense, table, pool_pages: int, lengths):
    """A pool [P, page, ...] of NaN holding dense [B, S, ...] at positions < lengths in the table's pages;
    page 0 zero, every other slot (unwritten positions, pages no table holds) NaN."""
    pool = np.full((pool_pages, PAGE, *dense.shape[2:]), np.nan, np.float32)
    for b in range(B):
        for p in range(lengths[b]):
            pool[int(table[b, p // PAGE]), p % PAGE] = dense[b, p]
    pool[0] = 0
    return pool


def _gqa_pools(ck, cv, table, pool_pages: int, lengths, table_of_pool=None):
    """GQA pools (keys [P, K, H, page], values [P, K, page, H]) holding dense [B, S, K, H] histories."""
    kp, vp = (_dense_to_pool(a, table, pool_pages, lengths) for a in (ck, cv))
    table = table if table_of_pool is None else table_of_pool
    return PagedKVCache(jnp.asarray(np.einsum("pskh->pkhs", kp)), jnp.asarray(np.einsum("pskh->pksh", vp)), table)


def _history(rng, lengths, *tail):
    """A dense cache holding random values at positions < lengths[b] and zeros elsewhere."""
    x = rng.normal(size=(B, S, *tail)).astype(np.float32)
    x[np.arange(S)[None, :] >= np.asarray(lengths)[:, None]] = 0
    return x


def _oracle(q, k, v, ck, cv, lengths, positions, window, order=None, scale=None):
    """The attention of q over each row's history and new tokens (keys at their positions), by the
    oracle; ``order``: the keys' slots in another order (the same attention, summed in another order)."""
    full_k, full_v = ck.copy(), cv.copy()
    for b in range(B):
        full_k[b, lengths[b] : lengths[b] + k.shape[1]] = k[b]
        full_v[b, lengths[b] : lengths[b] + k.shape[1]] = v[b]
    allowed = attention_oracle.mask(positions, np.broadcast_to(np.arange(S), (B, S)), window=window)
    order = np.arange(S) if order is None else order
    keys, values = full_k[:, order], full_v[:, order]
    return np.asarray(attention_oracle.attention(q, keys, values, allowed[:, :, order], scale=scale))


def _within_noise(oracle, got: dict, mutated, case: str, rng) -> None:
    """Each of ``got``'s outputs within a multiple of the oracle's own noise (``oracle(order)``: the same
    attention with the keys' slots in another order), and ``mutated`` (a wrong page table's output) at
    least ``MUTATION_GAP`` times beyond that bound."""
    want = oracle(None)
    noise = float(np.max(np.abs(oracle(rng.permutation(S)) - want)) / np.max(np.abs(want)))
    for name, out in got.items():
        assert np.isfinite(np.asarray(out)).all(), name
        check_arrays([out], [want], noise, "paged", f"{name} {case}", names=("out",))
    factor = float(np.max(np.abs(np.asarray(mutated) - want)) / np.max(np.abs(want)))
    factor /= max(MULTIPLE * noise, FLOOR["grad"])
    record("paged", f"mutation: another row's page {case}", factor=factor)
    assert factor >= MUTATION_GAP, factor


@pytest.mark.parametrize("pages_per_step", ["all", "one"])
@pytest.mark.parametrize("t,window", [(1, None), (3, None), (3, 5)], ids=["decode", "chunk", "window"])
def test_paged_and_dense_gqa_match_the_oracle(t, window, pages_per_step, monkeypatch):
    """Paged GQA read in one step (a small cache) and one page column per step (``BLOCK_BYTES`` below a
    column: the running softmax merged W times)."""
    if pages_per_step == "one":
        monkeypatch.setattr(decode, "BLOCK_BYTES", 1)
    rng = np.random.default_rng(t)
    lengths = np.array([5, 0, 9])  # tokens already cached per row
    positions = lengths[:, None] + np.arange(t)[None, :]
    q = rng.normal(size=(B, t, K * G, H)).astype(np.float32)
    k, v = (rng.normal(size=(B, t, K, H)).astype(np.float32) for _ in range(2))
    ck, cv = _history(rng, lengths, K, H), _history(rng, lengths, K, H)
    table = _pages(rng, 20, -(-(lengths + t) // PAGE))
    run = jax.jit(lambda *a, window: gqa_decode(*a, window=window), static_argnames="window")  # traced here
    args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    pos = jnp.asarray(positions, jnp.int32)
    dense_cache = KVCache(keys_layout(jnp.asarray(ck)), values_layout(jnp.asarray(cv)))
    dense_out, dense = run(*args, dense_cache, pos, window=window)
    got, pool = run(*args, _gqa_pools(ck, cv, table, 20, lengths), pos, window=window)
    stale = np.asarray(table).copy()
    stale[2, 1] = stale[0, 0]  # row 2 reads row 0's first page for its second (within every window)
    wrong, _ = run(*args, _gqa_pools(ck, cv, table, 20, lengths, jnp.asarray(stale)), pos, window=window)
    oracle = lambda order: _oracle(q, k, v, ck, cv, lengths, positions, window, order)
    _within_noise(oracle, dict(dense=dense_out, paged=got), wrong, f"gqa {t} {window} {pages_per_step}", rng)

    keys = np.asarray(pool.k)  # [P, K, H, page]
    for b in range(B):  # the new tokens landed in the row's pages
        rows = np.concatenate([np.einsum("khs->skh", keys[int(p)]) for p in table[b]])
        np.testing.assert_array_equal(
            rows[: lengths[b] + t], np.einsum("bkhs->bskh", np.asarray(dense.k))[b, : lengths[b] + t]
        )
    assert not keys[0].any() and not np.asarray(pool.v)[0].any()  # the null page stays zero


def test_padding_queries_write_nothing():
    rng = np.random.default_rng(7)
    table = _pages(rng, 20, [W] * B)
    pool_k = jnp.asarray(rng.normal(size=(20, K, H, PAGE)), jnp.float32)
    pool_v = jnp.asarray(rng.normal(size=(20, K, PAGE, H)), jnp.float32)
    positions = jnp.asarray([[3, -1], [-1, -1], [0, 1]], jnp.int32)
    new = jnp.ones((B, 2, K, H))
    q = jnp.ones((B, 2, K * G, H))
    out, after = gqa_decode(q, new, new, PagedKVCache(pool_k, pool_v, table), positions, window=None)
    assert np.isfinite(np.asarray(out)).all()
    for before, now in ((pool_k, after.k), (pool_v, after.v)):
        changed = np.flatnonzero((np.asarray(now) != np.asarray(before)).any(axis=(1, 2, 3)))
        assert sorted(changed) == sorted({int(table[0, 0]), int(table[2, 0])})


@pytest.mark.parametrize("pages_per_step", ["all", "one"])
def test_paged_and_dense_mla_match_the_oracle(pages_per_step, monkeypatch):
    """Absorbed MLA over latent pools against the oracle: queries [latent, rope] over keys [latent, rope
    key] shared by every head (one kv head) and values the latents."""
    if pages_per_step == "one":
        monkeypatch.setattr(decode, "BLOCK_BYTES", 1)
    rng = np.random.default_rng(3)
    n, r, hr, t, scale = 4, 6, 2, 2, 0.3
    lengths = np.array([2, 7, 13])
    positions = lengths[:, None] + np.arange(t)[None, :]
    ql, qr = (rng.normal(size=(B, t, n, d)).astype(np.float32) for d in (r, hr))
    lat, kr = (rng.normal(size=(B, t, d)).astype(np.float32) for d in (r, hr))
    c, ckr = _history(rng, lengths, r), _history(rng, lengths, hr)
    table = _pages(rng, 16, -(-(lengths + t) // PAGE))
    pools = lambda table_read: PagedLatentCache(
        *(jnp.asarray(_dense_to_pool(a, table, 16, lengths)) for a in (c, ckr)), table_read
    )
    run = jax.jit(lambda *a, scale: mla_decode(*a, scale=scale), static_argnames="scale")  # traced here
    args = tuple(map(jnp.asarray, (ql, qr, lat, kr)))
    pos = jnp.asarray(positions, jnp.int32)
    dense, _ = run(*args, LatentCache(jnp.asarray(c), jnp.asarray(ckr)), pos, scale=scale)
    got, _ = run(*args, pools(table), pos, scale=scale)
    stale = np.asarray(table).copy()
    stale[2, 1] = stale[1, 0]  # row 2 reads row 1's first page for its second
    wrong, _ = run(*args, pools(jnp.asarray(stale)), pos, scale=scale)
    q, keys = np.concatenate([ql, qr], -1), np.concatenate([lat, kr], -1)[:, :, None]
    history = np.concatenate([c, ckr], -1)[:, :, None]
    values = (lat[:, :, None], c[:, :, None])
    oracle = lambda order: _oracle(q, keys, values[0], history, values[1], lengths, positions, None, order, scale)
    _within_noise(oracle, dict(dense=dense, paged=got), wrong, f"mla {pages_per_step}", rng)


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe", "tiny-deepseek"])
def test_paged_model_matches_dense_model(preset):
    """A model's decode over page pools (shuffled pages): a prompt in two chunks, then single tokens, within
    a multiple of the dense decode's own noise (its distance from the training forward, the same logits
    another valid way); reading one page of another row in the last step misses that bound."""
    from flax import nnx

    from jaxpar.inference.layouts import generation_execution
    from jaxpar.layers.kvcache import with_table, without_table
    from jaxpar.models import build_model, get_model_preset

    model = build_model(get_model_preset(preset), execution=generation_execution(), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(0, model.cfg.vocab_size, (2, 11)), jnp.int32)
    table = jnp.asarray(rng.permutation(np.arange(1, 9)).reshape(2, W), jnp.int32)
    step = nnx.jit(lambda m, x, pos, c: m.decode(x, pos, c))
    forward = np.asarray(nnx.jit(lambda m, x: m(x))(model, ids))
    dense, pools = model.empty_cache(2, S), model.empty_pages(9, PAGE)
    err = noise = 0.0
    for start, stop in [(0, 6), (6, 8), (8, 9), (9, 10), (10, 11)]:
        pos = jnp.broadcast_to(jnp.arange(start, stop, dtype=jnp.int32), (2, stop - start))
        want, dense = step(model, ids[:, start:stop], pos, dense)
        before = pools
        got, paged = step(model, ids[:, start:stop], pos, with_table(pools, table))
        pools = without_table(paged)
        err = max(err, float(np.max(np.abs(np.asarray(got) - np.asarray(want)))))
        noise = max(noise, float(np.max(np.abs(np.asarray(want) - forward[:, start:stop]))))
    bound = max(MULTIPLE * noise, FLOOR["logit"])
    record("paged", f"model {preset}", noise=dict(logit=noise), tolerance=dict(logit=bound), error=dict(logit=err))
    assert err <= bound, (err, bound, noise)
    wrong, _ = step(model, ids[:, 10:11], pos, with_table(before, table.at[1, 0].set(table[0, 0])))
    factor = float(np.max(np.abs(np.asarray(wrong) - np.asarray(want)))) / bound
    record("paged", f"mutation: another row's page {preset}", factor=factor)
    assert factor >= MUTATION_GAP, factor
