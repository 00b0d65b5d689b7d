"""Continuous batching: which sequences run in the next step, and how many tokens each.

The scheduler is host code with no model in it; the engine turns a ``Plan`` into device calls and
reports the sampled tokens back with ``finish_step``. Per step:

1. **Every running sequence that has its prompt in the cache decodes one token.** Its next position
   gets a page first; when the pool is empty the most recently admitted other sequence is preempted
   (its pages freed, it goes back to the front of the queue and is recomputed later: prompt and the
   tokens it generated become its new prompt). The oldest sequences keep running. A sequence running
   alone that still finds no page ends with "length" (the pool can give it no more): it is never
   preempted to make room for itself, which would recompute it forever.
2. **Prompts go in chunks.** A prompt is cut at multiples of ``chunk`` positions counted from 0, whatever
   else is running, so a request computes the same chunks alone or in a crowd (the tests rely on it);
   the last chunk is the remainder (the engine pads it to a bucket). A chunk runs only if it fits in
   what is left of the step's ``token_budget`` after the decodes; a sequence in the middle of its prompt
   continues before a new one is admitted.
3. **Admission** is first come, first served (the queue's head waits rather than being overtaken, so
   nothing starves) while a slot is free, the head's first chunk fits in the budget and pages.

``token_budget ≥ max_slots + chunk`` is required: the decodes of all other slots and one full chunk
always fit, so a prompt always makes progress.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Sequence

from jaxpar.inference.pages import OutOfPages, PagedAllocator


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request and its progress. ``tokens`` = prompt + generated."""

    id: object
    prompt: Sequence[int]
    max_new_tokens: int
    stop_ids: frozenset = frozenset()  # EOS ids and the request's own stop ids
    tokens: list = dataclasses.field(default_factory=list)
    computed: int = 0  # positions whose K/V are in the cache
    generated: int = 0
    status: Status = Status.WAITING
    slot: int | None = None
    finish_reason: str | None = None  # "stop", "length" (max tokens or cache full)
    preemptions: int = 0
    sampling: dict | None = None  # the engine's per-request sampling settings
    draft_computed: int = 0  # positions in a draft model's cache (speculative)
    token_logprobs: list = dataclasses.field(default_factory=list)  # per generated token (sampling["logprobs"])
    prompt_logprobs: list | None = None  # per prompt position, the first None (sampling["prompt_logprobs"])
    adapter: int = 0  # the engine's adapter slot (``Engine.adapters``): 0 the base model

    def __post_init__(self):
        self.tokens = list(self.prompt)

    @property
    def prefilled(self) -> bool:
        """The whole current sequence but its last token is in the cache: the next step decodes."""
        return self.computed >= len(self.tokens) - (1 if self.generated else 0)


def salt(adapter: int) -> bytes:
    """What a sequence's cached pages are named under: K/V computed under another adapter differ."""
    return adapter.to_bytes(4, "little") if adapter else b""


@dataclasses.dataclass(frozen=True)
class Chunk:
    request: Request
    start: int
    length: int

    @property
    def last(self) -> bool:
        """The chunk ends the prompt: its last position's logits give the first generated token."""
        return self.start + self.length == len(self.request.tokens)


@dataclasses.dataclass
class Plan:
    decode: list[Request]
    chunks: list[Chunk]
    preempted: list[Request]
    ended: list[Request] = dataclasses.field(default_factory=list)  # finished while planning ("length")

    @property
    def tokens(self) -> int:
        return len(self.decode) + sum(c.length for c in self.chunks)


