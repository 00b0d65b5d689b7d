"""``jaxpar generate``, run in-process on the 8 test devices, against ``Generator`` on the same weights.

One tiny model checkpoint and one word-level tokenizer (256 words, so every id the model can emit
decodes) serve every test. The command's greedy tokens must be the Python API's, whatever the output
form (JSON, streamed text, streamed ids), the batch, the stop ids or the mesh; its bad inputs must be
refused with status 2, naming the flag or field, before a weight is read and without a file changing.
Two programs, shared through the suite's compilation cache: batch 1 on one device, 2 on data=2 × tensor=4.
"""

import json
import shutil
import types

import numpy as np
import pytest
from flax import nnx

from jaxpar.cli import main

MAX_NEW = 6


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The checkpoint, a copy holding tokenizer.json, the tokenizer, a malformed one, a plain folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from jaxpar.convert.store import save_model
    from jaxpar.models import build_model, get_model_preset

    tmp = tmp_path_factory.mktemp("generate")
    save_model(build_model(get_model_preset("tiny"), rngs=nnx.Rngs(0)), tmp / "ckpt", source={"test": True})
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    words = [f"w{i}" for i in range(300)]  # word i appears 300 - i times: w0..w254 are kept
    trainer = trainers.WordLevelTrainer(vocab_size=256, special_tokens=["[UNK]"])
    tokenizer.train_from_iterator([" ".join(words[: i + 1]) for i in range(len(words))], trainer)
    assert tokenizer.get_vocab_size() == 256
    tokenizer.save(str(tmp / "tokenizer.json"))
    shutil.copytree(tmp / "ckpt", tmp / "ckpt_tok")
    shutil.copy(tmp / "tokenizer.json", tmp / "ckpt_tok" / "tokenizer.json")
    (tmp / "bad_tokenizer.json").write_text("{not json")
    (tmp / "plain").mkdir()
    (tmp / "plain" / "notes.txt").write_text("not a model")
    return types.SimpleNamespace(
        tmp=tmp,
        ckpt=tmp / "ckpt",
        ckpt_tok=tmp / "ckpt_tok",
        tokenizer=tokenizer,
        tokenizer_file=tmp / "tokenizer.json",
    )


@pytest.fixture(scope="module")
def api(assets):
    """``Generator`` on one device over the checkpoint's weights, loaded as the command loads them."""
    import jax

    from jaxpar.convert.store import load_model, model_config
    from jaxpar.inference.generate import Generator
    from jaxpar.inference.layouts import build_inference_mesh, weight_layout

    cfg, _, _ = model_config(assets.ckpt)
    name, mesh = build_inference_mesh("decode_dp", devices=jax.devices()[:1])
    model, _ = load_model(assets.ckpt, weight_layout(cfg, mesh, name))
    return Generator(model)


def generate(capsys, *argv):
    """(status, stdout, stderr) of ``jaxpar generate ARGV``."""
    status = main(["generate", *map(str, argv)])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def generate_json(capsys, *argv) -> dict:
    status, out, err = generate(capsys, *argv, "--json")
    assert status == 0, err
    return json.loads(out)


def greedy(api, prompts, n=MAX_NEW):
    return api.generate(prompts, max_new_tokens=n).tokens


def test_prompt_ids_json_matches_the_api(assets, api, capsys):
    report = generate_json(capsys, "--from", assets.ckpt, "--prompt-ids", "1,2,3", "--max-new-tokens", MAX_NEW)
    assert report["tokens"] == greedy(api, [[1, 2, 3]])
    assert report["finish_reasons"] == ["length"] and "text" not in report  # no tokenizer anywhere
    for key in (
        "prefill_s",
        "time_to_first_token_s",
        "decode_s",
        "decode_tokens_per_s",
        "compile_s",
        "inter_token_s_p50",
        "inter_token_s_p99",
    ):
        assert report[key] > 0, key
    assert report["inter_token_s_p50"] <= report["inter_token_s_p99"]
    assert report["mesh"] == {"layout": "decode_dp", "axes": {}, "devices": 1}


