"""The serving engine under load: continuous vs static batching, pages, the prefix cache, speculation.

    python benchmarks/serve.py --out benchmarks/results/serve_cpu.json      # ~2 min on an idle 2-core CPU
    python benchmarks/serve.py --quick                                      # fewer requests, ~40 s

Prints one JSON object (and writes it to ``--out``). Every run uses the real ``Engine`` on one CPU
device with a random-weight model (``--model``, default ``tiny``, float32), compiled before timing
(``warm_up``), 8 slots, pages of 16, 256 positions per sequence, prompt chunks of 32.

* ``load``: a Poisson arrival trace (``--requests`` at ``--rate`` per second, seed 0; prompts of 8–120
  tokens, outputs of 4–64, no EOS so every request runs its drawn length) replayed in wall time twice
  on the same settings: **continuous** (a request is submitted when it arrives; the engine admits it
  when a slot and pages free up) and **static** (the waiting requests, up to the slots, are submitted
  together only when the engine is idle: a batch runs until its longest request ends). For each:
  throughput (generated tokens ÷ the time from the first arrival to the last token), time to first
  token (first token − arrival), inter-token latency (between a request's successive tokens) and
  end-to-end latency (last token − arrival), p50 and p99. Token times are taken on the host after each ``step``, as
  a streaming server sees them.
* ``pages`` (continuous run, after every step): utilization = pages referenced ÷ usable pages, and
  internal fragmentation = 1 − positions held ÷ (pages held × page size), mean and peak.
* ``prefix``: 32 requests of one 96-token system prompt + a distinct 8–24-token question, 8 tokens
  each, all submitted at once, on fresh engines with and without the prefix cache: prefix pages found ÷
  looked up, prompt tokens computed, wall time, and the time saved.
* ``speculative``: a target (``tiny`` with 4 layers) and a draft (``tiny`` with 1 layer, the same
  vocabulary) trained ``--train-steps`` Adam steps on one Markov chain (256 states, 2 successors each:
  random weights would make any draft useless, so both learn the same text). Greedy, 8 requests whose
  prompts repeat a random 12-token phrase 6 times, 64 tokens each, with ``speculate=0`` and
  ``speculate=4`` — (a) n-gram prompt lookup, (b) the draft model. Tokens/s, speedup, acceptance rate and
  histogram of guesses kept, the median step, and how many requests' tokens equal plain decoding's (greedy; a
  verification of width 5 rounds differently from width 1, so a near-tie may go the other way).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import numpy as np

SETTINGS = dict(max_slots=8, page_size=16, max_length=256, chunk=32)


def build(preset: str, layers: int | None = None):
    from flax import nnx

    from jaxpar.models import build_model, get_model_preset

    cfg = get_model_preset(preset)
    cfg = dataclasses.replace(cfg, num_layers=layers) if layers else cfg
    return build_model(cfg, rngs=nnx.Rngs(0))


def engine_of(model, **overrides):
    from jaxpar.inference.engine import Engine

    engine = Engine(model, **(SETTINGS | overrides))
    engine.warm_up()
    return engine


def trace(n: int, rate: float, seed: int = 0) -> list[tuple[float, list[int], int]]:
    """(arrival s, prompt, output length) per request."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    return [
        (float(t), rng.integers(1, 256, int(rng.integers(8, 121))).tolist(), int(rng.integers(4, 65))) for t in arrivals
    ]


def percentiles(values) -> dict:
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))} if values else {}


def replay(engine, requests, *, static: bool) -> dict:
    """Replays ``requests`` in wall time (module doc); returns latencies, throughput and page samples."""
    from jaxpar.inference.scheduler import Request

    todo = [Request(i, p, n) for i, (_, p, n) in enumerate(requests)]
    arrival = {r.id: requests[r.id][0] for r in todo}
    times: dict = {r.id: [] for r in todo}
    live, pages = [], []
    start = time.perf_counter()
    while todo or not engine.idle:
        now = time.perf_counter() - start
        arrived = [r for r in todo if arrival[r.id] <= now]
        if static and not engine.idle:
            arrived = []
        for r in arrived[: engine.slots if static else None]:
            engine.submit(r)
            live.append(r)
            todo.remove(r)
        if engine.idle:
            time.sleep(max(0.0, min(arrival[r.id] for r in todo) - now))
            continue
        engine.step()
        t = time.perf_counter() - start
        for r in live:
            times[r.id] += [t] * (r.generated - len(times[r.id]))
        live = [r for r in live if r.finish_reason is None]
        pages.append(page_sample(engine.pages))
    ttft = [times[i][0] - arrival[i] for i in times]
    e2e = [times[i][-1] - arrival[i] for i in times]
    itl = [b - a for ts in times.values() for a, b in zip(ts, ts[1:])]
    tokens = sum(len(ts) for ts in times.values())
    span = max(ts[-1] for ts in times.values()) - min(arrival.values())
    return {
        "throughput_tokens_per_s": tokens / span,
        "makespan_s": span,
        "generated_tokens": tokens,
        "ttft_s": percentiles(ttft),
        "inter_token_s": percentiles(itl),
        "end_to_end_s": percentiles(e2e),
        "steps": len(pages),
        "_pages": pages,
    }


def page_sample(pool) -> tuple[float, float]:
    """(utilization, internal fragmentation) of the pool now."""
    held = sum(len(s.pages) for s in pool.seqs.values())
    positions = sum(s.length for s in pool.seqs.values())
    return pool.used / (pool.num_pages - 1), (1 - positions / (held * pool.page_size)) if held else 0.0


