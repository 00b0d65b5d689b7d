"""Host-side references for log-probs and penalties, built on a training forward (the model's ``__call__``
on the whole sequence, float32) and numpy alone: they share no code with the engine's step program.

Sequences are right-padded to ``length`` so that one compiled forward serves them all; attention is
causal, so the padding after a position does not reach it.
"""

from __future__ import annotations

import jax
import numpy as np


class Forward:
    """``model``'s float32 logits over the real vocabulary for token sequences up to ``length``."""

    def __init__(self, model, length: int):
        self.model, self.length, self.vocab = model, length, model.cfg.vocab_size
        self.run = jax.jit(lambda m, ids: m(ids))

    def logits(self, tokens) -> np.ndarray:
        """[len(tokens), vocab] float32: row i holds the logits that predict token i + 1."""
        ids = np.zeros((1, self.length), np.int32)
        ids[0, : len(tokens)] = tokens
        out = np.asarray(self.run(self.model, ids), np.float32)[0, : len(tokens), : self.vocab]
        assert out.dtype == np.float32
        return out

    def log_probs(self, tokens) -> np.ndarray:
        """[len(tokens), vocab] float32 log_softmax of ``logits`` (jax.nn.log_softmax, as training uses)."""
        return np.asarray(jax.nn.log_softmax(self.logits(tokens), axis=-1))


def top(lp: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, values) of the k largest entries of each row, descending, ties to the lower id."""
    ids = np.argsort(-lp, axis=-1, kind="stable")[..., :k]
    return ids, np.take_along_axis(lp, ids, axis=-1)


def ranked_ids_agree(want_ids, want_values, got_ids, margin: float) -> int:
    """The ranks where ``got_ids`` must equal ``want_ids``: up to the first rank whose value is within
    ``margin`` of the next (a near tie may be ordered either way); asserts them equal and returns how
    many ranks were compared."""
    n = len(got_ids)
    for i in range(n):
        if i + 1 < len(want_values) and want_values[i] - want_values[i + 1] <= margin:
            assert list(got_ids[:i]) == list(want_ids[:i])
            return i
    assert list(got_ids) == list(want_ids[:n])
    return n


def penalize(logits: np.ndarray, prompt, generated, presence: float, frequency: float, repetition: float):
    """vLLM's penalties on one row of logits (float64): the repetition penalty divides the positive logits
    (multiplies the negative ones) of tokens in the prompt or the output; then frequency × the count in
    the output and presence × (count > 0) are subtracted."""
    out = logits.astype(np.float64).copy()
    counts = np.bincount(np.asarray(generated, np.int64), minlength=len(out))[: len(out)]
    seen = np.zeros(len(out), bool)
    seen[list(prompt) + list(generated)] = True
    out[seen] = np.where(out[seen] > 0, out[seen] / repetition, out[seen] * repetition)
    return out - frequency * counts - presence * (counts > 0)


def penalized_greedy(
    forward: Forward, prompt, steps: int, *, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0
) -> tuple[list[int], list[float]]:
    """Greedy decoding of ``steps`` tokens with the penalties (the API's names) applied to the forward's
    logits at each step. Returns (tokens, the gap between the two largest penalized logits at each step)."""
    tokens, gaps = list(prompt), []
    for _ in range(steps):
        logits = forward.logits(tokens)[-1]
        row = penalize(logits, prompt, tokens[len(prompt) :], presence_penalty, frequency_penalty, repetition_penalty)
        first, second = np.sort(row)[-2:][::-1]
        gaps.append(float(first - second))
        tokens.append(int(np.argmax(row)))
    return tokens[len(prompt) :], gaps


def agree_under_margin(want: list[int], gaps: list[float], got: list[int], margin: float = 1e-4) -> int:
    """Tokens equal wherever the oracle's top-two gap exceeds ``margin``; at a near tie they may part, and
    then the rest is not compared (the histories differ). Returns the steps compared."""
    for i, (w, g) in enumerate(zip(want, got)):
        if w != g:
            assert gaps[i] <= margin, (i, want, got)
            return i
    assert len(want) == len(got), (want, got)
    return len(want)
