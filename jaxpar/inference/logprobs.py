"""Log-probabilities and repetition penalties inside the engine's step program.

A step holding a row whose request asks for ``logprobs`` computes, on the device, the log-probability of
each row's sampled token and the ``K`` most likely tokens with theirs, so that [slots, 2K + 1] numbers
come back, never a [slots, V] row (a step where no row asks runs a program without them). They are
of the model's raw distribution: ``log_softmax`` of the float32 logits over the real vocabulary (the
padded ids cut off), before penalties, temperature and the top-k/top-p/min-p filters. A request keeps
them when its settings hold ``logprobs`` (how many alternatives); the speculative path, which brings its
raw logits to the host anyway, computes them there (``host_scores``).

A row whose request asks for ``prompt_logprobs`` (``echo`` with ``logprobs``) also gets, at each fed
prompt position p, the log-probability of the prompt token at p + 1 and the top ``K`` there, computed
over the whole chunk [slots, t, V] on the device. That runs and comes to the host only when some row
of the call asks; the scheduler gives such a request no pages from the prefix cache, so
every position of its prompt is computed.

Penalties follow vLLM: each row's generated tokens are counted; ``repetition_penalty`` r divides the
positive logits (multiplies the negative ones) of every token seen in the prompt or the output, then
``frequency_penalty`` × count and ``presence_penalty`` × (count > 0) are subtracted. The counts are
built on the device from each penalized row's token ids ([slots, max_length] int32, sent with the step:
a few kB per call, no state that slot reuse, preemption, the prefix cache or a rejected guess could leave
stale). Rows with every penalty off keep their logits bit for bit, and a call where no row has one skips
the counting.

What a call needs is read on the host from its inputs (``Features.of``), and each set of needs is a
program of its own (compiled once, then kept), never a ``lax.cond``: on a GPU a conditional reads its
predicate back to the host, which stalls the host until the step's forward is done and splits XLA's
command buffer (CUDA graph) in two.

Legend: B rows (slots), t positions per row, V vocabulary (padded), L the engine's max_length.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.errors import ConfigError
from jaxpar.inference.sampling import filtered_logits, sample

K = 20  # alternatives computed per position: the most a request may ask for
PENALTIES = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}  # off


class TokenScore(NamedTuple):
    """A token's log-probability and the most likely tokens at its position (ids, log-probabilities)."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


def check_settings(sampling: dict) -> None:
    """Refuses penalties and log-prob settings out of range (``ConfigError`` naming the field):
    presence and frequency penalties finite in [-2, 2], repetition penalty finite and > 0, logprobs None
    or an integer in [0, K]."""
    for name, default in PENALTIES.items():
        value = sampling.get(name, default)
        low, high = (0.0, math.inf) if name == "repetition_penalty" else (-2.0, 2.0)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not (ok and (low < value if name == "repetition_penalty" else low <= value) and value <= high):
            rule = "finite and > 0" if name == "repetition_penalty" else "finite, in [-2, 2]"
            raise ConfigError(f"{name} = {value!r} must be {rule}")
    n = sampling.get("logprobs")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= K):
        raise ConfigError(f"logprobs = {n!r} must be None or an integer in [0, {K}]")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepExtras:
    """Per-row inputs of one step besides the model's: the penalties, the tokens they count, and the prompt
    tokens whose log-probabilities are wanted."""

    presence: jax.Array  # float32 [B]; 0 = off
    frequency: jax.Array  # float32 [B]; 0 = off
    repetition: jax.Array  # float32 [B]; 1 = off
    history: jax.Array  # int32 [B, L]: a penalized row's tokens at positions 0 … start (its first fed), then -1
    split: jax.Array  # int32 [B]: the row's prompt length (tokens at positions ≥ split were generated)
    targets: jax.Array  # int32 [B, t]: at fed position j, the prompt token at j + 1 when its log-prob is wanted
    scored: jax.Array  # bool [B]: the row keeps its sampled token's log-prob

    @classmethod
    def build(cls, rows, slots: int, t: int, length: int, *, plain: bool = False) -> StepExtras:
        """The extras of a call of width t; rows: (request, first position, tokens fed). ``plain``: none
        (the draft's greedy calls). Fed positions past a row's history (a draft's later guesses) are
        counted from the fed tokens."""
        pen = np.array([[0.0], [0.0], [1.0]], np.float32).repeat(slots, axis=1)
        history = np.full((slots, length), -1, np.int32)
        split = np.zeros(slots, np.int32)
        targets = np.full((slots, t), -1, np.int32)
        scored = np.zeros(slots, bool)
        for r, start, fed in [] if plain else rows:
            want, s = r.sampling or {}, r.slot
            values = [float(want.get(k, d)) for k, d in PENALTIES.items()]
            if values != list(PENALTIES.values()):
                pen[:, s] = values
                seen = r.tokens[: start + 1]
                history[s, : len(seen)], split[s] = seen, len(r.prompt)
            scored[s] = want.get("logprobs") is not None
            if want.get("prompt_logprobs"):
                n = max(0, min(len(fed), len(r.prompt) - 1 - start))
                targets[s, :n] = r.prompt[start + 1 : start + 1 + n]
        return cls(*pen, history, split, targets, scored)