def load(model, n: int, rate: float) -> dict:
    requests = trace(n, rate)
    out = {"requests": n, "rate_per_s": rate, "settings": SETTINGS}
    for name, static in (("continuous", False), ("static", True)):
        out[name] = replay(engine_of(model), requests, static=static)
    samples = np.array(out["continuous"].pop("_pages"))
    out["static"].pop("_pages")
    out["pages"] = {
        "utilization_mean": float(samples[:, 0].mean()),
        "utilization_peak": float(samples[:, 0].max()),
        "fragmentation_mean": float(samples[:, 1].mean()),
        "fragmentation_peak": float(samples[:, 1].max()),
    }
    c, s = out["continuous"], out["static"]
    out["continuous_over_static"] = {
        "throughput": c["throughput_tokens_per_s"] / s["throughput_tokens_per_s"],
        "ttft_p50": c["ttft_s"]["p50"] / s["ttft_s"]["p50"],
        "inter_token_p50": c["inter_token_s"]["p50"] / s["inter_token_s"]["p50"],
        "end_to_end_p50": c["end_to_end_s"]["p50"] / s["end_to_end_s"]["p50"],
    }
    return out


def timed_run(engine, requests) -> float:
    start = time.perf_counter()
    engine.run(requests)
    return time.perf_counter() - start


def prefix(model, n: int = 32) -> dict:
    from jaxpar.inference.scheduler import Request

    rng = np.random.default_rng(1)
    system = rng.integers(1, 256, 96).tolist()
    questions = [rng.integers(1, 256, int(rng.integers(8, 25))).tolist() for _ in range(n)]
    out = {}
    for cached in (True, False):
        engine = engine_of(model, prefix_cache=cached)
        seconds = timed_run(engine, [Request(i, system + q, 8) for i, q in enumerate(questions)])
        out["with_cache" if cached else "without_cache"] = {
            "seconds": seconds,
            "prompt_tokens_computed": engine.totals.prefilled,
            "hit_rate": engine.pages.hits / max(1, engine.pages.lookups),
            "hit_pages": engine.pages.hits,
        }
    w, wo = out["with_cache"], out["without_cache"]
    out["time_saved_s"] = wo["seconds"] - w["seconds"]
    out["time_saved_fraction"] = out["time_saved_s"] / wo["seconds"]
    out["prompt_tokens_saved"] = wo["prompt_tokens_computed"] - w["prompt_tokens_computed"]
    return out


def trained(model, chain, steps: int, *, seed: int = 0):
    """``model`` after ``steps`` of Adam on records of the Markov chain (batch 16 × 64 tokens)."""
    import jax
    import optax
    from flax import nnx

    from jaxpar.data import MarkovSource
    from jaxpar.train.loss import next_token_loss

    source = MarkovSource(chain, 64, (seed,))
    opt = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(lambda m: next_token_loss(m, batch)[0])(model)
        opt.update(model, grads)
        return loss

    for i in range(steps):
        records = np.stack([source[i * 16 + j] for j in range(16)])
        loss = step(model, opt, {"inputs": records[:, :-1], "targets": records[:, 1:]})
    return model, float(jax.device_get(loss))


def step_ms(engine) -> float:
    """The median engine step (plan, device calls, host work) in milliseconds."""
    return 1e3 * float(np.median([s.seconds for s in engine.log]))


def speculative_pair(steps: int) -> dict:
    """The target (tiny with 4 layers) and the draft (1 layer) trained on one Markov chain, then raced."""
    from jaxpar.data import markov_chain

    chain = markov_chain(256, branching=2, seed=0)
    target, target_loss = trained(build("tiny", 4), chain, steps)
    draft, draft_loss = trained(build("tiny", 1), chain, steps, seed=1)
    out = speculative(target, draft)
    out["training"] = {
        "steps": steps,
        "target_loss": target_loss,
        "draft_loss": draft_loss,
        "chain_entropy_rate": chain.entropy_rate,
    }
    return out


def speculative(target, draft, k: int = 4) -> dict:
    from jaxpar.inference.scheduler import Request

    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, 256, 12).tolist() * 6 for _ in range(8)]
    make = lambda: [Request(i, p, 64) for i, p in enumerate(prompts)]
    plain = make()
    engine = engine_of(target)
    base = timed_run(engine, plain)
    out = {"plain_tokens_per_s": 64 * len(prompts) / base, "plain_step_ms": step_ms(engine)}
    for name, extra in (("ngram", {}), ("draft_model", {"draft": draft})):
        engine = engine_of(target, speculate=k, **extra)
        reqs = make()
        seconds = timed_run(engine, reqs)
        out[name] = {
            "tokens_per_s": 64 * len(prompts) / seconds,
            "speedup": base / seconds,
            "k": k,
            "step_ms": step_ms(engine),
            "acceptance": engine.acceptance(),
            "requests_equal_to_plain": sum(a.tokens == b.tokens for a, b in zip(reqs, plain)),
        }
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--rate", type=float, default=300.0, help="arrivals per second")
    parser.add_argument("--quick", action="store_true", help="40 requests, the rest as usual")
    parser.add_argument("--train-steps", type=int, default=300, help="training of the speculative pair")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import jax

    model = build(args.model)
    report = {
        "device": jax.devices()[0].device_kind,
        "model": args.model,
        "load_average_before": os.getloadavg()[0],
        "load": load(model, 40 if args.quick else args.requests, args.rate),
        "prefix": prefix(model),
        "speculative": speculative_pair(args.train_steps),
        "load_average_after": os.getloadavg()[0],
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return report


if __name__ == "__main__":
    main()