class Scheduler:
    def __init__(
        self,
        allocator: PagedAllocator,
        *,
        max_slots: int,
        token_budget: int,
        chunk: int,
        max_length: int,
        lookahead: int = 0,
    ):
        if token_budget < max_slots + chunk:
            raise ValueError(f"token_budget={token_budget} must be ≥ max_slots + chunk = {max_slots + chunk}")
        self.pages, self.max_slots, self.budget, self.chunk = allocator, max_slots, token_budget, chunk
        self.max_length = max_length  # positions a sequence may hold (its page table's reach)
        self.lookahead = lookahead  # speculative guesses a decode writes beyond its token
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # in admission order
        self.free_slots = list(range(max_slots))

    def add(self, request: Request) -> None:
        if not 0 < len(request.prompt) < self.max_length:
            raise ValueError(
                f"request {request.id!r}: prompt of {len(request.prompt)} tokens; the cache holds "
                f"{self.max_length} positions per sequence"
            )
        self.waiting.append(request)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def abort(self, request: Request) -> None:
        """End ``request`` between steps (a client went away): out of the queue, or its pages and slot
        freed. ``finish_reason`` becomes "abort"; a finished request is left as it is."""
        if request.status is Status.WAITING and request in self.waiting:
            self.waiting.remove(request)
            request.status, request.finish_reason = Status.FINISHED, "abort"
        elif request.status is Status.RUNNING:
            self._end(request, "abort")

    # --------------------------------------------------------------------------------- planning
    def schedule(self) -> Plan:
        plan = Plan([], [], [])
        for r in list(self.running):
            reach = min(self.max_length, r.computed + 1 + self.lookahead)
            if r.status is Status.RUNNING and r.prefilled and self._grow(r, reach, plan):
                plan.decode.append(r)
        left = self.budget - len(plan.decode)
        for r in list(self.running):
            if r.status is Status.RUNNING and not r.prefilled:
                left -= self._continue(r, left, plan)
        while self.waiting and self.free_slots and left > 0:
            used = self._admit(self.waiting[0], left, plan)
            if not used:
                break
            left -= used
        return plan

    def _next_chunk(self, r: Request) -> int:
        end = min(len(r.tokens), (r.computed // self.chunk + 1) * self.chunk)
        return end - r.computed

    def _continue(self, r: Request, left: int, plan: Plan) -> int:
        n = self._next_chunk(r)
        if n > left or not self._grow(r, r.computed + n, plan, may_preempt=False):
            return 0
        plan.chunks.append(Chunk(r, r.computed, n))
        return n

    def _admit(self, r: Request, left: int, plan: Plan) -> int:
        share = not (r.sampling or {}).get("prompt_logprobs")
        r.computed = self.pages.admit(r.id, r.tokens, share=share, salt=salt(r.adapter))
        n = self._next_chunk(r)
        if n > left or not self._grow(r, r.computed + n, plan, may_preempt=False):
            self.pages.unadmit(r.id)
            r.computed = 0
            return 0
        self.waiting.popleft()
        r.status, r.slot = Status.RUNNING, self.free_slots.pop(0)
        self.running.append(r)
        plan.chunks.append(Chunk(r, r.computed, n))
        return n

    def _grow(self, r: Request, length: int, plan: Plan, *, may_preempt: bool = True) -> bool:
        """Pages for ``r`` up to ``length``. When the pool is empty and ``may_preempt``, the youngest
        running sequence is preempted, until ``r`` gets its pages or is itself the youngest (then it is
        preempted, and False returned)."""
        while True:
            try:
                self.pages.reserve(r.id, length)
                return True
            except OutOfPages:
                if not may_preempt:
                    return False
                if self.running == [r]:  # alone, and the pool has no page for it: it cannot grow
                    self._end(r, "length")
                    plan.ended.append(r)
                    return False
                youngest = self.running[-1]
                self._preempt(youngest, plan)
                if youngest is r:
                    return False

    def _preempt(self, r: Request, plan: Plan) -> None:
        self.pages.free(r.id)
        self.running.remove(r)
        self.free_slots.append(r.slot)
        r.status, r.slot, r.computed = Status.WAITING, None, 0
        r.preemptions += 1
        self.waiting.appendleft(r)
        for part in (plan.decode, plan.chunks):
            part[:] = [x for x in part if (x.request if isinstance(x, Chunk) else x) is not r]
        plan.preempted.append(r)

    # ---------------------------------------------------------------------------------- results
    def finish_step(self, plan: Plan, sampled: dict) -> list[Request]:
        """Record a step: ``sampled[id]`` is the token sampled (or, speculating, the list of tokens
        emitted) for each decoded request and each request whose last prompt chunk ran. Returns the
        requests that finished (their pages freed)."""
        emitted = {k: v if isinstance(v, list) else [v] for k, v in sampled.items()}
        for c in plan.chunks:
            c.request.computed = c.start + c.length
        for r in plan.decode:
            r.computed += len(emitted[r.id])  # the last token and the guesses kept
        done = []
        for r in plan.decode + [c.request for c in plan.chunks if c.last]:
            reason = None
            for token in emitted[r.id]:
                if r.max_new_tokens == 0:  # only the prompt was wanted (its log-probs): nothing is kept
                    reason = "length"
                    break
                r.tokens.append(token)
                r.generated += 1
                reason = (
                    "stop"
                    if token in r.stop_ids
                    else "length"
                    if r.generated >= r.max_new_tokens or len(r.tokens) >= self.max_length
                    else None
                )
                if reason:
                    break
            self.pages.commit(r.id, r.tokens[: r.computed])
            if not reason and self.lookahead:
                self.pages.rollback(r.id, r.computed)  # pages reserved for rejected guesses go back
            if reason:
                self._end(r, reason)
                done.append(r)
        for c in plan.chunks:
            if not c.last and c.request.status is Status.RUNNING:
                self.pages.commit(c.request.id, c.request.tokens[: c.request.computed])
        return plan.ended + done

    def _end(self, r: Request, reason: str) -> None:
        """``r`` finishes with ``reason``: its pages and its slot are freed."""
        r.finish_reason, r.status = reason, Status.FINISHED
        self.pages.free(r.id)
        self.running.remove(r)
        self.free_slots.append(r.slot)
        self.free_slots.sort()
