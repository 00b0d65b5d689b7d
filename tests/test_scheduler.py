"""Continuous batching's scheduler without a model: budget, chunking, FCFS, EOS, max tokens, preemption."""

import numpy as np
import pytest

from jaxpar.inference.pages import PagedAllocator
from jaxpar.inference.scheduler import Request, Scheduler, Status


def make(pages=64, page=4, slots=4, budget=12, chunk=8, max_length=64):
    return Scheduler(
        PagedAllocator(pages, page), max_slots=slots, token_budget=budget, chunk=chunk, max_length=max_length
    )


def drive(s: Scheduler, token=lambda r: 1000 + r.generated, steps=None):
    """Run ``steps`` steps (default: to the end) with a fake model whose tokens count the request's
    generated ones; check the invariants after every step. Returns the plans."""
    plans = []
    for _ in range(steps or 10_000):
        if s.idle:
            return plans
        plan = s.schedule()
        assert plan.tokens <= s.budget
        slots = [r.slot for r in plan.decode] + [c.request.slot for c in plan.chunks]
        assert len(slots) == len(set(slots)) and all(0 <= x < s.max_slots for x in slots)
        for r in plan.decode:
            s.pages.check_writable(r.id, r.computed, r.computed + 1)
        for c in plan.chunks:
            s.pages.check_writable(c.request.id, c.start, c.start + c.length)
        s.finish_step(plan, {r.id: token(r) for r in plan.decode + [c.request for c in plan.chunks if c.last]})
        s.pages.check()
        plans.append(plan)
    assert steps, "did not finish"
    return plans


def test_budget_below_slots_plus_chunk_is_refused():
    with pytest.raises(ValueError, match="token_budget"):
        make(slots=4, budget=11, chunk=8)


def test_chunks_are_cut_at_multiples_of_chunk_whatever_else_runs():
    def chunks_of(crowd: int):
        s = make(budget=14)
        for i in range(crowd):
            s.add(Request(f"other{i}", [7] * (3 + 5 * i), max_new_tokens=20))
        s.add(Request("r", list(range(30)), max_new_tokens=3))
        return [(c.start, c.length) for p in drive(s) for c in p.chunks if c.request.id == "r"]

    assert chunks_of(0) == chunks_of(3) == [(0, 8), (8, 8), (16, 8), (24, 6)]


def test_first_come_first_served():
    s = make(slots=3, budget=11)
    reqs = [Request(i, [i + 1] * (4 + i), max_new_tokens=5) for i in range(6)]
    for r in reqs:
        s.add(r)
    admitted = []
    for plan in drive(s):
        admitted += [c.request.id for c in plan.chunks if c.start == 0]
    assert admitted == list(range(6))
    assert all(r.generated == 5 and r.finish_reason == "length" for r in reqs)
    assert all(r.tokens == r.prompt + [1000 + g for g in range(5)] for r in reqs)


def test_decodes_do_not_wait_for_prompts():
    """A running sequence decodes in every step until it finishes, even while long prompts arrive."""
    s = make(slots=4, budget=12, chunk=8)
    first = Request("first", [1, 2, 3], max_new_tokens=12)
    s.add(first)
    plans = [s.schedule()]
    s.finish_step(plans[0], {"first": 5})
    for i in range(3):
        s.add(Request(i, [9] * 40, max_new_tokens=2))
    while first.status is not Status.FINISHED:
        plan = s.schedule()
        assert first in plan.decode
        s.finish_step(plan, {r.id: 5 for r in plan.decode + [c.request for c in plan.chunks if c.last]})
    assert first.generated == 12


def test_stop_ids_and_max_tokens_and_cache_length():
    s = make(max_length=20)
    eos = Request("eos", [1, 2], max_new_tokens=10, stop_ids=frozenset({1003}))
    short = Request("short", [1, 2], max_new_tokens=2)
    long = Request("long", [3] * 15, max_new_tokens=100)
    for r in (eos, short, long):
        s.add(r)
    drive(s)
    assert (eos.generated, eos.finish_reason, eos.tokens[-1]) == (4, "stop", 1003)
    assert (short.generated, short.finish_reason) == (2, "length")
    assert (len(long.tokens), long.finish_reason) == (20, "length")
    assert s.pages.used == 0


