"""Serving several LoRA adapters over one base model (``jaxpar.inference.adapters``).

Two PEFT adapters of different rank, alpha and targets beside the base model in one engine. The oracle
for each adapter is the model that wrote it, served alone by a plain engine (no bank, its own alpha / rank
applied at run time): it shares none of the bank's code (the gather per row, the folded scale, the
padded rank); a base row's oracle is the base model in a plain engine. The bound is ``noise.MULTIPLE``
times the oracles' own float noise, their logits merged against unmerged (the same function two valid
ways), and a row given the wrong adapter must miss it by ``noise.MUTATION_GAP``.
"""

import concurrent.futures
import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from noise import FLOOR, MULTIPLE, MUTATION_GAP, array_ratios, check_arrays, record
from serve_inprocess import call, serving

from jaxpar.convert import save_adapter
from jaxpar.errors import ConfigError
from jaxpar.inference.adapters import read_peft, with_bank
from jaxpar.inference.engine import Engine
from jaxpar.inference.limits import Limits
from jaxpar.inference.scheduler import Request
from jaxpar.layers.lora import LoraConfig, LoraParam, merged_state
from jaxpar.models import build_model, get_model_preset

ADAPTERS = {  # different ranks, alphas and targets: the bank pads, folds and takes the union
    "terse": LoraConfig(rank=4, alpha=8.0, targets="q,v"),
    "verbose": LoraConfig(rank=8, alpha=32.0, targets="q,k,v,o,gate_up,down"),
}


def _with_adapter(base, lora: LoraConfig, seed: int):
    """``base``'s weights with a trained-looking adapter: B drawn at random (a fresh one is zero)."""
    model = build_model(dataclasses.replace(base.cfg, lora=lora), rngs=nnx.Rngs(seed))
    nnx.update(model, nnx.state(base))
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(model, LoraParam)):
        if str(path[-1]).endswith("_lora_b"):
            var.set_value(jax.numpy.asarray(rng.normal(0, 0.05, var.get_value().shape), var.get_value().dtype))
    return model


def _engine(model, **kw):
    return Engine(model, max_slots=6, page_size=8, max_length=64, chunk=16, record_logits=True, **kw)


def _alone(model, prompt, max_new=8, **kw):
    """The logits rows of ``prompt`` served alone by a fresh engine of ``model``."""
    engine = _engine(model, **kw)
    r = Request("alone", prompt, max_new)
    engine.run([r])
    return np.stack(engine.logits["alone"])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base model, the model that wrote each adapter, the adapters read back, the oracle's noise)."""
    tmp = tmp_path_factory.mktemp("adapters")
    base = build_model(get_model_preset("tiny"), rngs=nnx.Rngs(0))
    owners, adapters, noise = {}, [], 0.0
    for seed, (name, lora) in enumerate(ADAPTERS.items(), start=1):
        owners[name] = _with_adapter(base, lora, seed)
        save_adapter(owners[name], tmp / name)
        adapters.append(read_peft(name, tmp / name, base))
        merged = nnx.merge(nnx.graphdef(base), merged_state(owners[name]))
        prompt = list(range(5, 30))
        got, want = _alone(merged, prompt), _alone(owners[name], prompt)
        noise = max(noise, array_ratios([got], [want], ("logits",))["logits"])
    return base, owners, adapters, noise


def _requests(engine, seed=0, n=12):
    rng = np.random.default_rng(seed)
    slots = [0, *engine.adapters.values()]
    return [
        Request(
            i,
            [int(t) for t in rng.integers(0, 256, rng.integers(4, 30))],
            int(rng.integers(2, 10)),
            adapter=slots[i % 3],
        )
        for i in range(n)
    ]


def _logits(engine, r):
    return np.stack(engine.logits[r.id])


def _check(got, want, noise: float, case: str) -> float:
    return check_arrays([got], [want], noise, "lora", case, names=("logits",))


