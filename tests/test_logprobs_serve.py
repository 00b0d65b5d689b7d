"""Log-probs, echo and penalties through ``jaxpar serve``, and lm-evaluation-harness scoring against it.

One server for the module: a tiny llama written as a Hugging Face folder by jaxpar's converter (vocabulary
250, padded to 256 inside jaxpar), a word-level Hugging Face tokenizer with a chat template saved beside
it, served with ``jaxpar serve --from <folder>``. Nothing is downloaded (HF_HUB_OFFLINE and friends).

The server's numbers are compared with a training forward of the same folder (``from_hf``, the model's
``__call__`` on the whole sequence, float32 log_softmax: tests/logprob_oracle.py) and, for lm-eval, with
lm-eval's own Hugging Face backend (torch) on the same folder and task.
"""

import dataclasses
import json
import os
import shutil
import urllib.error
import urllib.request

import numpy as np
import pytest
from flax import nnx
from logprob_oracle import Forward, agree_under_margin, penalized_greedy, ranked_ids_agree, top
from serve_process import launch

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

TOL = 1e-5  # |server - forward| per log-prob (float32 both)
LM_EVAL_TOL = 1e-4  # |jaxpar serve - lm-eval's HF backend| per request's loglikelihood
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
WORDS = [f"w{i}" for i in range(247)]  # + [UNK], <s>, </s>: 250 ids


def _checkpoint(folder):
    """A tiny llama (random weights, vocabulary 250) as a Hugging Face folder, with its tokenizer."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    from jaxpar.convert import to_hf
    from jaxpar.models import build_model, get_model_preset

    cfg = dataclasses.replace(get_model_preset("tiny"), vocab_size=250)
    to_hf(build_model(cfg, rngs=nnx.Rngs(0)), folder, family="llama")
    vocab = {w: i for i, w in enumerate(WORDS + ["[UNK]", "<s>", "</s>"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)
    return tok


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from jaxpar.convert import from_hf

    tmp = tmp_path_factory.mktemp("logprobs")
    folder = tmp / "tinyllama"
    tok = _checkpoint(folder)
    args = ["--from", str(folder), "--port", "0", "--max-slots", "4"]
    args += ["--max-length", "128", "--page-size", "16", "--chunk", "32"]
    proc, url = launch(args, tmp / "server.log", env=os.environ | OFFLINE)
    yield type(
        "Server",
        (),
        dict(
            url=url,
            folder=folder,
            tmp=tmp,
            tokenizer=tok,
            forward=Forward(from_hf(folder), 128),
            client=openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0),
        ),
    )
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    shutil.rmtree(tmp, ignore_errors=True)


def _ids(server, words: list[str]) -> list[int]:
    return [server.tokenizer.token_to_id(w.strip()) for w in words]


def _check_against_forward(server, tokens: list[int], logprobs: list, tops: list, first: int) -> dict:
    """Entries ``first``… of a response (log-prob of tokens[i], its top alternatives as (ids, values))
    against the forward of ``tokens``; returns the largest errors."""
    lp = server.forward.log_probs(tokens)
    err = dict(logprob=0.0, top=0.0, ranks=0)
    for i in range(first, len(tokens)):
        row = lp[i - 1]
        err["logprob"] = max(err["logprob"], abs(logprobs[i] - row[tokens[i]]))
        ids, values = tops[i]
        err["top"] = max(err["top"], float(np.max(np.abs(np.asarray(values) - row[ids]))))
        err["ranks"] += ranked_ids_agree(*top(row, len(ids)), ids, TOL)
    assert err["logprob"] <= TOL and err["top"] <= TOL, err
    return err


def _completion_tops(server, entry: dict, token: int, n: int):
    """(ids, values) of a completions top_logprobs dict, the sampled token left out unless it is in the top n."""
    ranked = sorted(((_ids(server, [k])[0], v) for k, v in entry.items()), key=lambda a: -a[1])
    if len(ranked) > n:
        ranked = [a for a in ranked if a[0] != token]
    return [a[0] for a in ranked[:n]], [a[1] for a in ranked[:n]]


PROMPT = " ".join(WORDS[3:200:5])  # 40 tokens: two chunks of 32


def test_completion_echo_and_logprobs_equal_the_forward(server):
    """echo with logprobs 5 through the OpenAI client: the prompt's log-probs (the first null) and the
    completion's equal the forward's within 1e-5, the top 5 too; tokens and text offsets spell the text."""
    out = server.client.completions.create(
        model="tinyllama", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=5, echo=True
    )
    choice = out.choices[0]
    lp = choice.logprobs
    tokens = _ids(server, PROMPT.split()) + choice.model_extra["token_ids"]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(tokens) == 48
    assert choice.text.startswith(PROMPT) and _ids(server, lp.tokens) == tokens
    for token, offset in zip(lp.tokens, lp.text_offset):
        assert choice.text[offset : offset + len(token)] == token
    tops = [None] + [_completion_tops(server, e, t, 5) for e, t in zip(lp.top_logprobs[1:], tokens[1:])]
    err = _check_against_forward(server, tokens, lp.token_logprobs, tops, 1)
    assert err["ranks"] > 0.9 * 5 * 47, err


def test_a_stream_carries_the_logprobs_of_its_chunks(server):
    """Streamed, the echoed prompt comes first with its log-probs, then each chunk with its tokens'; all
    together they are the whole response's, to the bit."""
    kw = dict(model="tinyllama", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2, echo=True)
    whole = server.client.completions.create(**kw).choices[0].logprobs
    chunks = [c.choices[0] for c in server.client.completions.create(**kw, stream=True) if c.choices]
    assert len(chunks) > 2 and chunks[0].text.startswith(PROMPT)
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in chunks for x in getattr(c.logprobs, key)] == getattr(whole, key), key
    for c in chunks[1:]:
        assert len(c.logprobs.tokens) == len(c.text.split())


