"""The serving engine: continuous batching over a paged KV cache, on one device.

    engine = Engine(model, max_slots=8, page_size=16, max_length=256)
    engine.submit(Request("a", prompt_ids, max_new_tokens=32))
    while not engine.idle:
        for done in engine.step():
            print(done.id, done.tokens[len(done.prompt):], done.finish_reason)

Each step runs what ``Scheduler.schedule`` planned (``jaxpar.inference.scheduler``) as device calls of
fixed shapes: one decode call [slots, 1] for every sequence that decodes, and one call
[slots, bucket] per chunk-size bucket for the prompt chunks. Each sequence has its own row (its slot);
rows with nothing to do hold position −1, which writes nothing. A request therefore computes in the same
shapes whatever else runs, so its tokens and logits are those it gets alone in the same engine. Every
shape is compiled by ``warm_up`` (or on first use) and kept; ``compiles`` counts them.

Sampling runs on the device with each slot's settings as data; a request's key is
fold_in(key(seed), position), as in ``Generator``.

``mesh`` (a decode layout name or an axis spec, over ``devices``; default one device) shards one engine:
the weights go onto the decode layout (``jaxpar.inference.layouts``), each page pool is split on its kv
heads like the dense cache, and every step is traced under the decode rules. Positions are never split
(no ``sequence`` axis). Several engines on disjoint device groups are the server's DP replicas.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from jaxpar.errors import ConfigError
from jaxpar.inference import logprobs
from jaxpar.inference.adapters import Adapter, with_bank
from jaxpar.inference.generate import bucket, for_generation
from jaxpar.inference.pages import PagedAllocator
from jaxpar.inference.placement import Weights, engine_layout, pages_for_budget
from jaxpar.inference.sampling import SamplingParams
from jaxpar.inference.scheduler import Request, Scheduler
from jaxpar.inference.speculative import acceptance, distribution, host_rng, ngram_draft, one_hot, verify
from jaxpar.layers.kvcache import with_table, without_table
from jaxpar.layers.lora import select
from jaxpar.model_api import LanguageModel
from jaxpar.rules import trace_layout

# What ``warm_up`` compiles by default: greedy steps and sampled ones, log-probs and penalties off.
SERVED = (logprobs.Features(), logprobs.Features(draws=True))

GREEDY = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0)
LOG_STEPS = 4096  # the steps ``Engine.log`` keeps (the newest); ``Engine.totals`` counts them all


@dataclasses.dataclass
class StepLog:
    """What one step did: the plan's size and the device seconds."""

    decoded: int
    prefilled: int
    preempted: int
    seconds: float

    def __add__(self, other: StepLog) -> StepLog:
        return StepLog(*(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)))


