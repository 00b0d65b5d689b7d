"""The embedded synthetic source (``data.source=markov``): a random sparse first-order Markov chain over
the model's vocabulary. Record ``i`` is generated on demand from ``(stream, i)``: there is nothing to
download, and the best loss any model can reach is known exactly (``MarkovChain.entropy_rate``)."""

from __future__ import annotations

import bisect
import dataclasses
import functools

import numpy as np

from jaxpar.errors import DataError

DIRICHLET_ALPHA = 0.5  # transition probabilities per state ~ Dirichlet(0.5, ..., 0.5): skewed, not peaked
MARKOV_MAX_VOCAB = 2**20  # states of the synthetic chain: 1.7 s for 151,936 (Qwen's vocabulary), 24 s at the cap
MARKOV_LENGTH = 2**40  # records in a markov stream: endless in practice, still a finite grain source


@dataclasses.dataclass(frozen=True, eq=False)
class MarkovChain:
    """A first-order chain: state s moves to ``successors[s, j]`` with probability ``probs[s, j]``."""

    successors: np.ndarray  # [V, k] int64, distinct within a row
    probs: np.ndarray  # [V, k] float64, rows sum to 1
    stationary: np.ndarray  # [V] float64, π with π P = π
    entropy_rate: float  # Σ_s π(s) H(P(s, ·)) in nats: the loss of a perfect model

    def matrix(self) -> np.ndarray:
        """The dense [V, V] transition matrix (for small vocabularies and tests)."""
        vocab = len(self.successors)
        out = np.zeros((vocab, vocab))
        np.add.at(out, (np.arange(vocab)[:, None], self.successors), self.probs)
        return out


@functools.lru_cache(maxsize=8)
def markov_chain(vocab_size: int, *, branching: int, seed: int) -> MarkovChain:
    """A random sparse chain with ``branching`` distinct successors per state (the same for the same args).

    Irreducible by construction: a random cyclic order of all tokens gives every state its next token
    in the cycle as successor 0, so π is unique and positive. Aperiodicity is not needed: records start
    from π, so every position of a record is distributed by π. The other successors are drawn uniformly
    without replacement; the probabilities come from a symmetric Dirichlet(``DIRICHLET_ALPHA``).
    """
    if not 1 <= branching <= vocab_size:
        raise DataError(f"data.markov_branching={branching}: must be between 1 and model.vocab_size={vocab_size}")
    if vocab_size > MARKOV_MAX_VOCAB:
        raise DataError(
            f"data.source=markov: model.vocab_size={vocab_size:,} is more states than the synthetic chain "
            f"is built for (at most {MARKOV_MAX_VOCAB:,}: its tables live in memory and its stationary "
            "distribution is iterated); use data.source=files"
        )
    rng = np.random.default_rng([seed, 0x6D61726B])
    cycle = rng.permutation(vocab_size)
    succ = np.empty((vocab_size, branching), np.int64)
    succ[cycle, 0] = np.roll(cycle, -1)
    for col in range(1, branching):  # redraw clashes: uniform over distinct successor sets
        succ[:, col] = rng.integers(0, vocab_size, vocab_size)
        while (clash := (succ[:, :col] == succ[:, col : col + 1]).any(axis=1)).any():
            succ[clash, col] = rng.integers(0, vocab_size, int(clash.sum()))
    probs = rng.dirichlet(np.full(branching, DIRICHLET_ALPHA), size=vocab_size)
    pi = _stationary(succ, probs)
    row_entropy = -(probs * np.log(np.where(probs > 0, probs, 1.0))).sum(axis=1)
    for array in (succ, probs, pi):
        array.setflags(write=False)
    return MarkovChain(succ, probs, pi, float(pi @ row_entropy))


def _stationary(succ: np.ndarray, probs: np.ndarray, tol: float = 1e-14) -> np.ndarray:
    """π by power iteration on the lazy chain (I + P) / 2: same π, aperiodic, so it converges."""
    vocab = len(succ)
    pi = np.full(vocab, 1.0 / vocab)
    for _ in range(200_000):
        step = np.bincount(succ.ravel(), weights=(pi[:, None] * probs).ravel(), minlength=vocab)
        new = 0.5 * (pi + step)
        new /= new.sum()
        if np.abs(new - pi).sum() < tol:
            return new
        pi = new
    raise RuntimeError("stationary distribution did not converge")  # not reached for irreducible chains


class MarkovSource:
    """grain random-access source: record i is ``seq + 1`` tokens of the chain, first one drawn from π."""

    def __init__(self, chain: MarkovChain, seq: int, stream: tuple[int, ...]):
        self.chain, self.seq, self.stream = chain, seq, tuple(stream)
        cum = np.cumsum(chain.probs, axis=1)
        cum[:, -1] = 1.0  # inverse-CDF tables as lists: bisect beats numpy per step
        self._cum, self._succ = cum.tolist(), chain.successors.tolist()
        first = np.cumsum(chain.stationary)
        first[-1] = 1.0
        self._first = first.tolist()

    def __len__(self) -> int:
        return MARKOV_LENGTH

    def __getitem__(self, index: int) -> np.ndarray:
        u = np.random.default_rng([*self.stream, int(index)]).random(self.seq + 1).tolist()
        cum, succ = self._cum, self._succ
        state = bisect.bisect_right(self._first, u[0])
        out = [state]
        for x in u[1:]:
            state = succ[state][bisect.bisect_right(cum[state], x)]
            out.append(state)
        return np.array(out, np.int32)
