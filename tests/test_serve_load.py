"""Load and faults together, bounded in time, on loopback: 12 client threads for ``SECONDS`` seconds
against the in-process server (tests/serve_inprocess.py), each doing at random one of

* a greedy request (streamed or not) of one of ``PROMPTS``, whose tokens must equal that prompt's
  answer computed alone before the load (prompts shorter than a page share no cached pages, so every
  request computes the same chunks in the same shapes wherever it runs: the answer is exact);
* a request whose client hangs up a few milliseconds after sending it;
* a malformed body (400);
* a body sent slowly, or cut off halfway and the connection closed.

No response may be a 5xx; the process's resident memory may grow by at most ``RSS_GROWTH`` bytes from
the first half of the load to the end; at the end every replica has no sequence and no page in use.
"""

import http.client
import json
import random
import socket
import threading
import time
from collections import Counter

import pytest
from serve_inprocess import PAGE, idle, serving

from jaxpar.inference.limits import Limits

SECONDS, CLIENTS, TOKENS = 20.0, 12, 8
RSS_GROWTH = 100 * 2**20
LIMITS = Limits(body_timeout=2.0, request_timeout=60.0, max_pending=64)
PROMPTS = [" ".join(f"w{(7 * i + j) % 250}" for j in range(3 + i % (PAGE - 4))) for i in range(10)]
MALFORMED = [b"{", b"[]", b'{"model": "tiny"}', b'{"model": "tiny", "prompt": "w1", "n": 0}', b"\xff\xfe"]


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.fixture(scope="module")
def served():
    with serving(LIMITS) as running:
        yield running


def ask(port, prompt: str, stream: bool) -> tuple[int, list[int] | None]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "stream": stream}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    raw = response.read().decode()
    conn.close()
    if response.status != 200 or stream:  # a stream carries text only: its status is what is checked
        return response.status, None
    return response.status, json.loads(raw)["choices"][0]["token_ids"]


def hang_up(port, rng) -> None:
    body = json.dumps({"model": "tiny", "prompt": rng.choice(PROMPTS), "max_tokens": 40}).encode()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(rng.uniform(0, 0.05))


def slow_body(port, rng) -> int | None:
    body = json.dumps({"model": "tiny", "prompt": rng.choice(PROMPTS), "max_tokens": 2}).encode()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(30)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body))
        cut = rng.random() < 0.5
        for i in range(0, len(body) // 2 if cut else len(body), 8):
            s.sendall(body[i : i + 8])
            time.sleep(0.01)
        if cut:
            return None
        return int(s.recv(64).split(b" ")[1])


def malformed(port, rng) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", rng.choice(MALFORMED), {"Content-Type": "application/json"})
    status = conn.getresponse().status
    conn.close()
    return status


def client(port, seed: int, until: float, want: dict, statuses: Counter, wrong: list) -> None:
    rng = random.Random(seed)
    while time.time() < until:
        action = rng.random()
        if action < 0.55:
            prompt, stream = rng.choice(PROMPTS), rng.random() < 0.3
            status, tokens = ask(port, prompt, stream)
            if tokens is not None and tokens != want[prompt]:
                wrong.append((prompt, tokens, want[prompt]))
        elif action < 0.7:
            hang_up(port, rng)
            status = "hung up"
        elif action < 0.85:
            status = malformed(port, rng)
        else:
            status = slow_body(port, rng) or "cut off"
        statuses[status] += 1


def test_load_with_faults(served):
    service, port = served
    want = {p: ask(port, p, False)[1] for p in PROMPTS}  # each alone
    statuses, wrong = Counter(), []
    until = time.time() + SECONDS
    threads = [
        threading.Thread(target=client, args=(port, i, until, want, statuses, wrong), daemon=True)
        for i in range(CLIENTS)
    ]
    for t in threads:
        t.start()
    time.sleep(SECONDS / 2)
    middle = rss()
    for t in threads:
        t.join(SECONDS + 120)
    assert not any(t.is_alive() for t in threads)
    grown = rss() - middle
    print(dict(statuses), f"RSS grew {grown / 2**20:.1f} MiB in the second half")
    assert not wrong, wrong[:3]
    assert not [s for s in statuses if isinstance(s, int) and s >= 500], statuses
    assert statuses[200] >= 50 and statuses[400] >= 5 and statuses["hung up"] >= 5, statuses
    assert grown < RSS_GROWTH
    assert idle(service, wait=30)
    metrics = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    metrics.request("GET", "/metrics")
    counted = [line for line in metrics.getresponse().read().decode().splitlines() if "jaxpar_requests_total{" in line]
    assert counted and not [line for line in counted if 'status="5' in line], counted  # none the clients missed
    assert all(len(w.engine.scheduler.free_slots) == w.engine.slots for w in service.workers)
