"""The serving engine: continuous batching gives each request exactly what it gets alone."""

import dataclasses

import numpy as np
import pytest
from flax import nnx

from jaxpar.inference.engine import Engine
from jaxpar.inference.scheduler import Request
from jaxpar.models import build_model, get_model_preset


@pytest.fixture(scope="module")
def tiny():
    return build_model(get_model_preset("tiny"), rngs=nnx.Rngs(0))


def _engine(model, **kw):
    return Engine(model, max_slots=4, page_size=8, max_length=64, chunk=16, record_logits=True, **kw)


def _requests(n, seed=0):
    rng = np.random.default_rng(seed)
    return [
        Request(i, [int(t) for t in rng.integers(0, 256, rng.integers(1, 40))], max_new_tokens=int(rng.integers(1, 20)))
        for i in range(n)
    ]


def test_batched_equals_alone_bitwise(tiny):
    """200 requests of random prompt and output lengths arriving at random steps (Poisson, 2 per step
    on average): each one's tokens and every logit row equal those it gets alone in the same engine. After
    every step the allocator's invariants hold, and every write of every call landed in a page held by its
    sequence alone and shared by no prompt (``check_writes``). No program is compiled or traced after
    ``warm_up``."""
    engine = _engine(tiny, check_writes=True)
    engine.warm_up()
    compiled = engine.compiles
    traced = {key: program._cache_size() for key, program in engine._programs.items()}
    reqs = _requests(200)
    arrivals = np.cumsum(np.random.default_rng(1).poisson(0.5, len(reqs)))
    step = 0
    while step <= arrivals[-1] or not engine.idle:
        for r, at in zip(reqs, arrivals):
            if at == step:
                engine.submit(r)
        engine.step()
        engine.pages.check()
        step += 1
    assert engine.compiles == compiled  # nothing compiled after warm-up
    assert {key: program._cache_size() for key, program in engine._programs.items()} == traced  # nor traced
    assert max(s.decoded for s in engine.log) >= 3 and max(s.prefilled for s in engine.log) > 16
    assert engine.pages.used == 0
    alone = _engine(tiny)
    for r in reqs:
        single = Request(r.id, r.prompt, r.max_new_tokens)
        alone.run([single])
        assert single.tokens == r.tokens
        np.testing.assert_array_equal(np.stack(alone.logits[r.id]), np.stack(engine.logits[r.id]))


def _agree_under_margin(a: Request, b: Request, logits_a, tol: float) -> int:
    """Tokens equal wherever the top-two gap of a's logits exceeds tol; after the first position where
    they may differ, the rest is not compared. Returns the positions compared."""
    gen_a, gen_b = a.tokens[len(a.prompt) :], b.tokens[len(b.prompt) :]
    for i, (x, y) in enumerate(zip(gen_a, gen_b)):
        top2 = np.sort(logits_a[i])[-2:]
        if top2[1] - top2[0] <= tol:
            return i
        assert x == y, (a.id, i)
    assert len(gen_a) == len(gen_b)
    return len(gen_a)


def _compared_with_alone(tiny, reqs) -> list[int]:
    """Per request: the generated positions where it agrees with itself run alone in a plain engine
    (``_agree_under_margin``, 1e-4)."""
    alone = _engine(tiny)
    out = []
    for r in reqs:
        single = Request(r.id, r.prompt, r.max_new_tokens)
        alone.run([single])
        out.append(_agree_under_margin(single, r, alone.logits[r.id], 1e-4))
    return out


def test_preemption_recomputes_and_agrees_under_the_margin(tiny):
    """A pool too small for four sequences at once: sequences are preempted, recomputed through prefill
    chunks, and still give the tokens they give alone wherever the top-two logit gap exceeds 1e-4."""
    engine = Engine(tiny, max_slots=4, page_size=8, max_length=64, chunk=16, num_pages=13, record_logits=True)
    reqs = [Request(i, list(range(i, i + 20)), max_new_tokens=30) for i in range(6)]
    for r in reqs:
        engine.submit(r)
    while not engine.idle:
        engine.step()
        engine.pages.check()
    assert sum(r.preemptions for r in reqs) > 0 and engine.pages.used == 0
    assert sum(_compared_with_alone(tiny, reqs)) >= 0.9 * sum(r.max_new_tokens for r in reqs)


def test_shared_prefix_pages_are_never_written(tiny):
    """Eight requests behind one 20-token system prompt (two full pages of 8), the first alone until its
    prompt is in, then the rest: they find its pages, every write of every step lands in a page of the
    writer's own (``check_writes``), the invariants hold, and the tokens agree with running alone under
    the margin rule (a shared prefix is computed once, the rest of the prompt in other chunks)."""
    engine = _engine(tiny, check_writes=True)
    system = list(range(100, 120))
    reqs = [Request(i, system + [i + 1] * (i + 1), max_new_tokens=8) for i in range(8)]
    engine.submit(reqs[0])
    while reqs[0].generated == 0:
        engine.step()
    for r in reqs[1:]:
        engine.submit(r)
    while not engine.idle:
        engine.step()
        engine.pages.check()
    assert engine.pages.hits == 7 * 2 and engine.pages.used == 0
    assert sum(_compared_with_alone(tiny, reqs)) >= 0.9 * 8 * len(reqs)