def test_a_mixed_batch_equals_each_request_alone_and_each_adapter_its_own_model(served):
    """Base and adapter rows decode in one batch. Each request's tokens and logits equal those it gets
    alone in the same engine (the same program: bit for bit), and its logits lie within the noise bound
    of the oracle's (the model that wrote its adapter, or the base model)."""
    base, owners, adapters, noise = served
    engine = _engine(base, adapters=adapters)
    reqs = _requests(engine)
    engine.run(reqs)
    assert max(s.decoded for s in engine.log) >= 3  # rows of different adapters decoded together
    names = {0: None, **{slot: name for name, slot in engine.adapters.items()}}
    oracles = {None: _engine(base), **{n: _engine(m) for n, m in owners.items()}}
    for r in reqs:
        alone = Request(r.id, r.prompt, r.max_new_tokens, adapter=r.adapter)
        same = _engine(base, adapters=adapters)
        same.run([alone])
        assert alone.tokens == r.tokens
        np.testing.assert_array_equal(_logits(same, alone), _logits(engine, r))
        ref = Request(r.id, r.prompt, r.max_new_tokens)
        oracles[names[r.adapter]].run([ref])
        _check(_logits(engine, r), _logits(oracles[names[r.adapter]], ref), noise, f"served {names[r.adapter]} #{r.id}")


def test_the_wrong_adapter_on_a_row_is_caught(served):
    """The mutation: the bank with its slots swapped, so a row asking for "terse" gets "verbose"."""
    base, owners, adapters, noise = served
    prompt = list(range(3, 20))
    swapped = _engine(base, adapters=adapters[::-1])
    wrong = Request("alone", prompt, 8, adapter=swapped.adapters["verbose"])  # "terse"'s slot
    swapped.run([wrong])
    got, want = _logits(swapped, wrong), _alone(owners["terse"], prompt)
    tol = max(MULTIPLE * noise, FLOOR["grad"])
    factor = array_ratios([got], [want], ("logits",))["logits"] / tol
    record("lora", "mutation: adapter slots swapped", noise=dict(array=noise), tolerance=dict(array=tol), factor=factor)
    assert factor >= MUTATION_GAP, factor


def test_pages_are_shared_within_an_adapter_only(served):
    base, _, adapters, _ = served
    engine = _engine(base, adapters=adapters)
    prompt = list(range(1, 30))  # three full pages a later request could share
    engine.run([Request("base", prompt, 2)])
    engine.run([Request("terse", prompt, 2, adapter=1)])
    assert engine.pages.hits == 0
    engine.run([Request("terse-again", prompt, 2, adapter=1)])
    assert engine.pages.hits == 3
    fresh = _engine(base, adapters=adapters)
    fresh.run([Request("terse", prompt, 2, adapter=1)])
    np.testing.assert_array_equal(np.stack(fresh.logits["terse"]), np.stack(engine.logits["terse"]))


def test_a_bad_adapter_slot_or_bank_is_refused(served):
    base, _, adapters, _ = served
    engine = _engine(base, adapters=adapters)
    with pytest.raises(ConfigError, match="adapter=3"):
        engine.submit(Request(0, [1, 2], 2, adapter=3))
    with pytest.raises(ConfigError, match="each with a name of its own"):
        with_bank(base, [adapters[0], adapters[0]])
    with pytest.raises(ConfigError, match="model.lora.bank"):
        LoraConfig(bank=2)