# ---------------------------------------------------------------------------------------------- device
def log_probs(logits: jax.Array, vocab: int) -> jax.Array:
    """[..., V] logits -> float32 [..., vocab] log-probabilities over the real vocabulary."""
    return jax.nn.log_softmax(logits[..., :vocab].astype(jnp.float32), axis=-1)


def pick(lp: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """lp [..., V], tokens [...] -> (the tokens' log-probs [...], the top K log-probs [..., K] and
    their ids [..., K], ties to the lower id)."""
    chosen = jnp.take_along_axis(lp, tokens[..., None], axis=-1)[..., 0]
    top, ids = jax.lax.top_k(lp, min(K, lp.shape[-1]))
    return chosen, top, ids.astype(jnp.int32)


def _active(x: StepExtras) -> jax.Array:
    return (x.presence != 0) | (x.frequency != 0) | (x.repetition != 1)


def _counts(x: StepExtras, ids: jax.Array, positions: jax.Array, upto: jax.Array, vocab: int):
    """(generated-token counts float32 [B, V], seen-anywhere bool [B, V]) of each row's history and its
    fed tokens ids[:, 1 … upto] (the tokens before the position whose logits are penalized)."""
    b, length = x.history.shape
    j = jnp.arange(ids.shape[1])[None, :]
    fed = jnp.where((j >= 1) & (j <= upto[:, None]) & (positions >= 0), ids, -1)
    every = jnp.concatenate([x.history, fed], axis=1)
    where = jnp.concatenate([jnp.broadcast_to(jnp.arange(length), (b, length)), positions], axis=1)
    valid = every >= 0
    rows, safe = jnp.arange(b)[:, None], jnp.where(valid, every, 0)
    generated = (valid & (where >= x.split[:, None])).astype(jnp.float32)
    counts = jnp.zeros((b, vocab), jnp.float32).at[rows, safe].add(generated)
    seen = jnp.zeros((b, vocab), jnp.int32).at[rows, safe].add(valid.astype(jnp.int32)) > 0
    return counts, seen


def _penalize(logits: jax.Array, x: StepExtras, counts: jax.Array, seen: jax.Array) -> jax.Array:
    """logits [B, V] with each row's penalties applied (rows with all of them off unchanged, bit for bit)."""
    r = x.repetition[:, None]
    out = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    out = out - x.frequency[:, None] * counts - x.presence[:, None] * (counts > 0)
    return jnp.where(_active(x)[:, None], out, logits)


class Features(NamedTuple):
    """What a step program holds besides the model and the argmax (static: one program per set)."""

    draws: bool = False  # some row samples (temperature > 0): the per-row sort and draw
    penalties: bool = False  # some row has a penalty on: the token counts
    logprobs: bool = False  # some row keeps its sampled token's log-prob
    prompt_logprobs: bool = False  # some row asks its prompt's log-probs

    @classmethod
    def of(cls, params, x: StepExtras) -> Features:
        """The features a call with these inputs (on the host) needs."""
        active = (np.asarray(x.presence) != 0) | (np.asarray(x.frequency) != 0) | (np.asarray(x.repetition) != 1)
        scored, targets = np.asarray(x.scored), np.asarray(x.targets)
        return cls(params.draws, bool(active.any()), bool(scored.any()), bool((targets >= 0).any()))


def step_outputs(logits, ids, positions, last, params, x: StepExtras, vocab: int, features: Features) -> dict:
    """The outputs of a step of width t: each row's token sampled (penalized) at its ``last`` position,
    that position's raw logits (``row``), where ``scored`` asks the token's log-prob with the top K, and
    where ``targets`` asks the prompt's log-probs at every fed position (zeros when ``features`` has
    none: no row asks)."""
    b, t, v = logits.shape
    row = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]  # [B, V]
    at = jnp.take_along_axis(positions, last[:, None], axis=1)[:, 0] + 1
    penalized = _penalize(row, x, *_counts(x, ids, positions, last, v)) if features.penalties else row
    tokens = sample(penalized, params, at, draws=features.draws)

    def scores(wanted: bool, lp_of, chosen):  # pick() where some row asks, else zeros of its shapes
        lead, k = chosen.shape, min(K, vocab)
        if wanted:
            return pick(log_probs(lp_of, vocab), chosen)
        return jnp.zeros(lead, jnp.float32), jnp.zeros((*lead, k), jnp.float32), jnp.zeros((*lead, k), jnp.int32)

    chosen = scores(features.logprobs, row, tokens)
    prompt = scores(features.prompt_logprobs, logits, jnp.maximum(x.targets, 0))
    return dict(tokens=tokens, row=row, chosen=chosen, prompt=prompt)


