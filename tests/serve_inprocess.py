"""``jaxpar serve``'s app in this process (``jaxpar.inference.embedded``: uvicorn on a thread, loopback,
port 0) over tiny engine replicas, so a test can reach into the engines (break one, wedge one) while
clients speak HTTP to it.
Used by tests/test_serve_faults.py and tests/test_serve_fuzz.py."""

import contextlib
import http.client
import json
import time

from flax import nnx

PAGE, LENGTH = 16, 64


def word_tokenizer():
    """A word-level tokenizer over "w0" … "w254" and "[UNK]" (256 ids, the tiny model's vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    words = " ".join(f"w{i}" for i in range(300))
    tok.train_from_iterator([words], trainers.WordLevelTrainer(vocab_size=256, special_tokens=["[UNK]"]))
    return tok


@contextlib.contextmanager
def serving(limits, *, api_key=None, replicas: int = 2, slots: int = 4, model=None, adapters=()):
    """Yields (service, port) of a running server of ``model`` (default: the tiny preset, seed 0) and its
    ``adapters`` (``jaxpar.inference.adapters.Adapter``), with a chat template that joins the messages'
    contents; stops it on exit."""
    from jaxpar.inference.api import Parser
    from jaxpar.inference.embedded import running
    from jaxpar.inference.engine import Engine
    from jaxpar.inference.server import Service
    from jaxpar.models import build_model, get_model_preset

    tok = word_tokenizer()
    model = model or build_model(get_model_preset("tiny"), rngs=nnx.Rngs(0))
    engines = [
        Engine(model, max_slots=slots, page_size=PAGE, max_length=LENGTH, chunk=16, adapters=adapters)
        for _ in range(replicas)
    ]
    for engine in engines:
        engine.warm_up()  # as `jaxpar serve` does: no compile inside a request's deadline
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    parser = Parser(
        model_name="tiny",
        vocab_size=256,
        max_length=LENGTH,
        tokenizer=tok,
        chat_template=template,
        limits=limits,
        adapters=[a.name for a in adapters],
    )
    service = Service(engines, parser, tokenizer=tok, page_size=PAGE, limits=limits, api_key=api_key)
    with running(service) as port:
        yield service, port


def idle(service, wait: float = 10.0) -> bool:
    """Every replica ends with no sequence, queued, held or running, and no page in use."""
    deadline = time.time() + wait
    while time.time() < deadline:
        if all(w.engine.idle and w.engine.pages.used == 0 and not w.held for w in service.workers):
            return True
        time.sleep(0.05)
    return False


def call(port, method, path, body=None, *, key=None, headers=None, timeout=30):
    """(status, parsed JSON or text, response headers) of one request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    raw = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
    sent = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    conn.request(method, path, body=raw, headers={**sent, **(headers or {})})
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    try:
        return response.status, json.loads(text), dict(response.getheaders())
    except ValueError:
        return response.status, text, dict(response.getheaders())