class Engine:
    """Continuous batching over a paged cache (module doc). The pool holds ``num_pages`` pages, or as many
    as ``memory_budget`` bytes hold, or by default enough for every slot at ``max_length``."""

    def __init__(
        self,
        model: LanguageModel,
        *,
        max_slots: int = 8,
        page_size: int = 16,
        max_length: int = 256,
        num_pages: int | None = None,
        memory_budget: int | None = None,
        chunk: int = 64,
        token_budget: int | None = None,
        record_logits: bool = False,
        speculate: int = 0,
        draft: LanguageModel | None = None,
        prefix_cache: bool = True,
        mesh: str | None = None,
        devices=None,
        check_writes: bool = False,
        adapters: Sequence[Adapter] = (),
    ):
        if max_length % page_size:
            raise ConfigError(f"max_length={max_length} must be a multiple of page_size={page_size}")
        # a request's ``adapter``: 0 the base model, i + 1 ``adapters[i]`` (a bank: jaxpar.inference.adapters)
        self.adapters = {a.name: i + 1 for i, a in enumerate(adapters)}
        self.model = for_generation(with_bank(model, list(adapters)) if adapters else model)
        self.cfg = self.model.cfg
        self.layout = self._layout(mesh, devices, max_slots, max_length)
        self.width = max_length // page_size  # page-table entries per sequence
        if memory_budget is not None:
            num_pages = pages_for_budget(self.model, page_size, memory_budget, max_length)
        num_pages = num_pages or max_slots * self.width + 1
        if num_pages < self.width + 1:
            raise ConfigError(f"num_pages={num_pages}: one sequence of max_length={max_length} needs {self.width + 1}")
        self.pages = PagedAllocator(num_pages, page_size, prefix_cache=prefix_cache)
        self.scheduler = Scheduler(
            self.pages,
            max_slots=max_slots,
            token_budget=token_budget or max_slots + chunk,
            chunk=chunk,
            max_length=max_length,
            lookahead=speculate,
        )
        self.slots, self.chunk, self.speculate, self.max_length = max_slots, chunk, speculate, max_length
        self.kept: list[int] = []  # guesses kept per verification
        self.proposed: list[int] = []
        self.models = {"target": Weights.of(self.model, num_pages, page_size, self.layout)}
        if draft is not None:
            draft = self._check_draft(draft, speculate)
            self.models["draft"] = Weights.of(
                draft, num_pages, page_size, self._layout(mesh, devices, max_slots, max_length, draft.cfg)
            )
        self.record_logits = record_logits
        self.check_writes = check_writes  # tests: every write lands in a page of its own
        self.logits: dict = {}  # request id -> list of [V] float32 rows
        self.log: collections.deque[StepLog] = collections.deque(maxlen=LOG_STEPS)  # the newest steps
        self.totals = StepLog(0, 0, 0, 0.0)  # every step's, summed
        self._programs: dict[tuple, object] = {}
        self.compiles = 0

    def _layout(self, mesh, devices, slots: int, length: int, cfg=None):
        return engine_layout(cfg or self.cfg, mesh, devices, slots=slots, length=length)

    # --------------------------------------------------------------------------------- programs
    def buckets(self) -> list[int]:
        """The prompt-chunk shapes: powers of two from 16 up to ``chunk`` (and 1 for decoding)."""
        if not hasattr(self, "_buckets"):
            self._buckets = [1]
            while self._buckets[-1] < self.chunk:
                self._buckets.append(min(self.chunk, bucket(self._buckets[-1] + 1)))
        return self._buckets

    def _check_draft(self, draft, speculate: int):
        draft = for_generation(draft)
        if not speculate:
            raise ConfigError("draft: a draft model proposes the speculative guesses; set speculate=k > 0")
        if draft.cfg.vocab_size != self.cfg.vocab_size:
            raise ConfigError(
                f"draft: vocab_size={draft.cfg.vocab_size} differs from the model's "
                f"{self.cfg.vocab_size}; the draft must share the vocabulary"
            )
        return draft

    def _program(self, which: str, t: int, every: bool, features: logprobs.Features):
        """``which`` model's step of width t: sampled tokens, the logits at each row's ``last`` position
        and log-probs (``logprobs.step_outputs``); with ``every`` (verification) the raw and the filtered
        logits of every position (``logprobs.verify_outputs``). ``features``: what the program holds
        besides (one program per set, chosen on the host: no conditional runs on the device)."""
        key = (which, t, every, features)
        if key not in self._programs:
            graphdef, layout, vocab = self.models[which].graphdef, self.layout, self.cfg.vocab_size

            def run(state, pools, ids, positions, table, last, params, extras, adapter):
                with trace_layout(layout.mesh, layout.decode), select(adapter):
                    model = nnx.merge(graphdef, state)
                    logits, pools = model.decode(ids, positions, with_table(pools, table))
                stripped = without_table(pools)
                if every:
                    return logprobs.verify_outputs(logits, ids, positions, params, extras, features), stripped
                return logprobs.step_outputs(logits, ids, positions, last, params, extras, vocab, features), stripped

            pools = jax.tree.map(lambda x: x.sharding, self.models[which].pools)
            self._programs[key] = jax.jit(run, donate_argnums=(1,), out_shardings=(self._replicated, pools))
            self.compiles += 1
        return self._programs[key]

    def warm_up(self, features=SERVED) -> None:
        """Compile every shape the engine can run (a call with nothing in it: positions all −1), for each
        set of ``features`` (default ``SERVED``: greedy and sampled steps; the others compile on first use)."""
        shapes = [(w, t, False) for w in self.models for t in self.buckets()]
        shapes += [("target", self.speculate + 1, True)] if self.speculate else []
        shapes += [("draft", t, True) for t in self.buckets()] if "draft" in self.models else []
        keys = dict.fromkeys(
            (w, t, every, self._needed(f, every)) for (w, t, every), f in itertools.product(shapes, features)
        )
        for which, t, every, f in keys:
            m = self.models[which]
            ids, positions = np.zeros((self.slots, t), np.int32), np.full((self.slots, t), -1, np.int32)
            table, last = np.zeros((self.slots, self.width), np.int32), np.zeros(self.slots, np.int32)
            extras = logprobs.StepExtras.build([], self.slots, t, self.max_length)
            params = SamplingParams(**SamplingParams.check(self.slots))  # numpy, as every call's (``_inputs``)
            adapter = np.zeros(self.slots, np.int32)
            _, m.pools = self._program(which, t, every, f)(
                m.state, m.pools, ids, positions, table, last, params, extras, adapter
            )

    @staticmethod
    def _needed(features: logprobs.Features, every: bool) -> logprobs.Features:
        """What a program needs of ``features``: a verification samples nothing and scores nothing."""
        return logprobs.Features(penalties=features.penalties) if every else features

    @property
    def _replicated(self):
        return jax.sharding.NamedSharding(self.layout.mesh, jax.sharding.PartitionSpec())

    def _call(self, which, t, ids, positions, table, last, params, extras, adapter, *, every: bool = False):
        """One device call; its outputs on the host (``logprobs.fetch``), a dict, or (raw, filtered)."""
        m = self.models[which]
        host = (ids, positions, table, last, params, extras, adapter)  # numpy: jit places them replicated itself
        program = self._program(which, t, every, self._needed(logprobs.Features.of(params, extras), every))
        out, m.pools = program(m.state, m.pools, *host)
        return logprobs.fetch(out, extras, rows=self.record_logits)

    def load_weights(self, model: LanguageModel) -> None:
        """Serve ``model``'s weights from now on: the same architecture (the graph the programs were
        compiled for), e.g. a training run's model after an update. One compiled program (made on the
        first call for this graph) unstacks the layers where the model lies, into new buffers (the
        engine's own: a train step may donate the model's); they then move onto the decode layout. The
        prefix cache is dropped: its pages hold keys and values of the old weights. Refused while
        requests run."""
        if not self.idle:
            raise ConfigError("load_weights: requests are running; wait until the engine is idle")
        target = self.models["target"]
        graphdef, state = nnx.split(model)
        if getattr(self, "_sync_graph", None) != graphdef:
            if nnx.graphdef(for_generation(model)) != target.graphdef:
                raise ConfigError("load_weights: the model is not the one the engine was built for (another graph)")

            def convert(state):
                return nnx.state(for_generation(nnx.merge(graphdef, state)))

            self._sync, self._sync_graph = jax.jit(convert), graphdef
        target.state = jax.device_put(self._sync(state), jax.tree.map(lambda x: x.sharding, target.state))
        self.pages.forget()

    # ----------------------------------------------------------------------------------- serving
    def submit(self, request: Request, sampling: dict | None = None) -> None:
        """Queue ``request``. Its sampling, penalty and log-prob settings and its adapter are checked here
        (``ConfigError`` naming the field), so a bad request is refused alone and never reaches a step."""
        if not 0 <= request.adapter <= len(self.adapters):
            raise ConfigError(
                f"adapter={request.adapter}: this engine serves adapters 1..{len(self.adapters)} (0: none)"
            )
        settings = {**GREEDY, **(sampling or {})}
        SamplingParams.check(**{k: settings[k] for k in GREEDY})
        logprobs.check_settings(settings)
        request.sampling = settings
        self.scheduler.add(request)

    @property
    def idle(self) -> bool:
        return self.scheduler.idle

    def step(self) -> list[Request]:
        """Plan and run one step; returns the requests that finished in it."""
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        sampled = {}
        if plan.decode and self.speculate:
            sampled.update(self._verify(plan.decode))
        elif plan.decode:
            rows = [(r, r.computed, [r.tokens[r.computed]]) for r in plan.decode]
            sampled.update(self._run(1, rows))
        by_size: dict[int, list] = {}
        for c in plan.chunks:
            by_size.setdefault(min(b for b in self.buckets() if b >= c.length), []).append(c)
        for t, chunks in sorted(by_size.items()):
            rows = [(c.request, c.start, c.request.tokens[c.start : c.start + c.length]) for c in chunks]
            done = self._run(t, rows)
            sampled.update({c.request.id: done[c.request.id] for c in chunks if c.last})
            if "draft" in self.models:  # the draft keeps its cache in step
                self._call("draft", t, *self._inputs(t, rows, greedy=True))
                for c in chunks:
                    c.request.draft_computed = c.start + c.length
        finished = self.scheduler.finish_step(plan, sampled)
        step = StepLog(
            len(plan.decode), sum(c.length for c in plan.chunks), len(plan.preempted), time.perf_counter() - start
        )
        self.log.append(step)
        self.totals += step
        return finished

    def _inputs(self, t: int, rows, *, greedy: bool = False):
        """Device inputs of one call of width t; rows: (request, first position, tokens)."""
        ids = np.zeros((self.slots, t), np.int32)
        positions = np.full((self.slots, t), -1, np.int32)
        table = np.zeros((self.slots, self.width), np.int32)
        last, adapter = np.zeros(self.slots, np.int32), np.zeros(self.slots, np.int32)
        settings = [dict(GREEDY) for _ in range(self.slots)]
        for r, start, tokens in rows:
            s, n = r.slot, len(tokens)
            if self.check_writes:
                self.pages.check_writable(r.id, start, start + n)
            ids[s, :n], positions[s, :n], last[s], adapter[s] = tokens, np.arange(start, start + n), n - 1, r.adapter
            table[s] = self.pages.table(r.id, self.width)
            settings[s] = GREEDY if greedy else r.sampling
        # numpy columns (checked as ``make`` checks them): the host reads which programs the call needs
        # (``logprobs.Features.of``) without a round trip to the device
        params = SamplingParams(**SamplingParams.check(self.slots, **{k: [x[k] for x in settings] for k in GREEDY}))
        extras = logprobs.StepExtras.build(rows, self.slots, t, self.max_length, plain=greedy)
        return ids, positions, table, last, params, extras, adapter

    def _run(self, t: int, rows) -> dict:
        """One device call of width t; rows: (request, first position, tokens). Returns id -> token."""
        out = self._call("target", t, *self._inputs(t, rows))
        logprobs.record(rows, out)
        for r, start, chunk in rows if "row" in out else []:
            if start + len(chunk) == len(r.tokens):  # the row samples a token
                self.logits.setdefault(r.id, []).append(out["row"][r.slot])
        return {r.id: int(out["tokens"][r.slot]) for r, _, _ in rows}

    def _verify(self, decoding: list[Request]) -> dict:
        """Speculative decode: each row's last token and up to k guesses (n-gram lookup or the draft
        model) in one call of width k + 1; ``verify`` keeps the target's distribution. Returns id -> the
        tokens emitted."""
        t = self.speculate + 1
        room = {r.id: min(self.speculate, self.max_length - len(r.tokens)) for r in decoding}
        if "draft" in self.models:
            proposed = self._propose(decoding)
            drafts = {k: v[: room[k]] for k, (v, _) in proposed.items()}
            dists = {k: p[: room[k]] for k, (_, p) in proposed.items()}
        else:
            drafts = {r.id: ngram_draft(r.tokens, room[r.id]) for r in decoding}
            dists = {k: one_hot(v, self.cfg.vocab_size) for k, v in drafts.items()}
        rows = [(r, r.computed, [r.tokens[r.computed]] + drafts[r.id]) for r in decoding]
        raw, filtered = self._call("target", t, *self._inputs(t, rows), every=True)
        out = {}
        for r in decoding:
            draft, s = drafts[r.id], r.slot
            n = len(draft) + 1
            q = distribution(raw[s, :n], filtered[s, :n], r.sampling["temperature"] == 0)
            kept, nxt = verify(draft, dists[r.id], q, host_rng(r.sampling["seed"], r.computed))
            self.kept.append(kept)
            self.proposed.append(len(draft))
            if self.record_logits:
                self.logits.setdefault(r.id, []).extend(raw[s, : kept + 1])
            out[r.id] = draft[:kept] + [nxt]
            if r.sampling.get("logprobs") is not None:  # raw logits are here: the log-probs too
                r.token_logprobs += logprobs.host_scores(raw[s], out[r.id], self.cfg.vocab_size, r.sampling["logprobs"])
            r.draft_computed = min(r.draft_computed, r.computed + kept + 1)
        return out

    def _propose(self, decoding: list[Request]) -> dict:
        """k guesses of the draft model and the distributions they were drawn from: one call that
        catches its cache up to the row's last token (a bucket wide), then k − 1 calls of width 1.
        Greedy rows take the argmax (a point mass); sampled rows draw from the draft's own filtered
        distribution under the row's settings (then the full logits come to the host)."""
        sampled = any(r.sampling["temperature"] > 0 for r in decoding)
        rows = [(r, r.draft_computed, r.tokens[r.draft_computed :]) for r in decoding]
        t = min(b for b in self.buckets() if b >= max(len(x[2]) for x in rows))
        out = {r.id: ([], []) for r in decoding}
        for i in range(self.speculate):
            if i:
                rows, t = [(r, len(r.tokens) + i - 1, out[r.id][0][-1:]) for r in decoding], 1
            if not sampled:
                tokens = self._call("draft", t, *self._inputs(t, rows, greedy=True))["tokens"]
            else:
                raw, filtered = self._call("draft", t, *self._inputs(t, rows), every=True)
            for r, start, fed in rows:
                if not sampled:
                    token, p = int(tokens[r.slot]), one_hot([int(tokens[r.slot])], self.cfg.vocab_size)[0]
                else:
                    at = len(fed) - 1
                    p = distribution(
                        raw[r.slot, at : at + 1], filtered[r.slot, at : at + 1], r.sampling["temperature"] == 0
                    )[0]
                    token = int(host_rng(r.sampling["seed"], start + at, 1).choice(len(p), p=p))
                out[r.id][0].append(token)
                out[r.id][1].append(p)
        for r in decoding:
            r.draft_computed = len(r.tokens) + self.speculate - 1
        return {k: (tokens, np.stack(ps)) for k, (tokens, ps) in out.items()}

    def acceptance(self) -> dict:
        """Acceptance rate and the histogram of guesses kept per verification (speculative decoding)."""
        return acceptance(self.kept, self.proposed)

    def run(self, requests, sampling: dict | None = None) -> list[Request]:
        """Submit ``requests`` and step until all are done (a batch helper for tests and benchmarks)."""
        for r in requests:
            self.submit(r, sampling)
        done = []
        while not self.idle:
            done += self.step()
        return done