def verify_outputs(logits, ids, positions, params, x: StepExtras, features: Features) -> tuple[jax.Array, jax.Array]:
    """(raw logits, filtered logits) [B, t, V] of every position of a verification: position j is
    penalized with the row's history and its fed tokens 1 … j (the guesses before it), when
    ``features.penalties``."""
    b, t, v = logits.shape
    scored = logits
    if features.penalties:
        cols = [_penalize(logits[:, j], x, *_counts(x, ids, positions, jnp.full(b, j), v)) for j in range(t)]
        scored = jnp.stack(cols, axis=1)
    each = jax.tree.map(lambda a: jnp.repeat(a, t), params)
    return logits, filtered_logits(scored.reshape(b * t, v), each).reshape(b, t, v)


# ------------------------------------------------------------------------------------------------ host
def fetch(out, x: StepExtras, *, rows: bool):
    """A call's outputs on the host: the logits rows only when ``rows``, the log-probs only when some row
    of ``x`` (the call's extras, on the host) asks for them (a verification's pair of logits always)."""
    if isinstance(out, tuple):
        return tuple(np.asarray(a) for a in jax.device_get(out))
    keep = dict(row=rows, chosen=bool(x.scored.any()), prompt=bool((x.targets >= 0).any()))
    return jax.device_get({k: v for k, v in out.items() if keep.get(k, True)})


def record(rows, out: dict) -> None:
    """Keeps the log-probs each row's request asked for: the sampled token's (when the row samples) in
    ``token_logprobs``, its prompt's (when it asked for ``prompt_logprobs``) in ``prompt_logprobs``,
    indexed by position (the first is None). A request that ends on a stop token before using every
    token it was given keeps records past ``generated``; nothing reads them."""
    for r, start, fed in rows:
        want, s = r.sampling or {}, r.slot
        n = want.get("logprobs")
        if n is None:
            continue
        if start + len(fed) == len(r.tokens):
            chosen, top, ids = (a[s] for a in out["chosen"])
            r.token_logprobs.append(TokenScore(float(chosen), ids[:n].tolist(), top[:n].tolist()))
        if want.get("prompt_logprobs") and "prompt" in out:
            chosen, top, ids = (a[s] for a in out["prompt"])
            if r.prompt_logprobs is None:
                r.prompt_logprobs = [None] * len(r.prompt)
            for j in range(max(0, min(len(fed), len(r.prompt) - 1 - start))):
                score = TokenScore(float(chosen[j]), ids[j, :n].tolist(), top[j, :n].tolist())
                r.prompt_logprobs[start + j + 1] = score


def host_scores(raw: np.ndarray, tokens: list[int], vocab: int, n: int) -> list[TokenScore]:
    """The log-probs of ``tokens`` under their raw logits rows [len(tokens), V] and the top n of each
    (float32, ties to the lower id), computed on the host (the speculative path)."""
    x = np.asarray(raw[: len(tokens), :vocab], np.float32)
    shifted = x - x.max(axis=-1, keepdims=True)
    lp = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    order = np.argsort(-lp, axis=-1, kind="stable")[:, :n]
    return [TokenScore(float(lp[i, t]), order[i].tolist(), lp[i, order[i]].tolist()) for i, t in enumerate(tokens)]
