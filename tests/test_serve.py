"""``jaxpar serve`` as a user meets it: a process on 127.0.0.1 spoken to with the ``openai`` client.

One server for the module: a tiny checkpoint, a word-level tokenizer with a chat template beside it,
two engine replicas on two simulated devices. Completions and streaming, chat, 32 concurrent requests
against the same requests one by one, every malformed request in ``BAD`` (400 and the server goes on),
the metrics, a client that goes away, and last SIGTERM with requests in flight (they complete, exit 0).
Prompts are shorter than a page, so no request shares cached pages with another: each computes the
same chunks in the same shapes wherever it runs, and greedy text is then exactly reproducible.
"""

import concurrent.futures
import json
import re
import shutil
import signal
import socket
import time
import urllib.error
import urllib.request

import pytest
from flax import nnx
from serve_process import launch

openai = pytest.importorskip("openai")

PAGE = 16
SHUTDOWN = 20  # --shutdown-timeout: seconds SIGTERM waits for the requests in flight
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from jaxpar.convert.store import save_model
    from jaxpar.models import build_model, get_model_preset

    tmp = tmp_path_factory.mktemp("serve")
    save_model(build_model(get_model_preset("tiny"), rngs=nnx.Rngs(0)), tmp / "tiny", source={"test": True})
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    words = [f"w{i}" for i in range(300)]
    tok.train_from_iterator(
        [" ".join(words[: i + 1]) for i in range(300)],
        trainers.WordLevelTrainer(vocab_size=256, special_tokens=["[UNK]"]),
    )
    tok.save(str(tmp / "tiny" / "tokenizer.json"))
    (tmp / "tiny" / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    args = ["--from", str(tmp / "tiny"), "--port", "0", "--cpu-devices", "2", "--replicas", "2"]
    args += ["--max-slots", "8", "--max-length", "128", "--page-size", str(PAGE), "--chunk", "32"]
    # --body-timeout so long that only the shutdown limit can end the hung client of the SIGTERM test
    args += ["--shutdown-timeout", str(SHUTDOWN), "--body-timeout", "600"]
    proc, url = launch(args, tmp / "server.log")
    yield type(
        "Server",
        (),
        dict(
            proc=proc,
            url=url,
            log=tmp / "server.log",
            tokenizer=tok,
            client=openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0),
        ),
    )
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    shutil.rmtree(tmp, ignore_errors=True)


def prompts(n: int, seed: int = 0) -> list[str]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [" ".join(f"w{int(w)}" for w in rng.integers(1, 250, rng.integers(1, PAGE))) for _ in range(n)]


