"""An engine in a thread of its own, fed by the server, and the router that picks one of several.

``Worker`` owns one ``Engine`` (one replica: a device or a group of devices). The HTTP handlers run on
the event loop; they never touch the engine. They hand requests to the worker's inbox with ``add`` and
receive ``Event``s through the sink they passed (called on the worker's thread: the server wraps it in
``loop.call_soon_threadsafe``). Between steps the worker takes everything in its inbox (new requests,
aborts), steps the engine, and reports each request's new tokens and its end.

A request can fail only itself: one the engine refuses (``Engine.submit`` checks its settings) gets an
error event with status 400 and the engine goes on. An engine whose step raises is unusable: every
request it held, queued, running or still in the inbox, gets an error event at once, later ones too,
and the router sends it nothing more. A worker that holds work and has not finished a step for
``stall_timeout`` seconds counts as stalled (``available`` is False) until it does.

``Router`` sends a request to the replica with the least work (queued + running sequences), but keeps
a session together: a request with the same key (a hash of the OpenAI ``user`` field, or else the hash
of the prompt's first full page) goes back to the replica that served the key before, so the pages of a shared
prefix are found in that replica's cache. It stays sticky unless that replica has ``slack`` more
sequences than the least loaded one (then the key moves).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import queue
import threading
import time

from jaxpar.inference.scheduler import Request


@dataclasses.dataclass
class Event:
    """New tokens of a request (``tokens``), its end (``finish_reason`` set), or an engine failure.
    ``logprobs``: one ``TokenScore`` per token, when the request asked for them."""

    tokens: list[int]
    finish_reason: str | None = None
    error: str | None = None
    status: int = 500  # of an error: 400 when the engine refused the request itself
    logprobs: list | None = None


class Worker:
    """One engine replica stepping in a thread (module doc)."""

    def __init__(self, engine, index: int = 0, *, observe=None):
        self.engine, self.index = engine, index
        self.observe = observe  # observe(kind, seconds): time to first token / inter-token
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.tracked: dict[object, tuple] = {}  # id -> (request, sink, tokens sent, arrival, last token time)
        self._pending = 0  # added, not yet submitted to the engine
        self.held: list[tuple] = []  # added, waiting for a sibling's prompt (n > 1)
        self._lock = threading.Lock()
        self.stopping = False
        self.error: str | None = None
        self.beat = time.monotonic()  # when the thread last finished a step or found nothing to do
        self.thread = threading.Thread(target=self._loop, name=f"engine-{index}", daemon=True)

    def start(self) -> Worker:
        self.thread.start()
        return self

    @property
    def load(self) -> int:
        """Sequences this replica holds or will: its inbox, its queue and its running ones."""
        s = self.engine.scheduler
        return self._pending + len(s.waiting) + len(s.running)

    def stalled(self, timeout: float) -> bool:
        """Holding work, and no step finished for ``timeout`` seconds."""
        return self.load > 0 and time.monotonic() - self.beat > timeout

    def available(self, timeout: float) -> bool:
        """Alive (no engine failure) and not stalled: the router may send it a request."""
        return self.error is None and not self.stalled(timeout)

    def add(self, request: Request, sampling: dict, sink, *, after: Request | None = None) -> None:
        """Queue ``request``; with ``after`` (a sibling with the same prompt, n > 1) it is held until
        that one's prompt is in the cache, so it starts from the shared full pages. On a failed engine
        the request fails at once."""
        if self.error is not None:
            sink(Event([], "error", self.error))
            return
        with self._lock:
            self._pending += 1
        self.inbox.put(("add", request, sampling, sink, time.perf_counter(), after))

    def abort(self, request: Request) -> None:
        self.inbox.put(("abort", request))

    def stop(self) -> None:
        """Finish what was added, then end the thread (``join`` waits)."""
        self.stopping = True
        self.inbox.put(("wake",))

    def halt(self) -> None:
        """Abort everything it holds (each request gets its "abort" event), then end the thread."""
        self.stopping = True
        self.inbox.put(("halt",))

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    # ------------------------------------------------------------------------------------ the thread
    def _take(self, block: bool) -> None:
        while True:
            try:
                item = self.inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if item[0] == "halt":
                self._abort_all()
            elif item[0] == "add":
                self.held.append(item)
            elif item[0] == "abort" and item[1].id in self.tracked:
                self.engine.scheduler.abort(item[1])
                self._report(self.tracked.pop(item[1].id), time.perf_counter(), "abort")
            elif item[0] == "abort":  # still held: it never reached the engine
                dropped = [h for h in self.held if h[1] is item[1]]
                self.held = [h for h in self.held if h[1] is not item[1]]
                item[1].finish_reason = "abort" if dropped else item[1].finish_reason
                with self._lock:
                    self._pending -= len(dropped)

    def _release(self) -> None:
        """Submit the held requests whose sibling has its prompt computed (or has ended)."""
        keep = []
        for item in self.held:
            _, request, sampling, sink, arrival, after = item
            if after is not None and after.finish_reason is None and after.generated == 0:
                keep.append(item)
                continue
            with self._lock:
                self._pending -= 1
            try:
                self.engine.submit(request, sampling)
            except (ValueError, TypeError) as err:  # ConfigError included: this request's own fault
                request.finish_reason = "error"
                sink(Event([], "error", str(err), status=400))
                continue
            self.tracked[request.id] = [request, sink, 0, arrival, None]
        self.held = keep

    def _abort_all(self) -> None:
        now = time.perf_counter()
        for entry in self.tracked.values():
            self.engine.scheduler.abort(entry[0])
            self._report(entry, now, "abort")
        for _, request, _, sink, _, _ in self.held:
            request.finish_reason = "abort"
            sink(Event([], "abort"))
        self.tracked.clear()
        self.held = []
        with self._lock:
            self._pending = 0

    def _fail(self, err: Exception) -> None:
        """The engine is unusable: every request it holds or will be given fails now."""
        self.error = f"{type(err).__name__}: {err}"
        event = Event([], "error", self.error)
        for entry in self.tracked.values():
            entry[1](event)
        for item in self.held:
            item[3](event)
        while True:  # what is still in the inbox
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                break
            if item[0] == "add":
                item[3](event)
        self.tracked.clear()
        self.held = []
        with self._lock:
            self._pending = 0

    def _loop(self) -> None:
        while True:
            self._take(block=self.engine.idle and not self.held)
            self._release()
            if self.engine.idle:
                self.beat = time.monotonic()
                if self.stopping and self.inbox.empty() and not self._pending:
                    return
                continue
            try:
                finished = {r.id for r in self.engine.step()}
            except Exception as err:  # noqa: BLE001 (any failure inside a step leaves the engine unusable)
                self._fail(err)
                return
            self.beat = time.monotonic()
            now = time.perf_counter()
            for rid in list(self.tracked):
                entry = self.tracked[rid]
                self._report(entry, now, entry[0].finish_reason if rid in finished else None)
                if rid in finished:
                    del self.tracked[rid]

    def _report(self, entry: list, now: float, reason: str | None) -> None:
        request, sink, sent, arrival, last = entry
        new = request.tokens[len(request.prompt) + sent : len(request.prompt) + request.generated]
        if new and self.observe is not None:
            if last is None:
                self.observe("ttft", now - arrival)
            else:  # a verification may bring several tokens at once
                for _ in new:
                    self.observe("itl", (now - last) / len(new))
        if new or reason:
            entry[2], entry[4] = sent + len(new), now if new else last
            wanted = (request.sampling or {}).get("logprobs") is not None
            sink(Event(list(new), reason, logprobs=request.token_logprobs[sent : sent + len(new)] if wanted else None))


class Router:
    """Least-loaded replica, sticky per session or prefix key (module doc)."""

    def __init__(self, workers: list[Worker], *, page_size: int, slack: int = 4, capacity: int = 65536):
        self.workers, self.page_size, self.slack, self.capacity = workers, page_size, slack, capacity
        self.sticky: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.routed = collections.Counter()  # "sticky", "least_loaded"

    def key(self, user: str | None, prompt: list[int], model: str = "") -> str | None:
        """A session's key (``user``), else the prompt's first page's under ``model`` (pages computed
        under one adapter are shared with that adapter's requests only)."""
        if user:
            return "user:" + hashlib.sha256(user.encode("utf-8", "surrogatepass")).hexdigest()
        if len(prompt) > self.page_size:  # a full page the cache could share
            head = (model + ":" + ",".join(map(str, prompt[: self.page_size]))).encode("utf-8", "surrogatepass")
            return "prefix:" + hashlib.sha256(head).hexdigest()
        return None

    def pick(self, key: str | None, stall_timeout: float = float("inf")) -> int | None:
        """The replica for a request with ``key``, or None when no replica is available (all failed
        or stalled)."""
        loads = [w.load if w.available(stall_timeout) else float("inf") for w in self.workers]
        best = min(range(len(loads)), key=loads.__getitem__)
        if loads[best] == float("inf"):
            return None
        chosen = self.sticky.get(key) if key is not None else None
        if chosen is not None and loads[chosen] <= loads[best] + self.slack:
            self.routed["sticky"] += 1
        else:
            chosen = best
            self.routed["least_loaded"] += 1
        if key is not None:
            self.sticky[key] = chosen
            self.sticky.move_to_end(key)
            if len(self.sticky) > self.capacity:
                self.sticky.popitem(last=False)
        return chosen
