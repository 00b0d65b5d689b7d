"""jaxpar.inference.sampling: the exact support of each filter and of their combinations, per-row
settings in one batch without recompiling, greedy and near-greedy rows, seeds and batch independence,
chi-square tests of the sampled frequencies, and the host-side validation of SamplingParams.make.

The compiled functions are module-level and every test reuses a few shapes, so the file compiles a
handful of tiny programs in all.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxpar.errors import ConfigError
from jaxpar.inference.sampling import SamplingParams, filtered_logits, sample

_filtered = jax.jit(filtered_logits)
_sample = jax.jit(functools.partial(sample, draws=True))

# Five tokens in shuffled vocabulary order: token ORDER[r] has the r-th largest probability PROBS[r].
PROBS = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
ORDER = np.array([3, 0, 4, 1, 2])
LOGITS = np.empty(5, np.float32)
LOGITS[ORDER] = np.log(PROBS) + 2.5  # unnormalised: only differences matter
TIES = np.array([1.0, 1.0, 1.0, 0.0, 0.0], np.float32)
# float32 sums 0.3 + 0.25 to just under float32(0.55): top_p=0.55 must still stop at two tokens.
BOUNDARY = np.empty(5, np.float32)
BOUNDARY[ORDER] = np.log([0.3, 0.25, 0.15, 0.15, 0.15]) + 2.5
# the tail's probability (1e-11) is lost in float32 running sums, which reach 1 after token 0
TINY = np.array([0.0, -25.0, -26.0, -27.0, -28.0], np.float32)


def _ranks(*ranks: int) -> set[int]:
    """The token ids holding these ranks (0: the most likely) in LOGITS and BOUNDARY."""
    return {int(ORDER[r]) for r in ranks}


# (settings, logits, the token ids the filters keep)
SUPPORT_CASES = {
    "no filters": (dict(temperature=1.0), LOGITS, _ranks(0, 1, 2, 3, 4)),
    "top_k=1": (dict(temperature=1.0, top_k=1), LOGITS, _ranks(0)),
    "top_k=2": (dict(temperature=1.0, top_k=2), LOGITS, _ranks(0, 1)),
    "top_k=5": (dict(temperature=1.0, top_k=5), LOGITS, _ranks(0, 1, 2, 3, 4)),
    "top_k=9 (> vocabulary)": (dict(temperature=1.0, top_k=9), LOGITS, _ranks(0, 1, 2, 3, 4)),
    "top_p=0.3 (best token kept)": (dict(temperature=1.0, top_p=0.3), LOGITS, _ranks(0)),
    "top_p=1e-7 (best token kept)": (dict(temperature=1.0, top_p=1e-7), LOGITS, _ranks(0)),
    "top_p=0.4": (dict(temperature=1.0, top_p=0.4), LOGITS, _ranks(0)),
    "top_p=0.7 (exactly reached)": (dict(temperature=1.0, top_p=0.7), LOGITS, _ranks(0, 1)),
    "top_p=0.71": (dict(temperature=1.0, top_p=0.71), LOGITS, _ranks(0, 1, 2)),
    "top_p=0.8": (dict(temperature=1.0, top_p=0.8), LOGITS, _ranks(0, 1, 2)),
    "top_p=1": (dict(temperature=1.0, top_p=1.0), LOGITS, _ranks(0, 1, 2, 3, 4)),
    "min_p=0.3 (p >= 0.12)": (dict(temperature=1.0, min_p=0.3), LOGITS, _ranks(0, 1, 2)),
    "min_p=0.24 (p >= 0.096)": (dict(temperature=1.0, min_p=0.24), LOGITS, _ranks(0, 1, 2, 3)),
    "min_p=1": (dict(temperature=1.0, min_p=1.0), LOGITS, _ranks(0)),
    # top-p sees the top-3 renormalised (0.47, 0.35, 0.18): 0.8 keeps two, not three.
    "top_k=3 then top_p=0.8": (dict(temperature=1.0, top_k=3, top_p=0.8), LOGITS, _ranks(0, 1)),
    "top_k=3 then min_p=0.5": (dict(temperature=1.0, top_k=3, min_p=0.5), LOGITS, _ranks(0, 1)),
    "top_p=0.5 then min_p=0.9": (dict(temperature=1.0, top_p=0.5, min_p=0.9), LOGITS, _ranks(0)),
    # temperature comes first: 0.5 sharpens to (0.56, 0.32, 0.08, ...), 2 flattens to (0.30, 0.26, 0.18, 0.15, ...)
    "temperature=0.5 then top_p=0.8": (dict(temperature=0.5, top_p=0.8), LOGITS, _ranks(0, 1)),
    "temperature=2 then top_p=0.8": (dict(temperature=2.0, top_p=0.8), LOGITS, _ranks(0, 1, 2, 3)),
    "temperature=0.5 then min_p=0.3": (dict(temperature=0.5, min_p=0.3), LOGITS, _ranks(0, 1)),
    "temperature=2 then min_p=0.3": (dict(temperature=2.0, min_p=0.3), LOGITS, _ranks(0, 1, 2, 3, 4)),
    "top_k=2 among ties keeps exactly 2": (dict(temperature=1.0, top_k=2), TIES, {0, 1}),
    "top_p=0.55 reached in float32 rounding": (dict(temperature=1.0, top_p=0.55), BOUNDARY, _ranks(0, 1)),
    "top_p=0.3 reached in float32 rounding": (dict(temperature=1.0, top_p=0.3), BOUNDARY, _ranks(0)),
    "top_p=1 keeps a 1e-11 tail": (dict(temperature=1.0, top_p=1.0), TINY, {0, 1, 2, 3, 4}),
}


def _params(rows: list[dict]) -> SamplingParams:
    """One SamplingParams whose row i has the settings rows[i] (the rest at their defaults)."""
    fields = {name for row in rows for name in row}
    defaults = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0)
    return SamplingParams.make(len(rows), **{f: [row.get(f, defaults[f]) for row in rows] for f in fields})


@pytest.fixture(scope="module")
def one_batch():
    """Every support case as a row of ONE batch (plus a greedy row), filtered by one call."""
    cases = list(SUPPORT_CASES.values())
    rows = [case[0] for case in cases] + [dict(temperature=0.0, top_k=1, top_p=0.1, min_p=1.0)]
    logits = np.stack([case[1] for case in cases] + [LOGITS])
    return logits, np.asarray(_filtered(jnp.asarray(logits), _params(rows)))


@pytest.mark.parametrize("name", list(SUPPORT_CASES))
def test_support_per_row_in_one_batch(one_batch, name):
    logits, out = one_batch
    i = list(SUPPORT_CASES).index(name)
    settings, _, tokens = SUPPORT_CASES[name]
    assert set(np.flatnonzero(np.isfinite(out[i])).tolist()) == tokens
    kept = sorted(tokens)
    np.testing.assert_allclose(out[i, kept], logits[i, kept] / settings["temperature"], rtol=1e-6)
    assert np.all(out[i, np.setdiff1d(np.arange(5), kept)] == -np.inf)


def test_greedy_row_is_returned_unscaled_and_unfiltered(one_batch):
    logits, out = one_batch
    np.testing.assert_array_equal(out[-1], logits[-1])


def test_changing_settings_does_not_recompile():
    traces = []

    @jax.jit
    def f(logits, params, positions):
        traces.append(1)
        return sample(logits, params, positions, draws=True)

    logits = jnp.asarray(np.stack([LOGITS] * 4))
    positions = jnp.arange(4, dtype=jnp.int32)
    out = [
        f(logits, SamplingParams.make(4, **kw), positions)
        for kw in (
            dict(),
            dict(temperature=1.0, top_k=1),
            dict(temperature=[0.0, 0.7, 1.0, 2.0], top_p=[1.0, 0.5, 0.9, 0.2]),
            dict(temperature=1.5, min_p=0.3, seed=[1, 2, 3, 2**32 - 1]),
            dict(seed=5),
        )
    ]
    assert len(traces) == 1 and f._cache_size() == 1
    assert np.all(np.asarray(out[1]) == ORDER[0])  # top_k=1: the best token whatever the draw


N, V = 20_000, 6  # the shape of every sample() test below
PROBS6 = np.array([0.3, 0.25, 0.2, 0.12, 0.08, 0.05])
LOGITS6 = np.log(PROBS6).astype(np.float32) - 1.0


def _draw(logits=None, positions=None, **settings) -> np.ndarray:
    """N tokens of the [N, V] program: same logits (LOGITS6 by default) and positions 0..N-1."""
    logits = np.broadcast_to(LOGITS6, (N, V)) if logits is None else logits
    positions = np.arange(N, dtype=np.int32) if positions is None else positions
    return np.asarray(_sample(jnp.asarray(logits), SamplingParams.make(N, **settings), jnp.asarray(positions)))


def test_temperature_zero_is_argmax():
    logits = np.random.default_rng(0).normal(size=(N, V)).astype(np.float32)
    np.testing.assert_array_equal(_draw(logits, seed=np.arange(N), top_k=2, top_p=0.3), logits.argmax(-1))


def test_tiny_temperature_is_argmax():
    rng = np.random.default_rng(1)
    logits = np.stack([rng.permutation(V) for _ in range(N)]).astype(np.float32)  # gaps of at least 1
    np.testing.assert_array_equal(_draw(logits, temperature=1e-3, seed=rng.integers(0, 2**32, N)), logits.argmax(-1))


def test_seed_reproduces_and_different_seeds_differ():
    a = _draw(temperature=1.0, seed=7)
    np.testing.assert_array_equal(a, _draw(temperature=1.0, seed=7))
    assert np.mean(a == _draw(temperature=1.0, seed=8)) < 0.4  # independent draws: about 0.2
    assert np.mean(a == _draw(temperature=1.0, seed=7, positions=np.arange(N) + N)) < 0.4
    assert len(set(a[:100].tolist())) > 1  # positions vary the key too


def test_row_does_not_depend_on_its_batch_mates():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(N, V)).astype(np.float32)
    settings = dict(
        temperature=rng.uniform(0.5, 2, N),
        top_k=rng.integers(0, 7, N),
        top_p=rng.uniform(0.3, 1, N),
        min_p=rng.uniform(0, 0.3, N),
        seed=rng.integers(0, 2**32, N),
    )
    positions = rng.integers(0, 4096, N).astype(np.int32)
    a = _draw(logits, positions, **settings)
    half = N // 2  # rows from half on: other logits, settings and seeds
    logits[half:] = rng.normal(size=(N - half, V))
    for value in settings.values():
        value[half:] = np.roll(value[half:], 1)
    settings["temperature"][half::3] = 0.0
    b = _draw(logits, positions, **settings)
    np.testing.assert_array_equal(a[:half], b[:half])
    assert np.mean(a[half:] == b[half:]) < 0.9
    flipped = _draw(logits[::-1], positions[::-1], **{k: v[::-1] for k, v in settings.items()})
    np.testing.assert_array_equal(flipped[::-1], b)  # rows in reverse order: same tokens
    for i in (0, 1, half - 1):  # and alone, in a batch of one
        alone = _sample(
            jnp.asarray(logits[i : i + 1]),
            SamplingParams.make(1, **{k: v[i : i + 1] for k, v in settings.items()}),
            jnp.asarray(positions[i : i + 1]),
        )
        assert int(alone[0]) == a[i]


# (settings, the support they leave, as indices into PROBS6); the expected law is PROBS6 ** (1 / T)
# restricted to that support and renormalised.
CHI_SQUARE_CASES = {
    "temperature=1": (dict(temperature=1.0), [0, 1, 2, 3, 4, 5]),
    "top_k=3": (dict(temperature=1.0, top_k=3), [0, 1, 2]),
    "temperature=0.5": (dict(temperature=0.5), [0, 1, 2, 3, 4, 5]),
    "top_p=0.6": (dict(temperature=1.0, top_p=0.6), [0, 1, 2]),
    "min_p=0.3": (dict(temperature=1.0, min_p=0.3), [0, 1, 2, 3]),
    # T=2: (0.23, 0.21, 0.19, 0.15, ...); top-4 renormalised (0.30, 0.27, 0.24, 0.19); top_p=0.7 keeps
    # three; min_p=0.85 then drops the third (0.24 / 0.30 = 0.82).
    "temperature=2 top_k=4 top_p=0.7 min_p=0.85": (dict(temperature=2.0, top_k=4, top_p=0.7, min_p=0.85), [0, 1]),
}


@pytest.mark.parametrize("name", list(CHI_SQUARE_CASES))
def test_chi_square(name):
    settings, support = CHI_SQUARE_CASES[name]
    tokens = _draw(seed=2024, **settings)
    counts = np.bincount(tokens, minlength=V)
    assert counts[np.setdiff1d(np.arange(V), support)].sum() == 0
    law = PROBS6[support] ** (1 / settings["temperature"])
    expected = N * law / law.sum()
    assert stats.chisquare(counts[support], expected).pvalue > 1e-3


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(temperature=math.inf), "temperature"),
        (dict(temperature=[1.0, -0.5, 1.0]), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=math.nan), "top_p"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=2.0), "min_p"),
        (dict(min_p=math.nan), "min_p"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=1.5), "top_k"),
        (dict(top_k=math.nan), "top_k"),
        (dict(top_k="3"), "top_k"),
        (dict(seed=-1), "seed"),
        (dict(seed=2**32), "seed"),
        (dict(seed=0.5), "seed"),
        (dict(top_p=[0.5, 0.9]), "top_p"),
        (dict(seed=[1, 2, 3, 4]), "seed"),
        (dict(top_k=[[1, 2, 3]]), "top_k"),
    ],
)
def test_bad_values_raise_config_error_naming_the_field(kwargs, field):
    with pytest.raises(ConfigError) as err:
        SamplingParams.make(3, **kwargs)
    message = str(err.value)
    assert message.startswith(f"{field} (--{field.replace('_', '-')})"), message
    value = next(iter(kwargs.values()))
    if isinstance(value, list) and not isinstance(value[0], list) and len(value) != 3:
        assert f"{len(value)} values for a batch of 3" in message


def test_make_broadcasts_and_keeps_the_edges():
    p = SamplingParams.make(
        3, temperature=[0.0, 0.5, 2.0], top_k=4, top_p=1.0, min_p=[0.0, 1.0, 0.5], seed=[0, 2**32 - 1, 3.0]
    )
    assert [(x.dtype, x.shape) for x in (p.temperature, p.top_k, p.top_p, p.min_p, p.seed)] == [
        (jnp.float32, (3,)),
        (jnp.int32, (3,)),
        (jnp.float32, (3,)),
        (jnp.float32, (3,)),
        (jnp.uint32, (3,)),
    ]
    assert p.seed.tolist() == [0, 2**32 - 1, 3] and p.top_k.tolist() == [4, 4, 4]
    assert SamplingParams.greedy(2).temperature.tolist() == [0.0, 0.0]
    with pytest.raises(ConfigError, match="batch"):
        SamplingParams.make(0)