def test_speculative_greedy_equals_plain_greedy(tiny):
    """n-gram drafts, k = 4, verified in one pass of width 5: the greedy tokens of plain decoding
    (under the margin rule: width 5 and width 1 round differently), with guesses kept on repetitive
    prompts; all pages back at the end."""
    prompts = [[5, 6, 7, 8] * 6, [9, 1, 9, 1, 9, 1, 9, 1, 9], list(range(30, 50))]
    spec = Engine(tiny, max_slots=4, page_size=8, max_length=64, chunk=16, record_logits=True, speculate=4)
    spec.warm_up()
    compiled = spec.compiles
    fast = [Request(i, p, max_new_tokens=24) for i, p in enumerate(prompts)]
    spec.run(fast)
    assert spec.compiles == compiled and spec.pages.used == 0
    assert sum(_compared_with_alone(tiny, fast)) >= 0.9 * 24 * len(prompts)
    report = spec.acceptance()
    assert report["verifications"] < 24 * len(prompts) and sum(report["histogram"]) == report["verifications"]
    assert report["rate"] > 0


def test_speculative_sampling_runs_and_reproduces(tiny):
    def once():
        engine = Engine(tiny, max_slots=2, page_size=8, max_length=64, chunk=16, speculate=3)
        reqs = [Request(i, [3, 4, 5] * 5, max_new_tokens=20) for i in range(2)]
        engine.run(reqs, sampling=dict(temperature=1.0, top_k=20, seed=7))
        return [r.tokens for r in reqs]

    first = once()
    assert first == once() and all(len(t) == 35 for t in first)


def test_pool_sized_from_a_memory_budget(tiny):
    from jaxpar.errors import ConfigError
    from jaxpar.inference.placement import page_bytes

    per_page = 2 * 2 * 8 * 2 * 8 * 4  # K and V · layers · page · kv heads · head width · f32
    assert page_bytes(tiny, 8) == per_page
    engine = Engine(tiny, max_slots=2, page_size=8, max_length=64, memory_budget=10 * per_page + 5)
    assert engine.pages.num_pages == 10
    pool = sum(x.nbytes for x in __import__("jax").tree.leaves(engine.models["target"].pools))
    assert pool == 10 * per_page
    with pytest.raises(ConfigError, match="memory_budget"):
        Engine(tiny, page_size=8, max_length=64, memory_budget=per_page)


def test_a_draft_identical_to_the_target_is_always_accepted(tiny):
    """The draft model keeps its own pools on the same page tables; when it is the target itself every
    guess is kept (greedy), and the output is plain greedy decoding's under the margin rule."""
    from jaxpar.errors import ConfigError

    spec = Engine(tiny, max_slots=3, page_size=8, max_length=64, chunk=16, record_logits=True, speculate=3, draft=tiny)
    spec.warm_up()
    compiled = spec.compiles
    reqs = _requests(6, seed=4)
    spec.run(reqs)
    assert spec.compiles == compiled and spec.pages.used == 0
    report = spec.acceptance()
    assert report["rate"] == 1.0 and report["verifications"] > 0, report
    for r, compared in zip(reqs, _compared_with_alone(tiny, reqs)):
        assert compared >= 0.9 * r.max_new_tokens
    other = build_model(dataclasses.replace(get_model_preset("tiny"), vocab_size=128), rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError, match="draft: vocab_size"):
        Engine(tiny, speculate=2, draft=other)


def test_a_sampling_draft_identical_to_the_target_is_accepted_nearly_always(tiny):
    """At temperature 1 the draft samples its guesses from its own distribution p; with the target as
    its draft, p = q up to rounding (width 1 against width k + 1), so min(1, q/p) keeps nearly every
    guess. A greedy proposal is kept with probability q(argmax), for this near-uniform random model
    0.006 on average (measured over these requests' 64 positions). Reproducible for a seed."""

    def once():
        spec = Engine(tiny, max_slots=3, page_size=8, max_length=64, chunk=16, speculate=3, draft=tiny)
        reqs = _requests(6, seed=7)
        spec.run(reqs, sampling=dict(temperature=1.0, seed=11))
        return spec.acceptance(), [r.tokens for r in reqs]

    (report, tokens), (_, again) = once(), once()
    assert report["rate"] >= 0.97 and report["verifications"] > 10, report
    assert tokens == again


@pytest.mark.parametrize("mesh", ["decode_tp", "decode_dp"])
def test_an_engine_sharded_over_two_devices_agrees_with_one(tiny, mesh):
    """The engine on a decode layout over 2 devices (kv-head-split pools, or slots over data): the same
    tokens as one device under the margin rule (a sharded matmul sums in another order), the weights
    and every pool placed as the layout says."""
    import jax

    reqs = _requests(12, seed=5)
    engine = _engine(tiny, mesh=mesh, devices=jax.devices()[:2])
    engine.run(reqs)
    k = engine.models["target"].pools[next(iter(engine.models["target"].pools))][0].k  # the first layer's pool
    assert len(k.sharding.device_set) == 2
    split = k.addressable_shards[0].data.shape[1]  # kv heads: keys [P, K, H, page]
    assert split == (k.shape[1] // 2 if mesh == "decode_tp" else k.shape[1])
    compared = _compared_with_alone(tiny, reqs)
    assert sum(compared) >= 0.8 * sum(r.generated for r in reqs)