def test_echo_with_max_tokens_0_scores_the_prompt_alone(server):
    """A token-id prompt scored with max_tokens 0, two choices: each echoes the prompt and its log-probs
    (both computed: an echo takes nothing from the prefix cache), and nothing is generated."""
    ids = _ids(server, PROMPT.split())
    out = server.client.completions.create(
        model="tinyllama", prompt=ids, max_tokens=0, temperature=0, logprobs=1, echo=True, n=2
    )
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length" and out.usage.completion_tokens == 0
    assert out.choices[1].logprobs == choice.logprobs and out.choices[1].text == PROMPT
    assert len(choice.logprobs.token_logprobs) == len(ids) and choice.model_extra["token_ids"] == []
    tops = [None] + [_completion_tops(server, e, t, 1) for e, t in zip(choice.logprobs.top_logprobs[1:], ids[1:])]
    _check_against_forward(server, ids, choice.logprobs.token_logprobs, tops, 1)


def test_chat_logprobs_equal_the_forward_whole_and_streamed(server):
    messages = [{"role": "user", "content": "w5 w9 w13 w5 w9"}]
    kw = dict(model="tinyllama", messages=messages, max_tokens=10, temperature=0, logprobs=True, top_logprobs=3)
    whole = server.client.chat.completions.create(**kw).choices[0]
    content = whole.logprobs.content
    prompt = _ids(server, (messages[0]["content"] + " ").split())  # the template renders "w5 … w9 "
    tokens = prompt + whole.model_extra["token_ids"]
    assert "".join(e.token for e in content) == whole.message.content and len(content) == 10
    assert all(bytes(e.bytes).decode() == e.token and len(e.top_logprobs) == 3 for e in content)
    logprobs = [None] * len(prompt) + [e.logprob for e in content]
    alternatives = [
        (_ids(server, [a.token for a in e.top_logprobs]), [a.logprob for a in e.top_logprobs]) for e in content
    ]
    _check_against_forward(server, tokens, logprobs, [None] * len(prompt) + alternatives, len(prompt))
    streamed = [c.choices[0] for c in server.client.chat.completions.create(**kw, stream=True) if c.choices]
    assert [e.logprob for c in streamed if c.logprobs for e in c.logprobs.content] == [e.logprob for e in content]


def test_penalties_through_the_server(server):
    """Fields at their off values (and logprobs null) change nothing; strong penalties give the host
    oracle's greedy tokens."""
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 247, 9)]
    plain = server.client.completions.create(model="tinyllama", prompt=prompt, max_tokens=24, temperature=0)
    off = server.client.completions.create(
        model="tinyllama",
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        logprobs=None,
        echo=None,
        presence_penalty=0,
        frequency_penalty=0,
        extra_body={"repetition_penalty": 1},
    )
    assert off.choices[0].model_extra["token_ids"] == plain.choices[0].model_extra["token_ids"]
    assert off.choices[0].logprobs is None
    penalties = dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.4)
    got = server.client.completions.create(
        model="tinyllama",
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        presence_penalty=penalties["presence_penalty"],
        frequency_penalty=penalties["frequency_penalty"],
        extra_body={"repetition_penalty": penalties["repetition_penalty"]},
    )
    got = got.choices[0].model_extra["token_ids"]
    want, gaps = penalized_greedy(server.forward, prompt, 24, **penalties)
    assert agree_under_margin(want, gaps, got) >= 20 and want != plain.choices[0].model_extra["token_ids"]