def test_preemption_takes_the_youngest_and_recomputes_it():
    # 8 usable pages of 4: two sequences growing to 24 positions cannot both fit.
    s = make(pages=9, page=4, slots=2, budget=10, chunk=8, max_length=64)
    old, young = Request("old", [1] * 6, max_new_tokens=18), Request("young", [2] * 6, max_new_tokens=18)
    s.add(old)
    s.add(young)
    plans = drive(s)
    preempted = [r.id for p in plans for r in p.preempted]
    assert preempted and set(preempted) == {"young"}
    assert old.preemptions == 0 and young.preemptions >= 1
    for r in (old, young):  # the fake model's tokens depend only on the count
        assert r.tokens == r.prompt + [1000 + g for g in range(18)]
    assert s.pages.used == 0


def test_random_traffic_finishes_everything_without_leaks():
    rng = np.random.default_rng(0)
    s = make(pages=24, page=4, slots=4, budget=14, chunk=8, max_length=48)
    reqs = [
        Request(i, list(rng.integers(0, 2, rng.integers(1, 30))), max_new_tokens=int(rng.integers(1, 15)))
        for i in range(40)
    ]
    for r in reqs[:20]:
        s.add(r)
    drive(s, steps=5)
    for r in reqs[20:]:
        s.add(r)
    drive(s)
    assert all(r.status is Status.FINISHED for r in reqs)
    assert s.pages.used == 0 and s.pages.available == 23 and s.pages.hits > 0


def test_abort_frees_a_running_and_dequeues_a_waiting_request():
    s = make(slots=1)
    a, b = Request("a", [1] * 6, 8), Request("b", [2] * 6, 8)
    s.add(a)
    s.add(b)
    drive(s, steps=2)  # a runs, b waits for the one slot
    assert a.status is Status.RUNNING and b.status is Status.WAITING
    s.abort(b)
    s.abort(a)
    assert s.idle and s.pages.used == 0 and s.free_slots == [0]
    assert a.finish_reason == b.finish_reason == "abort"
    s.pages.check()
    s.abort(a)  # already finished: nothing happens
    assert a.finish_reason == "abort"


def test_a_lone_sequence_that_cannot_grow_ends_with_length_and_the_queue_goes_on():
    """A pool smaller than one full sequence (the engine refuses it; the scheduler must still not
    livelock): 4 usable pages of 4 positions, sequences up to 64. The lone sequence fills the pool, ends
    with "length" rather than being preempted for itself and recomputed forever, and the next runs."""
    s = make(pages=5, page=4, max_length=64)
    first, second = Request("a", [1] * 6, max_new_tokens=40), Request("b", [2] * 3, max_new_tokens=2)
    s.add(first)
    s.add(second)
    plans = drive(s, steps=200)
    assert s.idle and first.finish_reason == "length" and second.finish_reason == "length"
    assert first.preemptions == 0 and len(first.tokens) == 17  # the 16 positions the pool holds, and one more
    assert second.generated == 2 and len(plans) < 50


def test_a_memory_budget_below_one_sequence_is_refused():
    from flax import nnx

    from jaxpar.errors import ConfigError
    from jaxpar.inference.engine import Engine
    from jaxpar.inference.generate import for_generation
    from jaxpar.inference.placement import page_bytes
    from jaxpar.models import build_model, get_model_preset

    model = build_model(get_model_preset("tiny"), rngs=nnx.Rngs(0))
    one = page_bytes(for_generation(model), 16)
    with pytest.raises(ConfigError, match=r"memory_budget=.*need 5"):
        Engine(model, page_size=16, max_length=64, memory_budget=4 * one)
    assert Engine(model, page_size=16, max_length=64, memory_budget=5 * one).pages.num_pages == 5
