"""The HTTP side of ``jaxpar serve``: an OpenAI-compatible API (Starlette, run by uvicorn) over engine
replicas (``jaxpar.inference.worker``).

    POST /v1/completions         text or token-id prompts; ``stream: true`` sends server-sent events
    POST /v1/chat/completions    when the tokenizer carries a chat template
    GET  /v1/models   /health   /metrics (Prometheus text)   /openapi.json (``jaxpar.inference.openapi``)

A request is read within the body limits, then parsed and checked (``jaxpar.inference.api``) on a
thread beside the event loop, before any replica sees it: a bad one gets OpenAI's error object with
status 400 and the engines go on. Each choice becomes one engine request on the replica the router
picks; its tokens come back as events and leave as they arrive (streaming) or together at the end. A
client that goes away has its requests aborted (pages and slots freed), streaming or not. Every limit a
request can meet, and the status that answers it, is in ``jaxpar.inference.limits``. While the server
drains (SIGTERM), new requests get 503 and the ones in flight complete.

With an API key, every ``/v1/`` route wants ``Authorization: Bearer KEY`` (compared in constant time);
``/health`` and ``/metrics`` stay open to the orchestrator.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import time

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jaxpar.errors import ConfigError
from jaxpar.inference.api import APIError, Job, Parser, quote
from jaxpar.inference.limits import Limits
from jaxpar.inference.logprob_format import ChoiceLogprobs
from jaxpar.inference.middleware import APIKey, Metrics, StatusCounter
from jaxpar.inference.openapi import schema
from jaxpar.inference.responses import choice, envelope, usage
from jaxpar.inference.scheduler import Request
from jaxpar.inference.text import TextStream
from jaxpar.inference.worker import Router, Worker


class Service:
    """What the routes share: the parser, the replicas, the router, the metrics."""

    def __init__(
        self,
        engines: list,
        parser: Parser,
        *,
        tokenizer,
        eos_ids=frozenset(),
        page_size: int,
        limits: Limits | None = None,
        api_key: str | None = None,
    ):
        self.parser, self.tokenizer, self.eos_ids = parser, tokenizer, frozenset(eos_ids)
        self.limits, self.api_key = limits or Limits(), api_key
        self.parsing = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="parse")
        self.workers = [Worker(e, i) for i, e in enumerate(engines)]
        self.metrics = Metrics(self.workers)
        for w in self.workers:
            w.observe = self.metrics.observe
        self.router = Router(self.workers, page_size=page_size)
        # a request's ``model`` -> the engines' adapter slot (0: the base model); every replica has the same
        self.slots = {parser.model_name: 0, **engines[0].adapters}
        if set(self.slots) != set(parser.models) or any(e.adapters != engines[0].adapters for e in engines):
            raise ConfigError(f"the parser serves {parser.models}, the engines {[e.adapters for e in engines]}")
        self.draining = False
        self._ids = itertools.count()

    def start(self) -> None:
        for w in self.workers:
            w.start()

    def stop(self, timeout: float | None = None) -> None:
        """Let each replica finish what it holds, for at most ``timeout`` seconds (default
        ``limits.shutdown_timeout``); then abort the rest."""
        self.draining = True
        for w in self.workers:
            w.stop()
        deadline = time.monotonic() + (self.limits.shutdown_timeout if timeout is None else timeout)
        for w in self.workers:
            w.join(max(0.0, deadline - time.monotonic()))
        for w in self.workers:
            if w.thread.is_alive():
                w.halt()
                w.join(1.0)  # a replica stuck inside a step stays behind (a daemon thread)
        self.parsing.shutdown(wait=False, cancel_futures=True)

    def admit(self, job: Job) -> None:
        """Refuse ``job`` when the replicas' queues are full (429) or none is available (503)."""
        held = sum(w.load for w in self.workers)
        wanted = len(job.prompts) * job.n
        if held + wanted > self.limits.max_pending:
            raise APIError(
                f"{held} choices are queued or running; this server holds at most {self.limits.max_pending}",
                status=429,
                kind="rate_limit_error",
                headers={"Retry-After": "1"},
            )
        if not any(w.available(self.limits.stall_timeout) for w in self.workers):
            raise APIError("no engine replica is available", status=503, kind="server_error")

    def submit(self, job: Job) -> list[tuple[int, Request, Worker, asyncio.Queue]]:
        """Every choice of ``job`` on the replica the router picks; events arrive on each queue."""
        loop = asyncio.get_running_loop()
        out, first = [], None
        for index, prompt, limit, sampling in job.choices():
            adapter = self.slots[job.model]
            request = Request(
                (job.id, index, next(self._ids)), prompt, limit, self.eos_ids | job.stop_ids, adapter=adapter
            )
            sibling = first if index % job.n else None  # choice 0 of a prompt computes it first
            worker = sibling[1] if sibling else self._pick(job.user, prompt, job.model)
            self.metrics.routed.labels(str(worker.index)).inc()
            events: asyncio.Queue = asyncio.Queue()
            worker.add(
                request,
                sampling,
                lambda ev, q=events: loop.call_soon_threadsafe(q.put_nowait, ev),
                after=sibling[0] if sibling else None,
            )
            first = first if sibling else (request, worker)
            out.append((index, request, worker, events))
        return out

    def _pick(self, user: str | None, prompt: list[int], model: str) -> Worker:
        index = self.router.pick(self.router.key(user, prompt, model), self.limits.stall_timeout)
        if index is None:  # every replica failed or stalled since ``admit``: this choice fails alone
            raise APIError("no engine replica is available", status=503, kind="server_error")
        return self.workers[index]


