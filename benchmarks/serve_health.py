"""How long ``/health`` takes while the server parses the largest requests its limits let in.

    python benchmarks/serve_health.py --out benchmarks/results/serve_health_cpu.json     # ~1 min

One replica of ``tiny`` on one CPU device, the default ``Limits`` (bodies up to 1 MiB, text up to
262,144 characters), a word-level tokenizer of 256 words. A client thread sends, one after another,
``--requests`` bodies of each kind below; meanwhile another polls ``GET /health`` every 5 ms. Reports
the health latency (p50, p99, max) while each kind is in flight, beside the same with no load, and how
long each kind took to be answered. Kinds:

* ``text``: a prompt of 262,144 characters of words (the most the server tokenizes; refused after
  tokenizing, as far longer than the cache);
* ``ids``: the largest body of token ids (1 MiB, about 520,000 of them; refused after parsing, as far
  longer than the cache);
* ``too_long``: a prompt of 262,145 characters (refused before tokenizing);
* ``deep``: JSON nested as deep as the largest body allows (refused by the parser).

Writes JSON; nothing here is asserted (the tests check that a held parse never blocks ``/health``).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import cpu_name  # noqa: E402


def _build(limits):
    from flax import nnx
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from jaxpar.inference.api import Parser
    from jaxpar.inference.engine import Engine
    from jaxpar.inference.server import Service
    from jaxpar.models import build_model, get_model_preset

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        [" ".join(f"w{i}" for i in range(300))], trainers.WordLevelTrainer(vocab_size=256, special_tokens=["[UNK]"])
    )
    engine = Engine(build_model(get_model_preset("tiny"), rngs=nnx.Rngs(0)), max_slots=4, page_size=16, max_length=64)
    engine.warm_up()
    parser = Parser(model_name="tiny", vocab_size=256, max_length=64, tokenizer=tok, limits=limits)
    return Service([engine], parser, tokenizer=tok, page_size=16, limits=limits)


def bodies(limits) -> dict[str, bytes]:
    words = ("w17 " * (limits.max_text_chars // 4 + 1))[: limits.max_text_chars]
    ids = ",".join(["7"] * ((limits.max_body_bytes - 100) // 2))
    depth = (limits.max_body_bytes - 100) // 2
    return {
        "text": json.dumps({"model": "tiny", "prompt": words}).encode(),
        "ids": b'{"model": "tiny", "prompt": [' + ids.encode() + b"]}",
        "too_long": json.dumps({"model": "tiny", "prompt": words + "x"}).encode(),
        "deep": b'{"model": "tiny", "prompt": ' + b"[" * depth + b"]" * depth + b"}",
    }


def _post(port: int, body: bytes) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    status = conn.getresponse().status
    conn.close()
    return status


def _poll(port: int, stop: threading.Event, out: list) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    while not stop.is_set():
        start = time.perf_counter()
        conn.request("GET", "/health")
        conn.getresponse().read()
        out.append(time.perf_counter() - start)
        time.sleep(0.005)
    conn.close()


def measure(port: int, body: bytes | None, requests: int) -> dict:
    latencies, stop = [], threading.Event()
    poller = threading.Thread(target=_poll, args=(port, stop, latencies))
    poller.start()
    answered, statuses = [], []
    for _ in range(requests if body is not None else 0):
        start = time.perf_counter()
        statuses.append(_post(port, body))
        answered.append(time.perf_counter() - start)
    if body is None:
        time.sleep(2.0)
    stop.set()
    poller.join()
    ms = 1e3 * np.asarray(latencies)
    out = {"health_ms": {"p50": float(np.median(ms)), "p99": float(np.quantile(ms, 0.99)), "max": float(ms.max())}}
    out["health_polls"] = len(latencies)
    if body is not None:
        out |= {"bytes": len(body), "statuses": sorted(set(statuses)), "answered_ms_median": 1e3 * np.median(answered)}
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5, help="bodies of each kind")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from jaxpar.inference.embedded import running
    from jaxpar.inference.limits import Limits

    limits = Limits()
    service = _build(limits)
    report = {"benchmark": "serve_health", "cpu": cpu_name(), "cores": os.cpu_count()}
    report["load_average_before"] = os.getloadavg()[0]
    with running(service) as port:
        report["idle"] = measure(port, None, 0)
        for kind, body in bodies(limits).items():
            report[kind] = measure(port, body, args.requests)
    report["load_average_after"] = os.getloadavg()[0]
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