def test_prompt_text_json_decodes_its_tokens(assets, api, capsys):
    report = generate_json(
        capsys,
        "--from",
        assets.ckpt,
        "--tokenizer",
        assets.tokenizer_file,
        "--prompt",
        "w1 w2 w3",
        "--max-new-tokens",
        MAX_NEW,
    )
    assert report["tokens"] == greedy(api, [assets.tokenizer.encode("w1 w2 w3").ids])
    assert report["text"] == [assets.tokenizer.decode(report["tokens"][0])]
    assert len(report["text"][0].split()) == MAX_NEW  # every id is a word


def test_streamed_text_is_the_decoded_completion(assets, api, capsys):
    """tokenizer.json found in --from; stdout is the completion alone, the summary goes to stderr."""
    status, out, err = generate(capsys, "--from", assets.ckpt_tok, "--prompt", "w7 w8", "--max-new-tokens", MAX_NEW)
    assert status == 0, err
    assert out == assets.tokenizer.decode(greedy(api, [assets.tokenizer.encode("w7 w8").ids])[0]) + "\n"
    assert "time to first token" in err and "tokens/s" in err


def test_sampling_flags_reproduce_by_seed(assets, capsys):
    """Streamed as ids (one prompt, no tokenizer): one line of space-separated ids."""

    def sampled(seed):
        status, out, err = generate(
            capsys,
            "--from",
            assets.ckpt,
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            MAX_NEW,
            "--temperature",
            "0.8",
            "--top-k",
            "20",
            "--seed",
            seed,
        )
        assert status == 0 and out.endswith("\n") and out.count("\n") == 1, err
        return [int(t) for t in out.split()]

    first = sampled(3)
    assert len(first) == MAX_NEW and sampled(3) == first
    assert any(sampled(seed) != first for seed in (4, 5, 6))


def test_stream_holds_back_an_incomplete_character(capsys):
    """A byte-level decoder shows U+FFFD for half a UTF-8 character: it is never printed."""
    from jaxpar.inference.command import Stream

    class Bytes:
        def decode(self, ids):
            return bytes(ids).decode("utf-8", errors="replace")

    ids = list("aé€b".encode())
    stream = Stream([[1]], len(ids), [set()], Bytes())
    printed = []
    for step, token in enumerate(ids):
        stream(step, np.array([token]), np.array([False]))
        printed.append(capsys.readouterr().out)
    stream.close([ids])
    assert "".join(printed) + capsys.readouterr().out == "aé€b\n"
    assert printed[:4] == ["a", "", "é", ""] and "\ufffd" not in "".join(printed)


MESH = ["--mesh", "data=2,tensor=4", "--cpu-devices", 8]  # 8: the devices there are, so accepted
TWO = [[1, 2, 3, 4, 5], [9, 8]]  # of different lengths


def test_two_prompts_on_a_mesh_give_the_one_device_tokens(assets, api, capsys):
    """Streamed as one ``[i] ids`` line per prompt; each row is what it is alone on one device."""
    status, out, err = generate(
        capsys,
        "--from",
        assets.ckpt,
        "--prompt-ids",
        "1,2,3,4,5",
        "--prompt-ids",
        "9,8",
        "--max-new-tokens",
        MAX_NEW,
        *MESH,
    )
    assert status == 0, err
    rows = dict(line.split(" ", 1) for line in out.splitlines())
    assert rows == {f"[{i}]": " ".join(map(str, greedy(api, [p])[0])) for i, p in enumerate(TWO)}
    assert "data=2,tensor=4: data=2,tensor=4" in err


def test_stop_ids_end_a_row(assets, api, capsys):
    first = [greedy(api, [p])[0] for p in TWO]
    stop = first[0][2]
    report = generate_json(
        capsys,
        "--from",
        assets.ckpt,
        "--prompt-ids",
        "1,2,3,4,5",
        "--prompt-ids",
        "9,8",
        "--max-new-tokens",
        MAX_NEW,
        "--stop-ids",
        stop,
        *MESH,
    )
    for row, got, reason in zip(first, report["tokens"], report["finish_reasons"]):
        cut = row.index(stop) + 1 if stop in row else len(row)
        assert got == row[:cut] and reason == ("stop" if stop in row else "length")
    assert report["finish_reasons"][0] == "stop" and len(report["tokens"][0]) <= 3
    assert report["mesh"] == {"layout": "data=2,tensor=4", "axes": {"data": 2, "tensor": 4}, "devices": 8}


