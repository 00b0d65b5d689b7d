"""The paged KV cache's host bookkeeping: reference counts, prefix sharing, forks, rollback, no leaks."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpar.inference.pages import NULL_PAGE, OutOfPages, PagedAllocator, page_hashes


def test_page_names_chain_the_whole_prefix():
    a = page_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    assert len(a) == 3
    assert page_hashes([9, 2, 3, 4], 2)[1] != a[1]  # same page, different history
    assert page_hashes([1, 2, 3, 4], 2) == a[:2]


def test_null_page_pads_tables_and_is_never_handed_out():
    pool = PagedAllocator(4, 2)
    pool.admit("a", [1, 2, 3])
    pool.reserve("a", 6)  # all three real pages
    assert sorted(pool.table("a", 5)[:3].tolist()) == [1, 2, 3]
    assert pool.table("a", 5)[3:].tolist() == [NULL_PAGE] * 2
    pool.admit("b", [1])
    with pytest.raises(OutOfPages):
        pool.reserve("b", 1)
    assert pool.seqs["b"].pages == []  # all or nothing
    pool.check()


def test_prefix_pages_are_shared_and_never_written():
    pool = PagedAllocator(16, 4)
    prompt = list(range(10))
    assert pool.admit("a", prompt) == 0
    pool.reserve("a", 10)
    pool.commit("a", prompt)  # pages 0-3 and 4-7 are full: named
    assert pool.admit("b", prompt + [99]) == 8  # both shared
    assert pool.seqs["b"].pages == pool.seqs["a"].pages[:2]
    assert pool.refs[pool.seqs["a"].pages[0]] == 2
    pool.reserve("b", 11)
    pool.check_writable("b", 8, 11)  # its own third page
    with pytest.raises(AssertionError):
        pool.check_writable("b", 7, 8)  # the shared one
    # A prompt of exactly two full pages shares only one: its last token must be computed.
    assert pool.admit("c", prompt[:8]) == 4
    assert (pool.hits, pool.lookups) == (3, 5)  # a: 2 looked up, none found; b: 2 of 2; c: 1 of 1
    pool.unadmit("c")  # no room after all: not counted
    assert (pool.hits, pool.lookups) == (2, 4) and "c" not in pool.seqs
    pool.check()


def test_without_the_prefix_cache_nothing_is_shared_or_kept():
    pool = PagedAllocator(8, 4, prefix_cache=False)
    prompt = list(range(10))
    pool.admit("a", prompt)
    pool.reserve("a", 10)
    pool.commit("a", prompt)
    assert pool.admit("b", prompt) == 0 and pool.lookups == 0
    pool.free("a")
    assert pool.available == 7 - len(pool.seqs["b"].pages)  # released pages go back free, not cached
    pool.check()


def test_released_named_pages_stay_cached_until_evicted():
    pool = PagedAllocator(4, 2)  # 3 usable pages
    pool.admit("a", [5, 6, 7, 8, 9])
    pool.reserve("a", 5)
    pool.commit("a", [5, 6, 7, 8, 9])
    pool.free("a")
    assert pool.available == 3 and pool.used == 0
    assert pool.admit("b", [5, 6, 7, 8, 1]) == 4  # found after its sequence ended
    pool.free("b")
    pool.admit("c", [1, 1, 1, 1, 1, 1])  # needs all three: evicts the cached pages
    pool.reserve("c", 6)
    assert pool.admit("d", [5, 6, 7, 8, 1]) == 0
    pool.check()


def test_fork_shares_full_pages_and_copies_the_partial_one():
    pool = PagedAllocator(8, 4)
    pool.admit("a", list(range(6)))
    pool.reserve("a", 6)
    pool.commit("a", list(range(6)))
    src, dst = pool.fork("a", "b")
    assert src == pool.seqs["a"].pages[1] and dst == pool.seqs["b"].pages[1] != src
    assert pool.seqs["b"].pages[0] == pool.seqs["a"].pages[0]
    pool.check_writable("b", 6, 8)
    pool.check_writable("a", 6, 8)
    pool.check()


def test_rollback_returns_pages_but_never_below_named_pages():
    pool = PagedAllocator(8, 2)
    pool.admit("a", [1, 2, 3])
    pool.reserve("a", 7)
    pool.commit("a", [1, 2, 3])
    pool.seqs["a"].length = 7  # four draft tokens written
    pool.rollback("a", 4)
    assert len(pool.seqs["a"].pages) == 2
    with pytest.raises(ValueError):
        pool.rollback("a", 1)  # the named first page
    pool.check()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 5), st.integers(1, 9)), min_size=1, max_size=60))
def test_random_traffic_keeps_the_invariants(ops):
    """Admit / grow / fork / roll back / free in any order: counts match tables, nothing leaks, and
    freeing everything leaves every page free or cached."""
    pool, rng, live, n = PagedAllocator(12, 3), np.random.default_rng(0), {}, 0
    for op, pick, size in ops:
        keys = sorted(live)
        key = keys[pick % len(keys)] if keys else None
        try:
            if op == 0 or key is None:
                prompt = [int(t) for t in rng.integers(0, 2, size)]  # small alphabet: many shared pages
                pool.admit(n, prompt)
                pool.reserve(n, len(prompt))
                pool.commit(n, prompt)
                live[n], n = prompt, n + 1
            elif op == 1:
                tokens = live[key] + [int(t) for t in rng.integers(0, 2, size)]
                pool.reserve(key, len(tokens))
                pool.check_writable(key, len(live[key]), len(tokens))
                pool.commit(key, tokens)
                live[key] = tokens
            elif op == 2:
                pool.fork(key, n)
                live[n], n = list(live[key]), n + 1
            elif op == 3:
                keep = max(pool.seqs[key].named * 3, len(live[key]) - size)
                pool.rollback(key, keep)
                live[key] = live[key][:keep]
            else:
                pool.free(key)
                del live[key]
        except OutOfPages:
            if op == 0:
                pool.free(n)  # the admitted prompt got no pages
        pool.check()
    for key in list(live):
        pool.free(key)
    pool.check()
    assert pool.used == 0 and pool.available == 11
