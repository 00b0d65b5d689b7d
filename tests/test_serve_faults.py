"""``jaxpar serve`` under clients that try to break it: the server runs in this process (uvicorn on a
thread, loopback, port 0) over two tiny engine replicas, with small limits, so a test can break an
engine on purpose (a step that raises, a step that never returns) and watch what every other request
and ``/health`` see.

Each test here is one finding of the outside probe: one request killing a replica (bad seed, NaN), a
failed or wedged replica still given requests, no deadline, no body limit, parsing on the event loop, a
non-streaming client's disconnect ignored, no admission control, an unbounded ``user``, no API key,
500s for malformed bodies and statuses never counted.
"""

import http.client
import json
import socket
import threading
import time

import numpy as np
import pytest
from serve_inprocess import call as call_server
from serve_inprocess import idle, serving

from jaxpar.inference.limits import Limits

LIMITS = Limits(
    max_body_bytes=32 * 1024,
    body_timeout=1.0,
    max_text_chars=2000,
    max_user_chars=64,
    max_choices=4,
    max_pending=6,
    request_timeout=4.0,
    stall_timeout=1.0,
)
KEY = "test-key"


@pytest.fixture(scope="module")
def served():
    with serving(LIMITS, api_key=KEY) as running:
        yield running


def call(port, method, path, body=None, *, key=KEY, **kw):
    return call_server(port, method, path, body, key=key, **kw)


def complete(port, **fields):
    return call(port, "POST", "/v1/completions", {"model": "tiny", "prompt": "w1 w2 w3", **fields})


def healthy(port) -> bool:
    return call(port, "GET", "/health", key=None)[0] == 200


@pytest.mark.parametrize(
    "field, param",
    [
        ('"seed": -1', "seed"),
        ('"seed": 4294967296', "seed"),
        ('"temperature": NaN', None),  # not JSON: the body is refused
        ('"temperature": 1e400', "temperature"),  # JSON, and parses as inf
        ('"top_p": -1e400', "top_p"),
    ],
)
def test_a_bad_sampling_setting_fails_only_its_request(served, field, param):
    service, port = served
    raw = '{"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 4, ' + field + "}"
    status, body, _ = call(port, "POST", "/v1/completions", raw.encode())
    assert status == 400 and body["error"]["param"] == param, body
    assert healthy(port) and complete(port, max_tokens=4)[0] == 200


def test_the_largest_seed_samples_every_choice(served):
    """seed 2**32 − 1 with n = 3: choices 1 and 2 wrap to seeds 0 and 1 instead of leaving the range."""
    status, body, _ = complete(served[1], max_tokens=3, seed=2**32 - 1, n=3, temperature=1.0)
    assert status == 200 and len(body["choices"]) == 3, body


def test_a_request_the_engine_refuses_fails_alone(served, monkeypatch):
    """Whatever the parser let through, ``Engine.submit`` checks again: its refusal is that request's 400."""
    service, port = served
    monkeypatch.setattr(service.parser, "parse", _with_sampling(service.parser.parse, temperature=-1.0))
    status, body, _ = complete(port, max_tokens=4)
    assert status == 400 and "temperature" in body["error"]["message"], body
    monkeypatch.undo()
    assert healthy(port) and complete(port, max_tokens=4)[0] == 200


def _with_sampling(parse, **changes):
    def changed(kind, raw):
        job = parse(kind, raw)
        job.sampling.update(changes)
        return job

    return changed


def test_malformed_bodies_get_400_never_500(served):
    service, port = served
    deep = b'{"model": "tiny", "prompt": ' + b"[" * 15_000 + b"]" * 15_000 + b"}"
    surrogate = b'{"model": "tiny", "prompt": "w1", "\\udc80x": 1}'
    for raw in (deep, surrogate, b'{"model": "tiny", "prompt": "w1", "temperature": NaN}', b"[1", b"\xff"):
        status, body, _ = call(port, "POST", "/v1/completions", raw)
        assert status == 400 and set(body) == {"error"}, (raw[:40], status, body)
    status, body, _ = call(port, "POST", "/v1/completions", surrogate)
    assert body["error"]["param"] == "\\udc80x"  # escaped, never the raw surrogate
    assert healthy(port)