def test_hugging_face_folder_stops_at_its_eos(assets, api, tmp_path, capsys):
    """An exported folder: detected by config.json + safetensors; generation_config.json's EOS ends a row."""
    from jaxpar.convert import to_hf
    from jaxpar.inference.unstack import restack

    folder = to_hf(restack(api.model), tmp_path / "hf")  # the generator's model is unstacked: restack it
    row = greedy(api, [[1, 2, 3]])[0]
    eos = [row[1], 255]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    report = generate_json(capsys, "--from", folder, "--prompt-ids", "1,2,3", "--max-new-tokens", MAX_NEW)
    cut = next(i for i, t in enumerate(row) if t in eos) + 1
    assert report["tokens"] == [row[:cut]] and report["finish_reasons"] == ["eos"]
    assert report["from"]["kind"] == "Hugging Face folder"


def _listing(root):
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*"))


PROMPT = ["--prompt-ids", "1,2,3"]
BAD = {
    "too long": (
        ["--prompt-ids", ",".join(["1"] * 1000), "--max-new-tokens", "25"],
        ["1000 tokens", "--max-new-tokens", "25", "max_seq_len=1024"],
    ),
    "empty prompt": (["--prompt-ids", ""], ["--prompt-ids", "empty"]),
    "id beyond vocab": (["--prompt-ids", "1,256"], ["--prompt-ids", "token id 256", "vocab_size=256"]),
    "not an id": (["--prompt-ids", "1,x"], ["--prompt-ids", "'x'"]),
    "top-p 0": (PROMPT + ["--top-p", "0"], ["top_p (--top-p) = 0.0", "(0, 1]"]),
    "top-p 1.5": (PROMPT + ["--top-p", "1.5"], ["top_p (--top-p) = 1.5", "(0, 1]"]),
    "temperature -1": (PROMPT + ["--temperature", "-1"], ["temperature (--temperature) = -1.0", ">= 0"]),
    "stop id beyond vocab": (PROMPT + ["--stop-ids", "300"], ["--stop-ids", "300", "vocab_size=256"]),
    "missing tokenizer": (
        ["--prompt", "w1", "--tokenizer", "{tmp}/nope.json"],
        ["--tokenizer", "nope.json", "no such file"],
    ),
    "malformed tokenizer": (
        ["--prompt", "w1", "--tokenizer", "{tmp}/bad_tokenizer.json"],
        ["--tokenizer", "bad_tokenizer.json", "not a tokenizers file"],
    ),
    "text without tokenizer": (["--prompt", "w1"], ["--prompt needs a tokenizer", "--tokenizer", "--prompt-ids"]),
    "mesh vs batch": (
        ["--prompt-ids", "1", "--prompt-ids", "2", "--prompt-ids", "3", "--mesh", "data=8"],
        ["--mesh data=8", "batch (prompts)=3", "data=8 = 8"],
    ),
    "unknown layout": (PROMPT + ["--mesh", "decode_tq"], ["--mesh", "'decode_tq'", "did you mean 'decode_tp'"]),
    "not a checkpoint": (PROMPT + ["--from", "{tmp}/plain"], ["--from", "plain", "Hugging Face folder"]),
    "no such folder": (PROMPT + ["--from", "{tmp}/nowhere"], ["--from", "nowhere", "no such directory"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_exits_2_before_reading_weights(assets, case, capsys, monkeypatch):
    import jaxpar.convert.store

    def refuse(*_):
        raise AssertionError("weights were read")

    monkeypatch.setattr(jaxpar.convert.store, "load_model", refuse)
    argv, words = BAD[case]
    argv = [a.format(tmp=assets.tmp) for a in argv]
    before = _listing(assets.tmp)
    status, out, err = generate(capsys, "--from", assets.ckpt, "--max-new-tokens", MAX_NEW, *argv)
    assert status == 2 and out == "" and err.startswith("jaxpar: error: ") and "Traceback" not in err
    for word in words:
        assert word in err, (word, err)
    assert _listing(assets.tmp) == before


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--prompt-ids", "1", "--max-new-tokens", "0"], "--max-new-tokens: '0' is not a positive integer"),
        (["--prompt-ids", "1", "--prompt", "w1", "--max-new-tokens", "2"], "not allowed with argument"),
        (["--max-new-tokens", "2"], "one of the arguments --prompt --prompt-ids is required"),
    ],
)
def test_usage_errors_are_argparse_exit_2(assets, capsys, argv, words):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--from", str(assets.ckpt), *argv])
    assert exc.value.code == 2 and words in capsys.readouterr().err


SERVE_BAD = {  # jaxpar serve: refused with status 2, naming the flag, before a weight is read
    "no tokenizer": (["--from", "{ckpt}"], ["--tokenizer", "none given", "tokenizer.json"]),
    "replicas vs devices": (["--replicas", "3"], ["--replicas 3", "8 devices"]),
    "unknown layout": (["--mesh", "decode_tq"], ["--mesh", "'decode_tq'", "did you mean 'decode_tp'"]),
    "mesh vs kv heads": (["--mesh", "tensor=8"], ["--mesh", "model.num_kv_heads=2"]),
    "max length": (["--max-length", "1000000"], ["--max-length 1000000", "model.max_seq_len"]),
    "negative speculate": (["--speculate", "-1"], ["--speculate -1"]),
    "draft without speculate": (["--draft", "{ckpt}"], ["--speculate 0", "--draft"]),
    "port": (["--port", "70000"], ["--port 70000"]),
    "adapter without a name": (["--adapter", "{ckpt}"], ["--adapter", "NAME=DIR"]),
    "adapter not PEFT": (["--adapter", "terse={ckpt}"], ["--adapter 'terse=", "adapter_config.json"]),
    "adapter named as the base": (["--model-name", "m", "--adapter", "m={ckpt}"], ["'m' is already served"]),
}


@pytest.mark.parametrize("case", list(SERVE_BAD))
def test_serve_bad_input_exits_2_before_reading_weights(assets, case, capsys, monkeypatch):
    import jaxpar.convert.store

    monkeypatch.setattr(jaxpar.convert.store, "load_model", lambda *_: (_ for _ in ()).throw(AssertionError("read")))
    argv, words = SERVE_BAD[case]
    argv = ["--from", str(assets.ckpt_tok), "--port", "0"] + [a.format(ckpt=assets.ckpt) for a in argv]
    status = main(["serve", *argv])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("jaxpar: error: ") and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)


