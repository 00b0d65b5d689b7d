"""The HTTP side of ``jaxpar serve``: an OpenAI-compatible API (Starlette, run by uvicorn) over engine
replicas (``jaxpar.inference.worker``).

    POST /v1/completions         text or token-id prompts; ``stream: true`` sends server-sent events
    POST /v1/chat/completions    when the tokenizer carries a chat template
    GET  /v1/models   /health   /metrics (Prometheus text)

A request is parsed and checked (``jaxpar.inference.api``) before any replica sees it: a bad one gets
OpenAI's error object with status 400 and the engines go on. Each choice becomes one engine request on
the replica the router picks; its tokens come back as events and leave as they arrive (streaming) or
together at the end. A client that goes away has its requests aborted (pages and slots freed).
While the server drains (SIGTERM), new requests get 503 and the ones in flight complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jaxpar.inference.api import APIError, Job, Parser, TextStream
from jaxpar.inference.logprob_format import ChoiceLogprobs
from jaxpar.inference.scheduler import Request
from jaxpar.inference.worker import Router, Worker

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """The Prometheus series: per replica queue depth, running sequences and pages; latency histograms."""

    def __init__(self, workers: list[Worker]):
        self.registry = r = CollectorRegistry()
        queued = Gauge("jaxpar_queue_depth", "requests waiting for a slot", ["replica"], registry=r)
        running = Gauge("jaxpar_running_sequences", "sequences holding a slot", ["replica"], registry=r)
        used = Gauge("jaxpar_pages_used", "KV pages referenced by sequences", ["replica"], registry=r)
        total = Gauge("jaxpar_pages_total", "KV pages in the pool (the null page excluded)", ["replica"], registry=r)
        hits = Gauge("jaxpar_prefix_cache_hit_pages", "prompt pages found in the prefix cache", ["replica"], registry=r)
        for w in workers:
            i, s = str(w.index), w.engine.scheduler
            queued.labels(i).set_function(lambda w=w, s=s: w._pending + len(s.waiting))
            running.labels(i).set_function(lambda s=s: len(s.running))
            used.labels(i).set_function(lambda p=s.pages: p.used)
            total.labels(i).set(s.pages.num_pages - 1)
            hits.labels(i).set_function(lambda p=s.pages: p.hits)
        self.ttft = Histogram(
            "jaxpar_time_to_first_token_seconds", "arrival to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "jaxpar_inter_token_seconds", "between a request's tokens", buckets=LATENCY_BUCKETS, registry=r
        )
        self.requests = Counter("jaxpar_requests", "requests answered", ["status"], registry=r)
        self.tokens = Counter("jaxpar_generated_tokens", "tokens generated", registry=r)
        self.routed = Counter("jaxpar_routed_requests", "choices sent to each replica", ["replica"], registry=r)

    def observe(self, kind: str, seconds: float) -> None:
        (self.ttft if kind == "ttft" else self.itl).observe(seconds)


class Service:
    """What the routes share: the parser, the replicas, the router, the metrics."""

    def __init__(self, engines: list, parser: Parser, *, tokenizer, eos_ids=frozenset(), page_size: int):
        self.parser, self.tokenizer, self.eos_ids = parser, tokenizer, frozenset(eos_ids)
        self.workers = [Worker(e, i) for i, e in enumerate(engines)]
        self.metrics = Metrics(self.workers)
        for w in self.workers:
            w.observe = self.metrics.observe
        self.router = Router(self.workers, page_size=page_size)
        self.draining = False
        self._ids = itertools.count()

    def start(self) -> None:
        for w in self.workers:
            w.start()

    def stop(self) -> None:
        self.draining = True
        for w in self.workers:
            w.stop()
        for w in self.workers:
            w.join()

    def submit(self, job: Job) -> list[tuple[int, Request, Worker, asyncio.Queue]]:
        """Every choice of ``job`` on the replica the router picks; events arrive on each queue."""
        loop = asyncio.get_running_loop()
        out, first = [], None
        for index, prompt, limit, sampling in job.choices():
            request = Request((job.id, index, next(self._ids)), prompt, limit, self.eos_ids | job.stop_ids)
            sibling = first if index % job.n else None  # choice 0 of a prompt computes it first
            worker = sibling[1] if sibling else self.workers[self.router.pick(self.router.key(job.user, prompt))]
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


def _error(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


async def _choice_events(request: Request, worker: Worker, events: asyncio.Queue, text: TextStream):
    """(text delta, finish reason, token ids, their scores) of one choice until it ends: the ids and the
    scores (``TokenScore``s, when asked for) are those that arrived since the last yield. A stop string
    aborts the request."""
    ids, scores = [], []
    while True:
        event = await events.get()
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


def _usage(choices) -> dict:
    prompt = sum(len(r.prompt) for _, r, _, _ in choices)
    done = sum(r.generated for _, r, _, _ in choices)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


def _choice(job: Job, index: int, text: str, reason, ids=None, logprobs: dict | None = None) -> dict:
    if job.kind == "chat":
        key = "message" if ids is not None else "delta"
        out = {
            "index": index,
            key: {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": reason,
        }
    else:
        out = {"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs}
    if ids is not None:
        out["token_ids"] = ids  # an extension: the exact tokens behind the text
    return out


def _envelope(job: Job, model: str, *, chunk: bool) -> dict:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if job.kind == "chat" else "text_completion"
    prefix = "chatcmpl-" if job.kind == "chat" else "cmpl-"
    return {"id": prefix + job.id, "object": kind, "created": job.created, "model": model}


class API:
    """The routes (module doc)."""

    def __init__(self, service: Service):
        self.service = service
        self.model = service.parser.model_name

    async def completions(self, http: HTTPRequest) -> Response:
        return await self._generate(http, "completions")

    async def chat(self, http: HTTPRequest) -> Response:
        return await self._generate(http, "chat")

    async def _generate(self, http: HTTPRequest, kind: str) -> Response:
        try:
            job = self.service.parser.parse(kind, await http.body())
        except APIError as err:
            self.service.metrics.requests.labels("400").inc()
            return _error(err)
        if self.service.draining:
            return _error(APIError("the server is shutting down", status=503, kind="server_error"))
        choices = self.service.submit(job)
        if job.stream:
            return StreamingResponse(self._stream(job, choices), media_type="text/event-stream")
        try:
            return JSONResponse(await self._whole(job, choices))
        except APIError as err:
            return _error(err)
        finally:
            self._abort(choices)

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
            return _choice(job, index, echo + "".join(parts), reason, ids, logprobs)

        done = await asyncio.gather(*(one(*c) for c in choices))
        self._count(choices)
        return _envelope(job, self.model, chunk=False) | {
            "choices": sorted(done, key=lambda c: c["index"]),
            "usage": _usage(choices),
        }

    async def _stream(self, job: Job, choices):
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(index, request, worker, events):
            text = TextStream(self.service.tokenizer, job.stop_text)
            writer = ChoiceLogprobs(self.service.tokenizer, job, list(request.prompt))
            try:
                async for delta, reason, new, records in _choice_events(request, worker, events, text):
                    echo, logprobs = writer.chunk(new, records, request.prompt_logprobs)
                    await merged.put(_choice(job, index, echo + delta, reason, logprobs=logprobs))
            except APIError as err:
                await merged.put(err)
            await merged.put(None)

        tasks = [asyncio.create_task(pump(*c)) for c in choices]
        try:
            left = len(tasks)
            while left:
                item = await merged.get()
                if item is None:
                    left -= 1
                elif isinstance(item, APIError):
                    yield f"data: {json.dumps(item.body())}\n\n"
                else:
                    yield f"data: {json.dumps(_envelope(job, self.model, chunk=True) | {'choices': [item]})}\n\n"
            if job.include_usage:
                usage = _envelope(job, self.model, chunk=True) | {"choices": [], "usage": _usage(choices)}
                yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"
            self._count(choices)
        finally:  # the client went away, or all is sent
            for t in tasks:
                t.cancel()
            self._abort(choices)

    def _abort(self, choices) -> None:
        for _, request, worker, _ in choices:
            if request.finish_reason is None:
                worker.abort(request)

    def _count(self, choices) -> None:
        self.service.metrics.requests.labels("200").inc()
        self.service.metrics.tokens.inc(sum(r.generated for _, r, _, _ in choices))

    async def models(self, http: HTTPRequest) -> Response:
        engine = self.service.workers[0].engine
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model,
                        "object": "model",
                        "created": 0,
                        "owned_by": "jaxpar",
                        "max_model_len": engine.max_length,
                    }
                ],
            }
        )

    async def health(self, http: HTTPRequest) -> Response:
        broken = [w.index for w in self.service.workers if w.error is not None]
        if self.service.draining or broken:
            return JSONResponse(
                {"status": "draining" if self.service.draining else f"replicas {broken} failed"}, status_code=503
            )
        return JSONResponse({"status": "ok", "replicas": len(self.service.workers)})

    async def metrics(self, http: HTTPRequest) -> Response:
        return Response(generate_latest(self.service.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def _http_error(http: HTTPRequest, exc: HTTPException) -> Response:
    return _error(
        APIError(
            f"{http.method} {http.url.path}: {exc.detail}",
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
        service.stop()  # uvicorn has answered every request in flight by now

    routes = [
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/models", api.models),
        Route("/health", api.health),
        Route("/metrics", api.metrics),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: _http_error}, lifespan=lifespan)
