"""Log-probs, echo and penalties without a server: the engine's numbers against a training forward and a
host-side penalty oracle (tests/logprob_oracle.py), the request fields the parser accepts and refuses,
and the OpenAI objects written for byte-level and byte-fallback tokenizers."""

import dataclasses
import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from logprob_oracle import Forward, agree_under_margin, penalized_greedy, ranked_ids_agree, top
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from jaxpar.errors import ConfigError
from jaxpar.inference.api import APIError, Job, Parser
from jaxpar.inference.engine import Engine
from jaxpar.inference.logprob_format import ChoiceLogprobs, echo_text
from jaxpar.inference.logprobs import StepExtras, TokenScore, _counts, _penalize
from jaxpar.inference.scheduler import Request
from jaxpar.models import build_model, get_model_preset

TOL = 1e-5  # |engine - forward| for a log-prob, float32 both


@pytest.fixture(scope="module")
def tiny():
    return build_model(get_model_preset("tiny"), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def forward(tiny):
    return Forward(tiny, 64)


def _engine(model, **kw):
    return Engine(model, max_slots=4, page_size=8, max_length=64, chunk=16, **kw)


def _compare(forward, r: Request, n: int) -> dict:
    """Every log-prob ``r`` holds against the forward of its tokens: the generated tokens' and, when
    recorded, the prompt's (position 0 has none). Returns the largest errors and the ranks compared."""
    lp = forward.log_probs(r.tokens)
    scored = [(len(r.prompt) + i, s) for i, s in enumerate(r.token_logprobs[: r.generated])]
    scored += [(p, s) for p, s in enumerate(r.prompt_logprobs or []) if s is not None]
    if r.prompt_logprobs is not None:
        assert r.prompt_logprobs[0] is None and all(s is not None for s in r.prompt_logprobs[1:])
    out = dict(logprob=0.0, top=0.0, ranks=0, scored=len(scored))
    for p, s in scored:
        row, token = lp[p - 1], r.tokens[p]
        out["logprob"] = max(out["logprob"], abs(s.logprob - row[token]))
        want_ids, want_values = top(row, n)
        out["ranks"] += ranked_ids_agree(want_ids, want_values, s.top_ids, TOL)
        order = np.asarray(s.top_ids)
        out["top"] = max(out["top"], float(np.max(np.abs(np.asarray(s.top_logprobs) - row[order]))))
    assert out["logprob"] <= TOL and out["top"] <= TOL, out
    return out


def _requests(n, seed, **sampling):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = [int(t) for t in rng.integers(0, 256, rng.integers(1, 44))]
        out.append((Request(i, prompt, max_new_tokens=int(rng.integers(1, 14))), dict(sampling, seed=i)))
    return out


def test_engine_logprobs_equal_a_training_forward(tiny, forward):
    """Twelve requests at once (greedy and sampled, prompts over several chunks, half echoing their prompt's
    log-probs): every sampled token's log-prob and its top 5, and every prompt position's, equal the
    forward's log_softmax within 1e-5 (top ids equal up to a near tie)."""
    engine = _engine(tiny)
    batch = _requests(12, 0, logprobs=5)
    for i, (r, s) in enumerate(batch):
        engine.submit(r, dict(s, temperature=0.0 if i % 3 else 0.9, prompt_logprobs=i % 2 == 0))
    while not engine.idle:
        engine.step()
    results = [_compare(forward, r, 5) for r, _ in batch]
    assert sum(x["scored"] for x in results) > 200 and sum(x["ranks"] for x in results) > 0.9 * 5 * 200
    assert all((r.prompt_logprobs is None) == (i % 2 == 1) for i, (r, _) in enumerate(batch))


def test_speculative_logprobs_equal_the_forward(tiny, forward):
    """With n-gram speculation (k = 4) the verified tokens' log-probs come from the raw logits on the
    host: they equal the forward's too."""
    engine = _engine(tiny, speculate=4)
    prompt = [5, 6, 7, 8] * 6
    r = Request("s", prompt, max_new_tokens=24)
    engine.run([r], dict(logprobs=3))
    assert sum(engine.kept) > 0 and len(r.token_logprobs) >= r.generated == 24
    _compare(forward, r, 3)


def test_preempted_requests_keep_exact_logprobs(tiny, forward):
    """A pool too small for four sequences: preempted requests are recomputed (prompt and generated tokens
    as a new prompt), and still hold one record per generated token and per prompt position, equal to the
    forward's."""
    engine = Engine(tiny, max_slots=4, page_size=8, max_length=64, chunk=16, num_pages=13)
    reqs = [Request(i, list(range(i, i + 20)), max_new_tokens=30) for i in range(6)]
    engine.run(reqs, dict(logprobs=2, prompt_logprobs=True))
    assert sum(r.preemptions for r in reqs) > 0
    for r in reqs:
        _compare(forward, r, 2)


def test_echo_requests_compute_their_whole_prompt_and_max_tokens_0_scores_it(tiny, forward):
    """A prompt of three cached pages: a plain request finds them, an echo request computes every position
    (its log-probs need them) and with max_new_tokens 0 ends without a token."""
    engine = _engine(tiny)
    prefix = list(range(30, 54))  # three pages of 8
    engine.run([Request("first", prefix + [1], max_new_tokens=2)])
    hits = engine.pages.hits
    engine.run([Request("plain", prefix + [2], max_new_tokens=2)])
    assert engine.pages.hits == hits + 3
    echo = Request("echo", prefix + [3], max_new_tokens=0)
    engine.run([echo], dict(logprobs=1, prompt_logprobs=True))
    assert engine.pages.hits == hits + 3 and engine.pages.used == 0
    assert echo.finish_reason == "length" and echo.generated == 0 and echo.tokens == prefix + [3]
    assert _compare(forward, echo, 1)["scored"] == len(prefix)


@pytest.mark.parametrize(
    "penalties",
    [
        dict(presence_penalty=1.5, frequency_penalty=0.0, repetition_penalty=1.0),
        dict(presence_penalty=0.0, frequency_penalty=1.2, repetition_penalty=1.0),
        dict(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.8),
        dict(presence_penalty=-0.5, frequency_penalty=0.7, repetition_penalty=1.3),
    ],
    ids=["presence", "frequency", "repetition", "all"],
)
@pytest.mark.parametrize("speculate", [0, 4])
def test_penalties_equal_a_host_oracle(tiny, forward, penalties, speculate):
    """Greedy decoding with strong penalties (plain, and verified k = 4 at a time) gives the tokens of a
    host-side oracle that penalizes the forward's logits step by step, and not the unpenalized tokens.
    The guesses come from the model itself without penalties (its greedy loops), so a verification holds
    guesses that repeat one another: each position must count the guesses before it."""
    engine = _engine(tiny, speculate=speculate, draft=tiny if speculate else None)
    prompts = [[7, 7, 9, 12, 7, 30, 9], [100, 3, 100, 3, 100, 3], [5] * 12]
    reqs = [Request(i, p, max_new_tokens=24) for i, p in enumerate(prompts)]
    engine.run(reqs, penalties)
    changed = compared = 0
    for r, p in zip(reqs, prompts):
        want, gaps = penalized_greedy(forward, p, 24, **penalties)
        plain, _ = penalized_greedy(forward, p, 24)
        compared += agree_under_margin(want, gaps, r.tokens[len(p) :])
        changed += want != plain
    assert compared >= 0.9 * 24 * len(prompts) and changed == len(prompts)
    assert not speculate or sum(engine.kept) > 0


def test_penalties_off_leave_the_logits_bit_identical(tiny):
    """Penalties of 0 (repetition 1) stated explicitly, in a batch where another row has penalties on (so
    the penalty branch runs): those rows' tokens and logits equal an engine given no penalty fields, bit
    for bit."""
    reqs = _requests(6, 3)
    plain = _engine(tiny, record_logits=True)
    mixed = _engine(tiny, record_logits=True)
    alone = [Request(r.id, r.prompt, r.max_new_tokens) for r, _ in reqs]
    on = [Request("on", [1, 2, 3, 1, 2, 3], 20), Request("on", [1, 2, 3, 1, 2, 3], 20)]
    plain.run(alone + on[:1])
    off = dict(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)
    for r, _ in reqs:
        mixed.submit(r, off)
    mixed.submit(on[1], dict(repetition_penalty=2.0, frequency_penalty=1.0))
    while not mixed.idle:
        mixed.step()
    assert on[0].tokens != on[1].tokens  # the penalty branch ran in the mixed engine
    for a, (r, _) in zip(alone, reqs):
        assert a.tokens == r.tokens
        np.testing.assert_array_equal(np.stack(plain.logits[a.id]), np.stack(mixed.logits[r.id]))


def test_penalty_arithmetic_leaves_rows_that_are_off_bit_identical():
    """The penalty step on a batch where every row has a history (prompt and output tokens) but rows 0
    and 3 have every penalty off: their logits come back bit for bit, the others' change where their
    tokens were seen."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(4, 256)).astype(np.float32))
    history = rng.integers(0, 256, (4, 40)).astype(np.int32)
    x = StepExtras(
        presence=jnp.asarray([0.0, 1.0, 0.0, 0.0], jnp.float32),
        frequency=jnp.asarray([0.0, 0.5, 0.0, -0.0], jnp.float32),
        repetition=jnp.asarray([1.0, 1.0, 1.7, 1.0], jnp.float32),
        history=jnp.asarray(history),
        split=jnp.full(4, 20, jnp.int32),
        targets=jnp.full((4, 1), -1, jnp.int32),
        scored=jnp.zeros(4, bool),
    )
    ids, positions = jnp.zeros((4, 1), jnp.int32), jnp.full((4, 1), 40, jnp.int32)
    counts, seen = _counts(x, ids, positions, jnp.zeros(4, jnp.int32), 256)
    out = np.asarray(_penalize(logits, x, counts, seen))
    np.testing.assert_array_equal(out[[0, 3]], np.asarray(logits)[[0, 3]])
    assert np.asarray(seen)[0].sum() > 20 and np.asarray(counts)[1].sum() == 20
    for row in (1, 2):
        changed = out[row] != np.asarray(logits)[row]
        np.testing.assert_array_equal(changed, np.asarray(seen if row == 2 else counts > 0)[row])


@pytest.mark.parametrize(
    "bad",
    [dict(presence_penalty=2.5), dict(frequency_penalty=math.nan), dict(repetition_penalty=0.0), dict(logprobs=21)],
)
def test_engine_submit_refuses_settings_out_of_range(tiny, bad):
    with pytest.raises(ConfigError, match=next(iter(bad))):
        _engine(tiny).submit(Request("x", [1, 2], 2), bad)


# ----------------------------------------------------------------------------------------------- parser
@pytest.fixture(scope="module")
def parser():
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(60)} | {"[UNK]": 60}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Parser(model_name="m", vocab_size=61, max_length=32, tokenizer=tok, chat_template="{{ messages }}")


def _parse(parser, kind="completions", **fields):
    base = {"model": "m"} | ({"messages": [{"role": "user", "content": "w1"}]} if kind == "chat" else {"prompt": "w1"})
    return parser.parse(kind, json.dumps(base | fields).encode())


def test_parser_accepts_the_fields_clients_send(parser):
    job = _parse(parser, logprobs=None, presence_penalty=0, frequency_penalty=None, repetition_penalty=None, echo=None)
    assert job.logprobs is None and not job.echo
    assert {k: job.sampling[k] for k in ("presence_penalty", "frequency_penalty", "repetition_penalty")} == {
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
    }
    job = _parse(parser, logprobs=3, echo=True, max_tokens=0, presence_penalty=-2, repetition_penalty=1.5)
    assert (job.logprobs, job.echo, job.max_tokens) == (3, True, [0])
    assert job.sampling["prompt_logprobs"] and job.sampling["logprobs"] == 3
    assert not _parse(parser, logprobs=3).sampling["prompt_logprobs"]  # without echo: no prompt log-probs
    chat = _parse(parser, "chat", logprobs=True, top_logprobs=4)
    assert chat.logprobs == 4 and not chat.sampling["prompt_logprobs"]
    assert _parse(parser, "chat", logprobs=False, top_logprobs=0).logprobs is None


BAD = [  # (endpoint, raw fields, the field the error names, a word of the message)
    ("completions", '"logprobs": 21', "logprobs", "outside"),
    ("completions", '"logprobs": -1', "logprobs", "outside"),
    ("completions", '"logprobs": true', "logprobs", "integer"),
    ("completions", '"logprobs": 2.5', "logprobs", "integer"),
    ("completions", '"echo": "yes"', "echo", "true or false"),
    ("completions", '"max_tokens": 0', "max_tokens", "outside"),
    ("completions", '"presence_penalty": 2.5', "presence_penalty", "outside"),
    ("completions", '"presence_penalty": NaN', None, "not valid JSON"),  # NaN is not JSON
    ("completions", '"frequency_penalty": -1e400', "frequency_penalty", "finite"),
    ("completions", '"frequency_penalty": "1"', "frequency_penalty", "number"),
    ("completions", '"repetition_penalty": 0', "repetition_penalty", "outside"),
    ("completions", '"repetition_penalty": 1e400', "repetition_penalty", "finite"),
    ("completions", '"top_logprobs": 2', "top_logprobs", "unknown"),
    ("chat", '"logprobs": 3', "logprobs", "true or false"),
    ("chat", '"top_logprobs": 3', "top_logprobs", "logprobs"),
    ("chat", '"logprobs": true, "top_logprobs": 21', "top_logprobs", "outside"),
    ("chat", '"echo": true', "echo", "unknown"),
]


@pytest.mark.parametrize("kind,raw,param,word", BAD, ids=[f"{b[0]}-{b[1]}" for b in BAD])
def test_parser_refuses_bad_settings_naming_the_field(parser, kind, raw, param, word):
    head = '"messages": [{"role": "user", "content": "w1"}]' if kind == "chat" else '"prompt": "w1"'
    with pytest.raises(APIError) as info:
        parser.parse(kind, f'{{"model": "m", {head}, {raw}}}'.encode())
    assert info.value.param == param and word in info.value.message and info.value.status == 400


# ------------------------------------------------------------------------------------------- formatting
def _byte_level() -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _byte_fallback() -> Tokenizer:
    vocab = {"<unk>": 0} | {f"<0x{b:02X}>": b + 1 for b in range(256)}
    vocab |= {c: 257 + i for i, c in enumerate("▁abcdehlorw")}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tok


@pytest.mark.parametrize("make", [_byte_level, _byte_fallback], ids=["byte-level", "byte-fallback"])
def test_offsets_tokens_and_bytes_follow_the_text(make):
    """Multi-byte characters split over tokens: each token's text_offset points at the text it adds (the
    echoed prompt, then the completion), a token ending inside a character is written ``bytes:\\x..`` with
    its own bytes, the chat bytes of all tokens are the UTF-8 of the text, and the first echoed token has
    null log-probs."""
    tok = make()
    prompt, completion = tok.encode("hé wörld").ids, tok.encode("€ a, b").ids
    scores = [TokenScore(-0.5 - i, [t, 0], [-0.5 - i, -9.0]) for i, t in enumerate(prompt + completion)]
    job = Job(
        kind="completions",
        prompts=[prompt],
        max_tokens=4,
        sampling={},
        stop_text=[],
        stop_ids=frozenset(),
        stream=False,
        include_usage=False,
        n=1,
        user=None,
        echo=True,
        logprobs=1,
    )
    writer = ChoiceLogprobs(tok, job, prompt)
    prefix, out = writer.chunk(completion, scores[len(prompt) :], [None] + scores[1 : len(prompt)])
    text = prefix + tok.decode(completion)
    assert prefix == echo_text(tok, prompt) and len(out["tokens"]) == len(prompt + completion)
    assert out["token_logprobs"][0] is None and out["top_logprobs"][0] is None
    assert out["token_logprobs"][1:] == [s.logprob for s in scores[1:]]
    ends = out["text_offset"][1:] + [len(text)]
    for token, start, end, label in zip(prompt + completion, out["text_offset"], ends, out["tokens"]):
        if label.startswith("bytes:\\x"):  # one byte of a character: nothing, or the character it completes
            assert len(label) == 10 and (start == end or (end == start + 1 and ord(text[start]) > 127))
        else:  # the text it adds, or its name when it adds none (the prepended "▁")
            assert text[start:end] == label or (start == end and label == tok.id_to_token(token)), (start, label)
    assert any(label.startswith("bytes:") for label in out["tokens"])
    chat = ChoiceLogprobs(tok, dataclasses.replace(job, kind="chat", echo=False), prompt)
    _, content = chat.chunk(completion, scores[len(prompt) :], None)
    assert bytes(b for e in content["content"] for b in e["bytes"]) == tok.decode(completion).encode()
    assert all(len(e["top_logprobs"]) == 1 for e in content["content"])