def test_serve_sizes_are_checked_by_argparse(assets, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--from", str(assets.ckpt_tok), "--memory-budget", "lots"])
    assert exc.value.code == 2 and "'lots' is not a size like 2GiB" in capsys.readouterr().err


def test_set_changes_how_the_model_runs(assets, api, capsys):
    """``--set execution.…`` (the grammar of every command) reaches the model the Generator runs: the
    checkpoint's weights, run in bfloat16 here; the f32 default run is the API's."""
    import jax

    from jaxpar.execution import DType
    from jaxpar.inference.command import load_weights
    from jaxpar.inference.generate import Generator
    from jaxpar.inference.layouts import build_inference_mesh

    cfg = api.cfg
    name, mesh = build_inference_mesh("decode_dp", devices=jax.devices()[:1])
    model = load_weights("jaxpar", str(assets.ckpt), cfg, mesh, name, ["execution.dtype=bfloat16"])
    assert model.execution.dtype == DType.BFLOAT16 and api.model.execution.dtype == DType.FLOAT32
    assert Generator(model).model.execution.dtype == DType.BFLOAT16
    report = generate_json(
        capsys,
        "--from",
        assets.ckpt,
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        2,
        "--set",
        "execution.dtype=bfloat16",
    )
    assert len(report["tokens"][0]) == 2


def test_splash_prefill_gives_the_same_tokens(assets, api, capsys):
    """``--set execution.attention_impl=splash``: the prefill's attention runs the Pallas kernel
    (interpreted on CPU); the greedy tokens are the forward's, under the margin rule."""
    import jax
    from logprob_oracle import Forward, agree_under_margin, penalized_greedy

    from jaxpar.inference.command import load_weights
    from jaxpar.inference.layouts import build_inference_mesh

    name, mesh = build_inference_mesh("decode_dp", devices=jax.devices()[:1])
    model = load_weights("jaxpar", str(assets.ckpt), api.cfg, mesh, name)
    argv = ["--from", assets.ckpt, "--prompt-ids", "1,2,3,4,5", "--max-new-tokens", 4]
    report = generate_json(capsys, *argv, "--set", "execution.attention_impl=splash")
    want, gaps = penalized_greedy(Forward(model, 16), [1, 2, 3, 4, 5], 4)  # the training forward's greedy
    assert agree_under_margin(want, gaps, report["tokens"][0]) >= 1
