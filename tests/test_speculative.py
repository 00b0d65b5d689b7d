"""Speculative decoding's host parts: n-gram drafts, and a verification rule that keeps the target's
distribution (chi-square) and the greedy tokens."""

import numpy as np
import pytest
from scipy.stats import chisquare

from jaxpar.inference.speculative import acceptance, ngram_draft, one_hot, verify


def test_ngram_draft_takes_the_longest_most_recent_match():
    assert ngram_draft([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    assert ngram_draft([7, 2, 5, 9, 2, 6, 9, 2], 2) == [6, 9]  # "9 2" (longest) beats "2"
    assert ngram_draft([1, 2, 3, 1, 2, 4, 1, 2], 1) == [4]  # the most recent "1 2"
    assert ngram_draft([1, 2, 3], 4) == [] and ngram_draft([5], 2) == []


def test_greedy_verification_emits_the_argmax_tokens():
    q = one_hot([3, 1, 4, 1], 6)
    rng = np.random.default_rng(0)
    assert verify([3, 1, 4], one_hot([3, 1, 4], 6), q, rng) == (3, 1)  # all kept, then the argmax
    assert verify([3, 2, 4], one_hot([3, 2, 4], 6), q, rng) == (1, 1)  # the second guess corrected
    assert verify([0], one_hot([0], 6), q[:2], rng) == (0, 3)


def _emitted(draft, p, q, rng):
    kept, nxt = verify(draft, p, q, rng)
    return list(draft[:kept]) + [nxt]


@pytest.mark.parametrize("deterministic", [False, True], ids=["draft-model", "n-gram"])
def test_verification_keeps_the_target_distribution(deterministic):
    """V = 5, k = 3, random draft and target distributions: the first and second emitted tokens follow
    the target's q_0 and q_1 (chi-square over 20,000 verifications)."""
    rng = np.random.default_rng(1)
    v, k, n = 5, 3, 20_000
    q = rng.dirichlet(np.ones(v), k + 1)
    p = rng.dirichlet(np.ones(v), k)
    counts = np.zeros((2, v))
    for _ in range(n):
        if deterministic:
            draft = [int(t) for t in rng.integers(0, v, k)]
            pd = one_hot(draft, v)
        else:
            draft = [int(rng.choice(v, p=p[i])) for i in range(k)]
            pd = p
        out = _emitted(draft, pd, q, rng)
        counts[0, out[0]] += 1
        if len(out) > 1:
            counts[1, out[1]] += 1
    for i in range(2):
        assert chisquare(counts[i], counts[i].sum() * q[i]).pvalue > 1e-3, (i, counts[i], q[i])
    # And the test has power: the draft's own distribution is rejected.
    if not deterministic:
        assert chisquare(counts[0], counts[0].sum() * p[0]).pvalue < 1e-6


def test_acceptance_report():
    assert acceptance([3, 0, 2, 3], [3, 3, 3, 3]) == {"rate": 8 / 12, "verifications": 4, "histogram": [1, 0, 1, 2]}