def test_limits_answer_with_their_status(served):
    service, port = served
    big = {"model": "tiny", "prompt": "w1 " * 20_000}
    assert call(port, "POST", "/v1/completions", big)[0] == 413  # Content-Length over max_body_bytes
    assert complete(port, prompt="w1 " * 700)[0] == 400  # 2,100 characters: refused before tokenizing
    assert complete(port, stop=["x" * 1025])[0] == 400
    assert complete(port, stop=["a", "b", "c", "d", "e"])[0] == 400
    assert complete(port, user="u" * 65)[0] == 400
    assert complete(port, prompt=["w1", "w2"], n=3)[0] == 400  # 6 choices > 4
    assert complete(port, prompt=["w1", "w2"], n=2, max_tokens=2)[0] == 200
    assert healthy(port)


def test_a_body_streamed_past_the_limit_gets_413(served):
    """No Content-Length (chunked): the body is counted as it arrives."""
    _, port = served
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    chunks = (b"x" * 4096 for _ in range(16))  # 64 KiB > 32 KiB
    conn.request("POST", "/v1/completions", body=chunks, headers={"Authorization": f"Bearer {KEY}"})
    assert conn.getresponse().status == 413


def test_a_slow_body_times_out_with_408(served):
    _, port = served
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode())
        s.sendall(b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        s.settimeout(20)
        assert s.recv(4096).startswith(b"HTTP/1.1 408")


def test_the_api_key_guards_v1_and_not_health(served):
    _, port = served
    assert complete(port)[0] == 200
    assert call(port, "POST", "/v1/completions", {"model": "tiny", "prompt": "w1"}, key=None)[0] == 401
    assert call(port, "POST", "/v1/completions", {"model": "tiny", "prompt": "w1"}, key="test-kez")[0] == 401
    assert call(port, "GET", "/v1/models", key="wrong")[0] == 401
    assert call(port, "GET", "/health", key=None)[0] == 200


def test_parsing_runs_beside_the_event_loop(served, monkeypatch):
    """A parse held on purpose: /health still answers, so parsing never blocks the loop."""
    service, port = served
    release, parse = threading.Event(), service.parser.parse
    monkeypatch.setattr(service.parser, "parse", lambda kind, raw: (release.wait(30), parse(kind, raw))[1])
    held = threading.Thread(target=complete, args=(port,), kwargs={"max_tokens": 2})
    held.start()
    time.sleep(0.3)
    try:
        assert call(port, "GET", "/health", key=None, timeout=5)[0] == 200
    finally:
        release.set()
        held.join(30)


def test_a_client_that_leaves_a_whole_response_frees_its_sequence(served):
    """Not streaming: the client sends its request and closes the connection; the sequence is aborted."""
    service, port = served
    body = json.dumps({"model": "tiny", "prompt": "w1 w2", "max_tokens": 60, "min_p": 0.0}).encode()
    with socket.create_connection(("127.0.0.1", port)) as s:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        s.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.time() + 10
        while not any(w.engine.scheduler.running for w in service.workers) and time.time() < deadline:
            time.sleep(0.01)
    assert idle(service)


def test_pending_requests_over_the_limit_get_429(served, monkeypatch):
    service, port = served
    gate = _wedge(service, monkeypatch, range(2))
    try:
        fired = [_fire(port, max_tokens=4) for _ in range(6)]  # fills max_pending = 6
        deadline = time.time() + 10
        while sum(w.load for w in service.workers) < 6 and time.time() < deadline:
            time.sleep(0.02)
        status, _, headers = complete(port, max_tokens=4)
        assert status == 429 and headers.get("retry-after") == "1"
    finally:
        gate.set()
    assert all(t.join(30) or not t.is_alive() for t in fired)
    assert idle(service) and complete(port, max_tokens=4)[0] == 200


def test_a_wedged_replica_is_skipped_reported_and_its_requests_time_out(served, monkeypatch):
    service, port = served
    gate = _wedge(service, monkeypatch, [0])
    try:
        stuck = _fire(port, max_tokens=4, user="pinned-0")  # lands on replica 0 (both idle: the first)
        time.sleep(LIMITS.stall_timeout + 0.5)
        status, body, _ = call(port, "GET", "/health", key=None)
        assert status == 503 and body["stalled"] == [0], body
        for _ in range(3):  # replica 1 serves meanwhile
            assert complete(port, max_tokens=4)[0] == 200
        stuck.join(LIMITS.request_timeout + 10)
        assert stuck.result[0] == 504, stuck.result
    finally:
        gate.set()
    assert idle(service) and healthy(port)


def test_a_failed_engine_answers_everything_it_held_and_gets_no_more(served, monkeypatch):
    service, port = served
    broken = service.workers[0]

    def fail():
        raise RuntimeError("device lost")

    monkeypatch.setattr(broken.engine, "step", fail)
    answers = [complete(port, max_tokens=4, prompt=f"w{i} w{i + 1}") for i in range(4)]
    assert {a[0] for a in answers} <= {200, 500} and any(a[0] == 500 for a in answers)
    assert broken.error is not None and call(port, "GET", "/health", key=None)[1]["failed"] == [0]
    assert all(complete(port, max_tokens=4, prompt=f"w{i}")[0] == 200 for i in range(4))  # all on replica 1
    monkeypatch.setattr(service.workers[1], "error", "gone")
    assert complete(port, max_tokens=4)[0] == 503  # no replica left


def test_every_status_is_counted(served):
    """The metric counts every response by its status, the refused ones too (400, 401, 404, 413)."""
    _, port = served
    before = dict(_series(call(port, "GET", "/metrics", key=None)[1], "jaxpar_requests_total"))
    answers = [
        complete(port, max_tokens=2)[0],
        complete(port, seed=-1)[0],
        call(port, "GET", "/v1/models", key=None)[0],
        call(port, "GET", "/nowhere", key=None)[0],
        call(port, "POST", "/v1/completions", b"x" * (LIMITS.max_body_bytes + 1))[0],
    ]
    assert answers == [200, 400, 401, 404, 413]
    after = dict(_series(call(port, "GET", "/metrics", key=None)[1], "jaxpar_requests_total"))
    for status in map(str, answers):
        assert after[status] - before.get(status, 0) >= 1, (status, before, after)


def _series(metrics: str, name: str):
    for line in metrics.splitlines():
        if line.startswith(name + "{"):
            yield line.split('status="')[1].split('"')[0], float(line.rsplit(" ", 1)[1])


# ------------------------------------------------------------------------------------------ helpers
class _Call(threading.Thread):
    def __init__(self, port, fields):
        super().__init__(daemon=True)
        self.port, self.fields, self.result = port, fields, None

    def run(self):
        self.result = complete(self.port, **self.fields)


def _fire(port, **fields) -> _Call:
    call_ = _Call(port, fields)
    call_.start()
    return call_


def _wedge(service, monkeypatch, replicas) -> threading.Event:
    """Each replica in ``replicas`` blocks inside its next step until the returned event is set."""
    gate = threading.Event()
    for i in replicas:
        engine = service.workers[i].engine
        step = engine.step
        monkeypatch.setattr(engine, "step", lambda step=step: (gate.wait(60), step())[1])
    return gate


def test_the_step_log_is_bounded():
    from jaxpar.inference.engine import LOG_STEPS, StepLog

    assert LOG_STEPS <= 10_000
    total = sum((StepLog(1, 2, 0, 0.5) for _ in range(3)), StepLog(0, 0, 0, 0.0))
    assert total == StepLog(3, 6, 0, 1.5) and np.isclose(total.seconds, 1.5)


@pytest.mark.parametrize(
    "host, key, insecure, refused",
    [
        ("127.0.0.1", None, False, False),
        ("::1", None, False, False),
        ("localhost", None, False, False),
        ("0.0.0.0", None, False, True),
        ("0.0.0.0", "k", False, False),
        ("0.0.0.0", None, True, False),
        ("10.1.2.3", " ", False, True),
    ],
)
def test_a_server_other_machines_reach_needs_a_key(host, key, insecure, refused):
    from jaxpar.errors import ConfigError
    from jaxpar.inference.serve_command import check_access

    if refused:
        with pytest.raises(ConfigError, match="--host|--api-key"):
            check_access(host, key, insecure)
    else:
        check_access(host, key, insecure)


def test_connections_over_the_limit_get_503():
    """--max-connections is uvicorn's limit_concurrency: with 2 connections held open by clients still
    sending their headers, a third request is answered 503 at once, and answered normally once they are
    gone. (Held by unfinished headers, not bodies: a request whose headers arrive is itself over the
    limit, answered 503, and its connection may then close before the third request comes.)"""
    limits = Limits(max_connections=2, body_timeout=30.0)
    with serving(limits, replicas=1) as (_, port):
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        for s in held:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        time.sleep(0.3)
        status, body, _ = call(port, "GET", "/health", key=None)
        assert status == 503 and body == "Service Unavailable"  # uvicorn's answer, not /health's
        for s in held:
            s.close()
        time.sleep(0.3)
        assert call(port, "GET", "/health", key=None)[0] == 200
