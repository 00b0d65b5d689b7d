"""Speculative decoding's host parts: drafts from the sequence itself, and the verification rule.

A cheap proposer guesses the next k tokens; the target model scores the last token and the k guesses in
one pass (k + 1 positions), and ``verify`` decides how many guesses to keep and which token follows them.
The rule (Leviathan et al., 2023) keeps the target's distribution exactly: guess i, drawn from the
draft's distribution p_i, is kept with probability min(1, q_i(t) / p_i(t)) where q_i is the target's;
at the first rejection the next token is drawn from normalise(max(q_i − p_i, 0)); when every guess is
kept, one more token is drawn from q_k. A deterministic draft (n-gram lookup) has p_i one-hot. Greedy
decoding is the case of one-hot q: a guess is kept iff it is the target's argmax, and the correction is
the argmax, so greedy speculative decoding emits the greedy tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def ngram_draft(tokens: Sequence[int], k: int, /, *, longest: int = 3, shortest: int = 1) -> list[int]:
    """Prompt lookup: the ≤ k tokens that followed the most recent earlier occurrence of the sequence's
    last n tokens, for the longest n in [shortest, longest] that occurs; [] when none does."""
    tokens = list(tokens)
    for n in range(min(longest, len(tokens) - 1), shortest - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k]
    return []


def one_hot(tokens: Sequence[int], vocab: int, /) -> np.ndarray:
    """The distribution of a deterministic draft: [len(tokens), vocab]."""
    out = np.zeros((len(tokens), vocab))
    out[np.arange(len(tokens)), list(tokens)] = 1.0
    return out


def distribution(raw: np.ndarray, filtered: np.ndarray, greedy: bool) -> np.ndarray:
    """A model's next-token distributions [n, V] from its logits: one-hot on the argmax of ``filtered``
    when greedy (a greedy row's filtered logits are its raw ones, penalties applied), else the softmax of
    the filtered logits (penalties, temperature, top-k/p, min-p applied; -inf where cut)."""
    if greedy:
        return one_hot(np.argmax(filtered, axis=-1), raw.shape[-1])
    z = np.exp(filtered - filtered.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def host_rng(seed: int, position: int, stream: int = 0) -> np.random.Generator:
    """The generator of a request's host-side draws at ``position`` (``stream`` 0: verification,
    1: the draft's samples); any int seed, negative ones included."""
    return np.random.default_rng([seed & 0xFFFFFFFF, position, stream])


def verify(draft: Sequence[int], p: np.ndarray, q: np.ndarray, rng: np.random.Generator) -> tuple[int, int]:
    """draft [k] tokens drawn from p [k, V]; q [k + 1, V] the target's distributions at the same
    positions (and one past). Returns (guesses kept, the token that follows them)."""
    k = len(draft)
    if p.shape[0] != k or q.shape[0] != k + 1:
        raise ValueError(f"draft of {k} tokens needs p [{k}, V] and q [{k + 1}, V]; got {p.shape}, {q.shape}")
    for i, t in enumerate(draft):
        if rng.random() * p[i, t] < q[i, t]:  # u < q/p without dividing by p = 0
            continue
        residual = np.maximum(q[i] - p[i], 0.0)
        total = residual.sum()
        return i, int(rng.choice(len(residual), p=residual / total)) if total > 0 else int(np.argmax(q[i]))
    return k, int(rng.choice(q.shape[1], p=q[k] / q[k].sum()))


def acceptance(kept: Sequence[int], proposed: Sequence[int], /) -> dict:
    """Acceptance rate (kept / proposed guesses) and the histogram of guesses kept per verification."""
    kept, proposed = list(kept), list(proposed)
    return {
        "rate": sum(kept) / max(1, sum(proposed)),
        "verifications": len(kept),
        "histogram": np.bincount(kept, minlength=max(proposed, default=0) + 1).tolist(),
    }