def test_the_server_serves_each_request_with_the_adapter_its_model_names(served):
    """Over HTTP: /v1/models lists the adapters under the base; 24 concurrent greedy requests spread over
    the base and both adapters get what each gets alone, the response names the model asked for, an
    adapter changes the text, and an unknown model is refused naming what is served."""
    base, _, adapters, _ = served
    models = ["tiny", "terse", "verbose"]
    bodies = [
        {
            "model": m,
            "prompt": " ".join(f"w{(7 * i + j) % 250}" for j in range(5 + i)),
            "max_tokens": 6,
            "temperature": 0,
        }
        for i in range(8)
        for m in models
    ]
    with serving(Limits(), model=base, adapters=adapters) as (_, port):
        status, listed, _ = call(port, "GET", "/v1/models")
        assert status == 200 and [m["id"] for m in listed["data"]] == models
        assert [m.get("parent") for m in listed["data"]] == [None, "tiny", "tiny"]
        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            together = list(pool.map(lambda b: call(port, "POST", "/v1/completions", b), bodies))
        alone = [call(port, "POST", "/v1/completions", b) for b in bodies]
        status, refused, _ = call(port, "POST", "/v1/completions", {**bodies[0], "model": "tiny-sql"})
    assert all(s == 200 for s, _, _ in together + alone)
    texts = [r["choices"][0]["text"] for _, r, _ in together]
    assert texts == [r["choices"][0]["text"] for _, r, _ in alone]
    assert [r["model"] for _, r, _ in together] == [b["model"] for b in bodies]
    by_model = {m: texts[i :: len(models)] for i, m in enumerate(models)}
    assert by_model["terse"] != by_model["tiny"] and by_model["verbose"] != by_model["tiny"]
    assert status == 400 and refused["error"]["code"] == "model_not_found" and '"terse"' in refused["error"]["message"]


def test_jaxpar_serve_builds_the_engines_with_the_adapters_named(served, tmp_path):
    """The command line's --adapter NAME=DIR reaches the parser (the names a request may send) and every
    replica's engine (the same slots)."""
    from serve_inprocess import word_tokenizer

    from jaxpar.cli import build_parser
    from jaxpar.convert.store import save_model
    from jaxpar.inference import serve_command

    base, owners, _, _ = served
    save_model(base, tmp_path / "tiny", source={"test": True})
    word_tokenizer().save(str(tmp_path / "tiny" / "tokenizer.json"))
    save_adapter(owners["terse"], tmp_path / "terse")
    argv = ["serve", "--from", str(tmp_path / "tiny"), "--adapter", f"terse={tmp_path / 'terse'}", "--port", "0"]
    args = build_parser().parse_args(argv + ["--cpu-devices", "1", "--replicas", "1", "--max-length", "64"])
    cfg, eos, _ = serve_command.model_config("jaxpar", args.source)
    tokenizer_file = str(tmp_path / "tiny" / "tokenizer.json")
    service = serve_command.build_service(args, cfg, eos, "jaxpar", word_tokenizer(), tokenizer_file)
    assert service.parser.models == ("tiny", "terse") and service.slots == {"tiny": 0, "terse": 1}
    assert [w.engine.adapters for w in service.workers] == [{"terse": 1}]


def test_mla_adapters_are_served_from_a_bank(tmp_path):
    """DeepSeek's MLA adapters through PEFT and the bank: the absorbed decode gathers kv_b's factors per
    row. Each row's logits lie within the noise bound of the model that wrote its adapter."""
    base = build_model(get_model_preset("tiny-deepseek"), rngs=nnx.Rngs(0))
    owner = _with_adapter(base, LoraConfig(rank=4, alpha=8.0, targets="q_a,q_b,kv_a,kv_b,o"), 1)
    save_adapter(owner, tmp_path / "mla")
    merged = nnx.merge(nnx.graphdef(base), merged_state(owner))
    prompt = list(range(5, 30))
    noise = array_ratios([_alone(merged, prompt)], [_alone(owner, prompt)], ("logits",))["logits"]
    engine = _engine(base, adapters=[read_peft("mla", tmp_path / "mla", base)])
    reqs = [Request(i, prompt[i:], 6, adapter=i % 2) for i in range(4)]
    engine.run(reqs)
    for r in reqs:
        want = _alone(owner if r.adapter else base, r.prompt, 6)
        _check(_logits(engine, r), want, max(noise, 2.0**-23), f"served mla #{r.id}")