@pytest.mark.parametrize(
    "raw,param",
    [(b'"presence_penalty": 1e400', "presence_penalty"), (b'"logprobs": 99', "logprobs"), (b'"echo": 1', "echo")],
)
def test_bad_settings_get_400_naming_the_field(server, raw, param):
    body = b'{"model": "tinyllama", "prompt": "w1", ' + raw + b"}"
    req = urllib.request.Request(
        server.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=60)
    assert info.value.code == 400 and json.loads(info.value.read())["error"]["param"] == param


# ------------------------------------------------------------------------------------ lm-evaluation-harness
TASK = """task: jaxpar_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""


def _task(folder) -> None:
    """A multiple-choice task of 8 questions (contexts of 3 to 60 words, 2 to 4 choices of 1 to 5 words)
    in ``folder``: its YAML and its jsonl data."""
    rng = np.random.default_rng(0)
    words = lambda n: " ".join(WORDS[int(i)] for i in rng.integers(0, len(WORDS), n))
    with (folder / "data.jsonl").open("w") as f:
        for n in (3, 8, 17, 31, 33, 40, 52, 60):
            choices = [words(int(rng.integers(1, 6))) for _ in range(int(rng.integers(2, 5)))]
            f.write(json.dumps({"context": words(n), "choices": choices, "label": 0}) + "\n")
    (folder / "jaxpar_choice.yaml").write_text(TASK.format(data=folder / "data.jsonl"))


def _loglikelihoods(results) -> list[tuple[float, bool]]:
    """Every request's (loglikelihood, is_greedy), in document and choice order."""
    samples = sorted(results["samples"]["jaxpar_choice"], key=lambda s: s["doc_id"])
    return [tuple(resp[0]) for s in samples for resp in s["resps"]]


def test_lm_eval_scores_through_the_server_as_its_hf_backend_does(server, monkeypatch):
    """lm-eval's ``local-completions`` (token-id prompts, echo, logprobs 1, max_tokens 1) against jaxpar
    serve and its ``hf`` backend on the same folder: every request's loglikelihood within 1e-4, the same
    is_greedy flags. The same responses read one position off (each continuation scored one token early)
    miss the backend by far more than the bound."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(server.tmp / "datasets"))
    tasks = server.tmp / "tasks"
    tasks.mkdir(exist_ok=True)
    _task(tasks)
    seen = []
    parse = LocalCompletionsAPI.parse_logprobs

    def recording(outputs, tokens=None, ctxlens=None, **kw):
        seen.append((outputs, ctxlens))
        return parse(outputs, tokens, ctxlens, **kw)

    monkeypatch.setattr(LocalCompletionsAPI, "parse_logprobs", staticmethod(recording))
    common = dict(tasks=["jaxpar_choice"], task_manager=TaskManager(include_path=str(tasks), include_defaults=False))
    served = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=dict(
            model="tinyllama",
            base_url=server.url + "/v1/completions",
            tokenizer_backend="huggingface",
            tokenizer=str(server.folder),
            tokenized_requests=True,
            max_retries=1,
        ),
        **common,
    )
    reference = lm_eval.simple_evaluate(
        model="hf",
        model_args=dict(pretrained=str(server.folder), dtype="float32", device="cpu"),
        batch_size=1,
        **common,
    )
    got, want = _loglikelihoods(served), _loglikelihoods(reference)
    assert len(got) == len(want) == len(seen) >= 16
    errors = [abs(g[0] - w[0]) for g, w in zip(got, want)]
    assert max(errors) <= LM_EVAL_TOL, max(errors)
    assert [g[1] for g in got] == [w[1] for w in want]
    # the responses read one position early: what a server off by one would return
    by_value = {g[0]: w[0] for g, w in zip(got, want)}
    for outputs, ctxlens in seen:
        logprobs = outputs[0]["choices"][0]["logprobs"]["token_logprobs"]
        right, early = sum(logprobs[ctxlens[0] : -1]), sum(logprobs[ctxlens[0] - 1 : -2])
        assert right in by_value and abs(early - by_value[right]) > 10 * LM_EVAL_TOL
