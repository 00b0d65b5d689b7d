"""What surrounds the server's routes: the Prometheus series, every response counted by its status,
and the API key.

Both are plain ASGI middleware (a callable over ``scope, receive, send``), so they see every response,
the errors of the routes and of Starlette itself (404, 405) included, and a streamed body passes
through them untouched.
"""

from __future__ import annotations

import hmac
import json

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """The Prometheus series: per replica queue depth, running sequences and pages; latency histograms."""

    def __init__(self, workers: list):  # of jaxpar.inference.worker.Worker
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
        self.requests = Counter("jaxpar_requests", "HTTP responses, by status", ["status"], registry=r)
        self.tokens = Counter("jaxpar_generated_tokens", "tokens generated", registry=r)
        self.routed = Counter("jaxpar_routed_requests", "choices sent to each replica", ["replica"], registry=r)

    def observe(self, kind: str, seconds: float) -> None:
        (self.ttft if kind == "ttft" else self.itl).observe(seconds)


class StatusCounter:
    """Counts each HTTP response in ``counter`` (a Prometheus counter labelled by ``status``); a route
    that raised counts as 500, a client gone before any response as 499."""

    def __init__(self, app, counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 499

        async def counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception:
            status = 500
            raise
        finally:
            self.counter.labels(str(status)).inc()


class APIKey:
    """Every path under ``/v1/`` wants ``Authorization: Bearer <key>``; anything else gets 401 with
    OpenAI's error object. The key is compared in constant time (``hmac.compare_digest``)."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                return await _unauthorized(send)
        return await self.app(scope, receive, send)


async def _unauthorized(send) -> None:
    body = {
        "error": {
            "message": "a valid API key is required: send the header 'Authorization: Bearer <key>'",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": data})
