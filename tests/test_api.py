"""The OpenAI request format without a server: what is refused and why, chat templates, and the replica
router (streamed text and stop strings: tests/test_text.py)."""

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from jaxpar.chat import load_chat_template
from jaxpar.inference.api import APIError, Parser
from jaxpar.inference.worker import Router

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    vocab = {
        w: i
        for i, w in enumerate(
            ["[UNK]", "<s>", "<user>", "<assistant>", "<system>"] + [f"w{i}" for i in range(59)] + ["é"]
        )
    }
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


@pytest.fixture(scope="module")
def parser(tokenizer):
    return Parser(
        model_name="m",
        vocab_size=65,
        max_length=32,
        tokenizer=tokenizer,
        chat_template=TEMPLATE,
        special_tokens={"bos_token": "<s>"},
    )


def body(**fields) -> bytes:
    return json.dumps({"model": "m", "prompt": "w1 w2"} | fields).encode()


BAD = [  # (raw body, endpoint, the field the error names, a word the message must hold)
    (b"{not json", "completions", None, "JSON"),
    (b'{"model": "m", "prompt": "w1 \xff"}', "completions", None, "UTF-8"),
    (b'{"model": "m", "prompt": "w1 \\ud800"}', "completions", "prompt", "surrogate"),
    (b"[1, 2]", "completions", None, "object"),
    (body(logit_bias={"1": 2}), "completions", "logit_bias", "unknown"),
    (body(model="gpt-4"), "completions", "model", "gpt-4"),
    (body(max_tokens=-1), "completions", "max_tokens", "-1"),
    (body(max_tokens=0), "completions", "max_tokens", "0"),
    (body(max_tokens=10**9), "completions", "max_tokens", "room for 30"),
    (body(max_tokens=2.5), "completions", "max_tokens", "integer"),
    (body(prompt=list(range(40))), "completions", "prompt", "40 tokens"),
    (body(prompt=[1, 99]), "completions", "prompt", "99"),
    (body(prompt=""), "completions", "prompt", "empty"),
    (body(prompt=None), "completions", "prompt", "required"),
    (body(prompt=[[1], {"a": 1}]), "completions", "prompt", "token ids"),
    (body(temperature=3), "completions", "temperature", "outside"),
    (body(top_p=0), "completions", "top_p", "outside"),
    (body(top_k=-2), "completions", "top_k", "outside"),
    (body(n=0), "completions", "n", "outside"),
    (body(stop=["a", "b", "c", "d", "e"]), "completions", "stop", "at most 4"),
    (body(stream="yes"), "completions", "stream", "true or false"),
    (body(stop_token_ids=[70]), "completions", "stop_token_ids", "token ids"),
    (json.dumps({"model": "m", "messages": "hi"}).encode(), "chat", "messages", "role"),
    (
        json.dumps({"model": "m", "messages": [{"role": "user", "content": "w1"}], "prompt": "x"}).encode(),
        "chat",
        "prompt",
        "unknown",
    ),
]


@pytest.mark.parametrize("raw,kind,param,word", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_requests_are_refused_naming_the_field(parser, raw, kind, param, word):
    with pytest.raises(APIError) as info:
        parser.parse(kind, raw)
    err = info.value
    assert err.status == 400 and err.param == param and word in err.message, err.message
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_a_good_completion_request(parser, tokenizer):
    job = parser.parse(
        "completions",
        body(prompt=["w1 w2", [5, 6, 7]], max_tokens=4, n=2, temperature=0.5, seed=9, stop="w3", user="alice"),
    )
    choices = job.choices()
    assert [c[0] for c in choices] == [0, 1, 2, 3]
    assert choices[0][1] == tokenizer.encode("w1 w2").ids and choices[2][1] == [5, 6, 7]
    assert [c[3]["seed"] for c in choices] == [9, 10, 9, 10]  # choice i of n: seed + i
    assert job.stop_text == ["w3"] and job.user == "alice" and job.max_tokens == [4, 4]
    assert parser.parse("completions", body()).max_tokens == [16]  # OpenAI's default


def test_chat_renders_the_template_and_defaults_to_the_room_left(parser, tokenizer):
    job = parser.parse(
        "chat",
        json.dumps(
            {"model": "m", "messages": [{"role": "system", "content": "w1"}, {"role": "user", "content": "w2 w3"}]}
        ).encode(),
    )
    want = tokenizer.encode("<s><system> w1 <user> w2 w3 <assistant>").ids
    assert job.prompts == [want] and job.max_tokens == [32 - len(want)]
    no_template = Parser(model_name="m", vocab_size=65, max_length=32, tokenizer=tokenizer)
    with pytest.raises(APIError, match="no chat template"):
        no_template.parse("chat", json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode())


def test_chat_template_found_beside_the_tokenizer(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    assert load_chat_template(tmp_path / "tokenizer.json") == (None, {})
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "default", "template": "T"}], "bos_token": {"content": "<s>"}})
    )
    assert load_chat_template(tmp_path / "tokenizer.json") == ("T", {"bos_token": "<s>"})
    (tmp_path / "chat_template.jinja").write_text("J")
    assert load_chat_template(tmp_path / "tokenizer.json")[0] == "J"


class FakeWorker:
    def __init__(self, load):
        self.load, self.error, self.stuck = load, None, False

    def available(self, timeout):
        return self.error is None and not self.stuck


def test_router_picks_the_least_loaded_and_keeps_sessions_sticky():
    workers = [FakeWorker(3), FakeWorker(1), FakeWorker(2)]
    router = Router(workers, page_size=4, slack=2)
    assert router.pick(None) == 1
    key = router.key("alice", [1, 2])
    assert router.pick(key) == 1
    workers[1].load = 3  # within the slack of the least loaded (2): stays
    assert router.pick(key) == 1
    workers[1].load = 5  # beyond it: the key moves
    assert router.pick(key) == 2 and router.sticky[key] == 2
    shared = list(range(10))
    assert router.key(None, shared + [7]) == router.key(None, shared[:4] + [9, 9])  # the first page decides
    assert router.key(None, [1, 2, 3]) is None  # no full page: nothing to share
    workers[0].error = "broken"
    workers[0].load = 0
    assert router.pick(None) != 0  # a failed replica gets nothing
    assert router.routed["sticky"] == 1  # the second pick of the key (the first placed it)
    workers[1].stuck = workers[2].stuck = True
    assert router.pick(None) is None  # none available: the server answers 503
    assert "alice" not in "".join(router.sticky)  # the router keeps a hash of `user`, not the string
