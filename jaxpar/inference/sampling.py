"""Token samplers for generation: temperature, top-k, top-p (nucleus) and min-p, set per sequence.

Every setting is an array with one entry per sequence, never a Python number, so one compiled decode
step serves any mix of requests: changing a request's temperature or top-p changes data, not the
program. Randomness is a function of (the request's seed, the position the token will occupy) alone:
each row draws with ``fold_in(key(seed), position)``, so a sequence samples the same tokens whatever
else shares its batch, and a request run again with its seed reproduces.

The filters apply in the order Hugging Face's ``generate`` applies its warpers, each to the distribution
the previous ones left (renormalised): temperature, top-k, top-p, min-p. One descending sort per row
serves all three cuts; the kept ranks are scattered back to vocabulary order. Temperature 0 means
greedy: the argmax of the raw logits, with none of the filters.

Legend: B batch (sequences), V vocabulary.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.errors import ConfigError

__all__ = ["SEEDS", "SamplingParams", "choice_seed", "filtered_logits", "sample"]

# Seeds are unsigned 32-bit integers everywhere (the CLI, the API, the engine): [0, SEEDS).
SEEDS = 2**32

# A running probability within this of top_p counts as reaching it, so float32 rounding (0.4 + 0.3
# summing to 0.69999999) cannot let one more token into the nucleus.
_TOP_P_SLACK = 1e-6


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-sequence sampling settings (a pytree of arrays, so jitted code takes them as data)."""

    temperature: jax.Array  # float32 [B]; 0 = greedy (argmax of the raw logits)
    top_k: jax.Array  # int32 [B]; 0 = off; keep the k most likely tokens
    top_p: jax.Array  # float32 [B]; 1 = off; keep the fewest most likely tokens summing to >= p
    min_p: jax.Array  # float32 [B]; 0 = off; keep tokens with probability >= min_p · the largest
    seed: jax.Array  # uint32 [B]; the request's seed

    @classmethod
    def make(cls, batch: int, *, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0) -> SamplingParams:
        """Settings for ``batch`` sequences; each argument is one number for all of them or a sequence
        of ``batch`` numbers. Checks every value on the host first and raises ``ConfigError`` naming the
        field and its command-line flag: temperature finite and >= 0, top_k an integer >= 0, top_p in
        (0, 1], min_p in [0, 1], seed an integer in [0, 2**32). NaN is refused everywhere."""
        columns = cls.check(batch, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
        return cls(**{name: jnp.asarray(column) for name, column in columns.items()})

    @property
    def draws(self) -> bool:
        """Whether any row draws (temperature > 0): the static ``draws`` of ``sample``. Host-side."""
        return bool(np.any(np.asarray(self.temperature) > 0))

    @staticmethod
    def check(batch: int = 1, *, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0) -> dict:
        """The checks of ``make`` on the host alone (no device work): {field: numpy [batch] array}."""
        if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
            raise ConfigError(f"batch = {batch!r} must be an integer >= 1")
        return dict(
            temperature=_column(
                "temperature",
                temperature,
                batch,
                np.float32,
                lambda v: math.isfinite(v) and v >= 0,
                "must be finite and >= 0",
            ),
            top_k=_column(
                "top_k",
                top_k,
                batch,
                np.int32,
                lambda v: 0 <= v < 2**31,
                "must be an integer in [0, 2**31)",
                integer=True,
            ),
            top_p=_column("top_p", top_p, batch, np.float32, lambda v: 0 < v <= 1, "must be in (0, 1]"),
            min_p=_column("min_p", min_p, batch, np.float32, lambda v: 0 <= v <= 1, "must be in [0, 1]"),
            seed=_column(
                "seed",
                seed,
                batch,
                np.uint32,
                lambda v: 0 <= v < SEEDS,
                "must be an integer in [0, 2**32)",
                integer=True,
            ),
        )

    @classmethod
    def greedy(cls, batch: int) -> SamplingParams:
        """Temperature 0 for every sequence: each step takes the most likely token."""
        return cls.make(batch)


def choice_seed(seed: int, index: int) -> int:
    """The seed of a request's choice ``index`` (n > 1 samples n choices): seed + index, wrapped into
    [0, SEEDS) so that every seed a request may give has n valid ones."""
    return (seed + index) % SEEDS


def _column(name: str, value, batch: int, dtype, ok, rule: str, integer: bool = False) -> np.ndarray:
    """One field as a [batch] array of ``dtype``, after checking every entry with ``ok`` (a
    ConfigError naming ``name``, its flag and ``rule`` for the first entry that fails)."""
    where = f"{name} (--{name.replace('_', '-')})"
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError):
        arr = np.asarray(None)  # ragged nesting: refused below as not numbers
    if arr.ndim > 1 or arr.dtype.kind not in "iuf":
        raise ConfigError(f"{where} = {value!r} must be a number or a sequence of {batch} numbers")
    if arr.ndim == 1 and arr.shape[0] != batch:
        raise ConfigError(f"{where} has {arr.shape[0]} values for a batch of {batch}: give one value or {batch}")
    for i, v in enumerate(arr.reshape(-1).tolist()):
        whole = not integer or (math.isfinite(v) and float(v).is_integer())
        if not (whole and ok(v)):
            index = f"[{i}]" if arr.ndim else ""
            raise ConfigError(f"{where}{index} = {v!r} {rule}")
    return np.broadcast_to(arr, (batch,)).astype(dtype)