def _error(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def _choice_events(request: Request, worker: Worker, events: asyncio.Queue, text: TextStream):
    """(text delta, finish reason, token ids, their scores) of one choice until it ends: the ids and the
    scores (``TokenScore``s, when asked for) are those that arrived since the last yield. A stop string
    aborts the request."""
    ids, scores = [], []
    while True:
        event = await events.get()
        if event.error and event.status == 400:
            raise APIError(f"the engine refused the request: {event.error}")
        if event.error:
            raise APIError(f"the engine failed: {event.error}", status=500, kind="server_error")
        final = event.finish_reason is not None
        delta = text.add(event.tokens, final=final)
        ids, scores = ids + event.tokens, scores + (event.logprobs or [])
        if text.stopped and not final:
            worker.abort(request)
            yield delta, "stop", ids, scores
            return
        if final:
            yield delta, "stop" if event.finish_reason == "stop" or text.stopped else "length", ids, scores
            return
        if delta:
            yield delta, None, ids, scores
            ids, scores = [], []


class API:
    """The routes (module doc)."""

    def __init__(self, service: Service):
        self.service = service
        self.model = service.parser.model_name
        self.schema = schema(service.parser.models, service.parser.vocab_size, service.limits)

    async def completions(self, http: HTTPRequest) -> Response:
        return await self._generate(http, "completions")

    async def chat(self, http: HTTPRequest) -> Response:
        return await self._generate(http, "chat")

    async def _generate(self, http: HTTPRequest, kind: str) -> Response:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.service.limits.request_timeout
        try:
            raw = await self._body(http)
            job = await loop.run_in_executor(self.service.parsing, self.service.parser.parse, kind, raw)
            if self.service.draining:
                raise APIError("the server is shutting down", status=503, kind="server_error")
            self.service.admit(job)
            choices = self.service.submit(job)
        except APIError as err:
            return _error(err)
        except ClientDisconnect:  # gone before its body was in: nobody to answer
            return Response(status_code=499)
        if job.stream:
            return StreamingResponse(self._stream(job, choices, deadline), media_type="text/event-stream")
        whole = asyncio.ensure_future(self._whole(job, choices))
        gone = asyncio.ensure_future(_disconnected(http))
        try:
            await asyncio.wait({whole, gone}, timeout=deadline - loop.time(), return_when=asyncio.FIRST_COMPLETED)
            if whole.done():
                return JSONResponse(whole.result())
            if gone.done():  # nobody is there to read an answer
                return Response(status_code=499)
            raise APIError("the request ran past the server's request timeout", status=504, kind="timeout")
        except APIError as err:
            return _error(err)
        finally:
            whole.cancel()
            gone.cancel()
            self._abort(choices)

    async def _body(self, http: HTTPRequest) -> bytes:
        """The request's body, within ``max_body_bytes`` (413) and ``body_timeout`` (408)."""
        limits = self.service.limits
        declared = http.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limits.max_body_bytes:
            raise APIError(
                f"the body has {declared} bytes; this server reads at most {limits.max_body_bytes}", status=413
            )

        async def read() -> bytes:
            parts, size = [], 0
            async for part in http.stream():
                size += len(part)
                if size > limits.max_body_bytes:
                    raise APIError(f"the body is over {limits.max_body_bytes} bytes", status=413)
                parts.append(part)
            return b"".join(parts)

        try:
            return await asyncio.wait_for(read(), limits.body_timeout)
        except TimeoutError:
            raise APIError(f"the body did not arrive within {limits.body_timeout} s", status=408) from None

    async def _whole(self, job: Job, choices) -> dict:
        async def one(index, request, worker, events):
            text, reason = TextStream(self.service.tokenizer, job.stop_text), None
            parts, seen, scores = [], [], []
            async for delta, last, new, records in _choice_events(request, worker, events, text):
                parts.append(delta)
                seen, scores, reason = seen + new, scores + records, last
            ids = request.tokens[len(request.prompt) : len(request.prompt) + request.generated]
            writer = ChoiceLogprobs(self.service.tokenizer, job, list(request.prompt))
            echo, logprobs = writer.chunk(seen, scores, request.prompt_logprobs)
            return choice(job, index, echo + "".join(parts), reason, ids, logprobs)

        done = await asyncio.gather(*(one(*c) for c in choices))
        self.service.metrics.tokens.inc(sum(r.generated for _, r, _, _ in choices))
        return envelope(job, chunk=False) | {
            "choices": sorted(done, key=lambda c: c["index"]),
            "usage": usage(choices),
        }

    async def _stream(self, job: Job, choices, deadline: float):
        merged: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def pump(index, request, worker, events):
            text = TextStream(self.service.tokenizer, job.stop_text)
            writer = ChoiceLogprobs(self.service.tokenizer, job, list(request.prompt))
            try:
                async for delta, reason, new, records in _choice_events(request, worker, events, text):
                    echo, logprobs = writer.chunk(new, records, request.prompt_logprobs)
                    await merged.put(choice(job, index, echo + delta, reason, logprobs=logprobs))
            except APIError as err:
                await merged.put(err)
            await merged.put(None)

        tasks = [asyncio.create_task(pump(*c)) for c in choices]
        try:
            left = len(tasks)
            while left:
                try:
                    item = await asyncio.wait_for(merged.get(), deadline - loop.time())
                except TimeoutError:
                    timeout = APIError("the request ran past the server's request timeout", status=504, kind="timeout")
                    yield f"data: {json.dumps(timeout.body())}\n\n"
                    break
                if item is None:
                    left -= 1
                elif isinstance(item, APIError):
                    yield f"data: {json.dumps(item.body())}\n\n"
                else:
                    yield f"data: {json.dumps(envelope(job, chunk=True) | {'choices': [item]})}\n\n"
            if job.include_usage:
                tally = envelope(job, chunk=True) | {"choices": [], "usage": usage(choices)}
                yield f"data: {json.dumps(tally)}\n\n"
            yield "data: [DONE]\n\n"
            self.service.metrics.tokens.inc(sum(r.generated for _, r, _, _ in choices))
        finally:  # the client went away, or all is sent
            for t in tasks:
                t.cancel()
            self._abort(choices)

    def _abort(self, choices) -> None:
        for _, request, worker, _ in choices:
            if request.finish_reason is None:
                worker.abort(request)

    async def models(self, http: HTTPRequest) -> Response:
        """The base model, then each adapter (its ``parent`` the base, as OpenAI lists fine-tunes)."""
        length = self.service.workers[0].engine.max_length
        entry = {"object": "model", "created": 0, "owned_by": "jaxpar", "max_model_len": length}
        adapters = [{"id": name, **entry, "parent": self.model} for name in self.service.parser.models[1:]]
        return JSONResponse({"object": "list", "data": [{"id": self.model, **entry}, *adapters]})

    async def health(self, http: HTTPRequest) -> Response:
        """200 while every replica is alive and progressing; 503 when one failed or stalled (the others
        still serve), or while the server drains."""
        workers, timeout = self.service.workers, self.service.limits.stall_timeout
        failed = [w.index for w in workers if w.error is not None]
        stalled = [w.index for w in workers if w.error is None and w.stalled(timeout)]
        state = {"replicas": len(workers), "failed": failed, "stalled": stalled}
        if self.service.draining or failed or stalled:
            status = "draining" if self.service.draining else "degraded"
            return JSONResponse({"status": status, **state}, status_code=503)
        return JSONResponse({"status": "ok", **state})

    async def metrics(self, http: HTTPRequest) -> Response:
        return Response(generate_latest(self.service.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def _disconnected(http: HTTPRequest) -> None:
    """Returns when the client has gone (its body was read already, so nothing else arrives)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def _http_error(http: HTTPRequest, exc: HTTPException) -> Response:
    return _error(
        APIError(
            f"{http.method} {quote(http.url.path)}: {exc.detail}",
            status=exc.status_code,
            code="not_found" if exc.status_code == 404 else None,
        )
    )


def build_app(service: Service) -> Starlette:
    """The routes over ``service``, whose workers start with the app and drain when it stops."""
    api = API(service)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        service.start()
        yield
        service.stop()  # uvicorn has answered the requests in flight, or cancelled them at its limit

    routes = [
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/models", api.models),
        Route("/health", api.health),
        Route("/metrics", api.metrics),
        Route("/openapi.json", lambda _: JSONResponse(api.schema)),
    ]
    middleware = [Middleware(StatusCounter, counter=service.metrics.requests)]
    if service.api_key is not None:
        middleware.append(Middleware(APIKey, key=service.api_key))
    return Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
        lifespan=lifespan,
    )


async def _server_error(http: HTTPRequest, exc: Exception) -> Response:
    """A fault of the server's own (never a client's): OpenAI's error object with status 500."""
    return _error(APIError(f"internal error: {type(exc).__name__}", status=500, kind="server_error"))