def post(server, path: str, raw: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(server.url + path, data=raw, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as res:
            return res.status, json.loads(res.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def get(server, path: str) -> str:
    with urllib.request.urlopen(server.url + path, timeout=60) as res:
        return res.read().decode()


def metric(server, name: str) -> float:
    """A labelled Prometheus series summed over its labels (the replicas)."""
    return sum(float(x) for x in re.findall(rf"^{name}\{{.*\}} (\S+)$", get(server, "/metrics"), re.M))


def test_completion_and_its_stream_say_the_same(server):
    whole = server.client.completions.create(model="tiny", prompt="w1 w2 w3", max_tokens=12, temperature=0)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and whole.usage.completion_tokens == 12
    assert choice.text == server.tokenizer.decode(choice.model_extra["token_ids"])
    chunks = list(
        server.client.completions.create(
            model="tiny",
            prompt="w1 w2 w3",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert len([c for c in chunks if c.choices]) > 1  # it came in pieces
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12


def test_chat_uses_the_template_and_stop_strings_cut(server):
    chat = server.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "w1 w2 w3"}], max_tokens=6, temperature=0
    )
    plain = server.client.completions.create(model="tiny", prompt="w1 w2 w3 ", max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == plain.choices[0].text  # the template renders "w1 w2 w3 "
    words = plain.choices[0].text.split()
    cut = server.client.completions.create(
        model="tiny", prompt="w1 w2 w3", max_tokens=6, temperature=0, stop=[words[2]]
    )
    assert cut.choices[0].text == " ".join(words[:2]) + " " and cut.choices[0].finish_reason == "stop"


def test_32_concurrent_requests_equal_the_same_requests_one_by_one(server):
    texts = prompts(32)
    ask = lambda p: server.client.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0).choices[0]
    alone = [ask(p) for p in texts]
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        together = list(pool.map(ask, texts))
    assert [c.text for c in together] == [c.text for c in alone]
    assert [c.model_extra["token_ids"] for c in together] == [c.model_extra["token_ids"] for c in alone]
    metrics = get(server, "/metrics")
    for replica in ("0", "1"):  # both replicas took part, and are empty again
        assert float(re.search(f'jaxpar_routed_requests_total{{replica="{replica}"}} (\\S+)', metrics).group(1)) > 0
        assert f'jaxpar_running_sequences{{replica="{replica}"}} 0.0' in metrics
        assert f'jaxpar_pages_used{{replica="{replica}"}} 0.0' in metrics
    assert float(re.search(r"jaxpar_time_to_first_token_seconds_count (\S+)", metrics).group(1)) >= 64


BAD = {
    "malformed JSON": b'{"model": "tiny", "prompt": ',
    "unknown field": json.dumps({"model": "tiny", "prompt": "w1", "best_of": 2}).encode(),
    "unknown model": json.dumps({"model": "gpt-5", "prompt": "w1"}).encode(),
    "negative max_tokens": json.dumps({"model": "tiny", "prompt": "w1", "max_tokens": -3}).encode(),
    "huge max_tokens": json.dumps({"model": "tiny", "prompt": "w1", "max_tokens": 10**12}).encode(),
    "prompt beyond the cache": json.dumps({"model": "tiny", "prompt": list(range(1, 140))}).encode(),
    "non-UTF-8 bytes": b'{"model": "tiny", "prompt": "w1 \xc3\x28"}',
    "lone surrogate": b'{"model": "tiny", "prompt": "w1 \\udc80"}',
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_requests_get_400_and_the_server_goes_on(server, case):
    status, body = post(server, "/v1/completions", BAD[case])
    assert status == 400 and body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    ok = server.client.completions.create(model="tiny", prompt="w5", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens == 2


def test_the_openai_client_sees_a_bad_request_error(server):
    with pytest.raises(openai.BadRequestError) as info:
        server.client.completions.create(model="tiny", prompt="w1", max_tokens=0)
    assert info.value.body["param"] == "max_tokens"


def test_models_health_and_metrics(server):
    models = json.loads(get(server, "/v1/models"))
    assert [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["max_model_len"] == 128
    assert json.loads(get(server, "/health")) == {"status": "ok", "replicas": 2, "failed": [], "stalled": []}
    metrics = get(server, "/metrics")
    for name in (
        "jaxpar_queue_depth",
        "jaxpar_running_sequences",
        "jaxpar_pages_used",
        "jaxpar_pages_total",
        "jaxpar_time_to_first_token_seconds_bucket",
        "jaxpar_inter_token_seconds_bucket",
    ):
        assert name in metrics
    assert 'jaxpar_pages_total{replica="0"} 64.0' in metrics  # 8 slots × 128 / 16


def test_a_shared_prefix_goes_to_one_replica_and_its_pages_are_reused(server):
    system = " ".join(f"w{i}" for i in range(3, 3 + 3 * PAGE))  # three full pages
    hits = lambda: metric(server, "jaxpar_prefix_cache_hit_pages")
    before = hits()
    for user in ("w1", "w2", "w9"):
        server.client.completions.create(model="tiny", prompt=f"{system} {user}", max_tokens=2, temperature=0)
    assert hits() - before == 2 * 3  # the 2nd and 3rd find all three pages


def test_n_choices_share_the_prompt_pages_of_the_first(server):
    prompt = " ".join(f"w{i}" for i in range(100, 140))  # 40 tokens: 2 shareable pages
    hits = lambda: metric(server, "jaxpar_prefix_cache_hit_pages")
    before = hits()
    out = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=8, n=3, temperature=1.0, seed=3)
    assert [c.index for c in out.choices] == [0, 1, 2] and out.usage.completion_tokens == 24
    assert len({c.text for c in out.choices}) == 3  # seeds 3, 4, 5
    assert hits() - before == 2 * 2  # choices 1 and 2 start from choice 0's pages


def test_a_client_that_leaves_frees_its_sequence(server):
    stream = server.client.completions.create(model="tiny", prompt="w7 w8", max_tokens=100, temperature=0, stream=True)
    next(iter(stream))
    stream.close()
    deadline = time.time() + 30
    while (
        'jaxpar_running_sequences{replica="0"} 0.0' not in (m := get(server, "/metrics"))
        or 'jaxpar_running_sequences{replica="1"} 0.0' not in m
    ):
        assert time.time() < deadline, "the abandoned request kept its slot"
        time.sleep(0.1)


def test_sigterm_completes_the_requests_in_flight_and_exits_0(server):
    """Last in the module: it stops the server. A client that sent 1 byte of a 100-byte body and hangs
    does not hold the server past --shutdown-timeout."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    hung = socket.create_connection((host, int(port)))
    hung.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")

    def ask(p):
        chunks = list(
            server.client.completions.create(model="tiny", prompt=p, max_tokens=100, temperature=0, stream=True)
        )
        return sum(1 for c in chunks if c.choices and c.choices[0].text), chunks[-1].choices[0].finish_reason

    routed = lambda: metric(server, "jaxpar_routed_requests_total")
    before = routed()
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(ask, p) for p in prompts(6, seed=1)]
        deadline = time.time() + 60
        while routed() < before + 6:  # all six in the engines (a later one would get 503)
            assert time.time() < deadline
            time.sleep(0.02)
        server.proc.send_signal(signal.SIGTERM)
        results = [f.result(timeout=120) for f in futures]
    assert all(reason == "length" for _, reason in results)
    assert server.proc.wait(timeout=SHUTDOWN + 60) == 0, server.log.read_text()
    hung.close()
    drained = re.search(r"SIGTERM: finishing (\d+) sequence", server.log.read_text())
    assert drained and int(drained.group(1)) >= 1, server.log.read_text()  # some were still running