def _support(row: jax.Array, k: jax.Array, p: jax.Array, m: jax.Array) -> jax.Array:
    """Temperature-scaled logits [V] of one row -> bool [V]: the tokens top-k, then top-p, then
    min-p keep. Ties at the top-k boundary go to the lower token id, so exactly k survive."""
    vocab = row.shape[-1]
    # Descending, ties to the lower id: rank r holds token order[r]. A stable sort of -row, not
    # lax.top_k, which XLA's partitioner runs on all-gathered logits when the batch is split.
    negated, order = jax.lax.sort((-row, jnp.arange(vocab)), num_keys=1, is_stable=True)
    values = -negated
    rank = jnp.arange(vocab)
    keep = (k <= 0) | (rank < k)
    # top-p on the top-k survivors, renormalised: keep rank r while the ranks before it sum to < p.
    probs = jax.nn.softmax(jnp.where(keep, values, -jnp.inf))
    before = jnp.concatenate([jnp.zeros(1, probs.dtype), jnp.cumsum(probs)[:-1]])
    keep &= (p >= 1) | (before < p - _TOP_P_SLACK) | (rank == 0)
    # min-p compares each probability with the largest one; renormalising leaves that ratio alone.
    keep &= jnp.exp(values - values[0]) >= m
    return jnp.zeros(vocab, bool).at[order].set(keep)


def filtered_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """logits float32 [B, V] -> logits / temperature, with every token the filters drop set to -inf.

    Sampling from the result (softmax) draws from the distribution temperature, top-k, top-p and
    min-p leave, in that order. Rows with temperature 0 come back unscaled and unfiltered: their
    caller takes the argmax, and they are never divided by zero.
    """
    t = params.temperature[:, None]
    greedy = t == 0
    scaled = logits / jnp.where(greedy, jnp.ones_like(t), t)
    keep = jax.vmap(_support)(scaled, params.top_k, params.top_p, params.min_p)
    return jnp.where(greedy | keep, scaled, -jnp.inf)


def sample(logits: jax.Array, params: SamplingParams, positions: jax.Array, *, draws: bool) -> jax.Array:
    """logits float32 [B, V], positions int32 [B] (where each sampled token will sit) -> token ids int32 [B].

    Greedy rows (temperature 0) take the argmax of their logits. The others draw from
    ``filtered_logits`` with the key ``fold_in(key(seed), position)`` of their own row, so a row's
    token depends only on its own logits, settings, seed and position.

    ``draws`` (static, ``SamplingParams.draws`` on the host): whether the program can draw at all. A
    program without it is the argmax alone and holds no per-row sort. The choice is made on the host,
    not by a ``lax.cond`` in the program: on a GPU a conditional reads its predicate back to the host,
    which stalls the host's dispatch until the step's forward is done and splits XLA's command buffer.
    """
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not draws:
        return greedy
    keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(params.seed, positions)
    drawn = jax.vmap(jax.random.categorical)(keys, filtered_logits(logits, params))
    return jnp.where(params.temperature == 0, greedy, drawn).astype(jnp.int32)
