"""The ``jaxpar`` command, run in-process on the 8 test devices (so no --devices, or --devices 8)."""

import json

import pytest

from jaxpar.cli import main
from jaxpar.rules import ACTIVATION_AXES, LOGICAL_AXES, PARAM_AXES


def test_shardings_table(capsys):
    assert main(["shardings", "--model", "tiny", "--mesh", "3d"]) == 0
    out = capsys.readouterr().out
    assert "blocks/attn/q" in out and "P(None, 'fsdp', 'tensor', None)" in out and "2×32×4×8" in out
    assert "data=2,fsdp=2,tensor=2 (8 devices)" in out
    assert "MiB) with AdamW moments" in out


def test_shardings_json(capsys):
    assert main(["shardings", "--model", "tiny", "--mesh", "fsdp", "--devices", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mesh"]["fsdp"] == 8 and report["rules"] == "fsdp"
    q = next(p for p in report["params"] if p["path"] == "blocks/attn/q")
    assert q["spec"] == [None, "fsdp", None, None] and q["shard_shape"] == [2, 8, 8, 8]
    totals = report["totals"]
    assert totals["per_device_adamw_bytes"] == 3 * totals["per_device_bytes"]


def test_shardings_set_changes_the_model(capsys):
    """``--set model.…`` (train's paths) changes the model whose shardings are reported."""
    assert main(["shardings", "--model", "tiny", "--mesh", "fsdp", "--json", "--set", "model.embed_dim=128"]) == 0
    q = next(p for p in json.loads(capsys.readouterr().out)["params"] if p["path"] == "blocks/attn/q")
    assert q["shape"][1] == 128 and q["shard_shape"][1] == 16


def test_shardings_axis_spec(capsys):
    assert main(["shardings", "--model", "tiny", "--mesh", "data=2,fsdp=-1,tensor=2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mesh"]["fsdp"] == 2


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--model", "llama3-8", "--mesh", "tp"], ["'llama3-8'", "did you mean 'llama3-8b'"]),
        (["--model", "tiny", "--mesh", "tpp"], ["'tpp'", "did you mean 'tp'"]),
        (["--model", "tiny", "--mesh", "tp", "--seq", "3"], ["seq=3", "tensor=8"]),
        (["--model", "tiny", "--mesh", "tensor=4", "--devices", "8"], ["tensor=4", "8 devices"]),
        (["--rules", "tpp"], ["--rules: unknown mesh preset 'tpp'", "did you mean 'tp'"]),
        (["--rules", "data=two"], ["'data=two'", "size 'two', not an integer"]),
        (["--rules", "tensor=3", "--devices", "8"], ["tensor=3", "multiply to 3 but there are 8 devices"]),
        (["--rules", "tp", "--model", "tiny", "--seq", "3"], ["seq=3", "tensor=8"]),
    ],
)
def test_errors_exit_2_without_traceback(capsys, argv, words):
    assert main(["shardings", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("jaxpar: error: ") and "Traceback" not in captured.err
    for word in words:
        assert word in captured.err
    assert captured.out == ""


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--model", "tiny", "--mesh", "tp", "--devices", "0"], "positive integer"),
        (["--mesh", "tp"], "--model is required with --mesh"),
        (["--model", "tiny"], "one of the arguments --mesh --rules is required"),
        (["--mesh", "tp", "--rules", "tp"], "not allowed with argument"),
        (["--rules", "tp", "--seq", "8"], "--batch and --seq need --model"),
    ],
)
def test_usage_errors_are_argparse_exit_2(capsys, argv, words):
    with pytest.raises(SystemExit) as exc:
        main(["shardings", *argv])
    assert exc.value.code == 2 and words in capsys.readouterr().err


def _rule_lines(out: str) -> list[str]:
    return [line.strip() for line in out.splitlines() if " -> " in line and line.startswith("  ")]


def test_rules_table(capsys):
    """No model: the preset's table as written in meshes/ (fsdp_tp: embed/batch over fsdp, Megatron over
    tensor), parameters, activations and the KV cache, one line per logical axis; the -1 axis filled from
    --devices."""
    assert main(["shardings", "--rules", "fsdp_tp", "--devices", "64"]) == 0
    out = capsys.readouterr().out
    assert "mesh fsdp=-1,tensor=2 on 64 devices: fsdp=32, tensor=2" in out
    params, acts = len(PARAM_AXES), len(ACTIVATION_AXES)
    assert out.index(f"parameters ({params} logical axes)") < out.index(f"activations ({acts} logical axes)")
    lines = [" ".join(line.split()) for line in _rule_lines(out)]
    assert lines[:3] == ["vocab -> tensor", "embed -> fsdp", "heads -> tensor"] and len(lines) == len(LOGICAL_AXES)
    assert lines[params : params + 2] == ["batch -> fsdp", "length -> tensor"]
    assert "experts -> replicated" in lines and "*" not in out


def test_rules_table_many_axes(capsys):
    assert main(["shardings", "--rules", "data=2,expert=2,fsdp=2"]) == 0
    lines = [" ".join(line.split()) for line in _rule_lines(capsys.readouterr().out)]
    assert "batch -> (expert, data, fsdp)" in lines and "experts -> expert" in lines
    assert "act_experts -> expert" in lines


def test_rules_checked_against_model(capsys):
    """tiny has 2 kv heads, fewer than tensor=8: the check replicates exactly kv_heads and act_kv_heads."""
    assert main(["shardings", "--rules", "tp", "--model", "tiny"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("rules 'tp' checked against model tiny (batch 1, seq 8)\n")
    changed = [" ".join(line.split()) for line in _rule_lines(out) if "*" in line]
    assert changed == ["kv_heads -> replicated * was tensor", "act_kv_heads -> replicated * was tensor"]
    assert "lines the check against tiny changed: 2" in out
    assert "kv_heads: tensor -> replicated: model.num_kv_heads=2 is fewer than tensor=8" in out


def test_rules_checked_json(capsys):
    assert main(["shardings", "--rules", "tp", "--model", "tiny", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rules"] == "tp" and report["devices"] == 8 and report["mesh_shape"]["tensor"] == 8
    assert report["params"]["kv_heads"] == [] and report["params"]["heads"] == ["tensor"]
    assert report["activations"]["length"] == ["tensor"]
    assert [(c["axis"], c["before"], c["after"]) for c in report["model"]["changes"]] == [
        ("kv_heads", ["tensor"], []),
        ("act_kv_heads", ["tensor"], []),
    ]


def test_rules_checked_unchanged(capsys):
    """tiny-moe's 2 kv heads divide tensor=2: nothing to change."""
    assert main(["shardings", "--rules", "fsdp=2,expert=2,tensor=2", "--model", "tiny-moe", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["changes"] == [] and report["params"]["kv_heads"] == ["tensor"]
    assert report["params"]["experts"] == ["expert"] and report["activations"]["batch"] == ["expert", "fsdp"]


@pytest.mark.parametrize(
    "error, code",
    [("ConfigError", 2), ("CheckpointError", 2), ("LaunchError", 2), ("NoLayoutError", 2), ("NonFiniteError", 1)],
)
def test_library_errors_exit_with_their_status(capsys, monkeypatch, error, code):
    """Bad input exits 2; a run that failed on the way (a NaN loss) exits 1. Both print the message."""
    import jaxpar.errors
    import jaxpar.train.command

    def fail(args):
        raise getattr(jaxpar.errors, error)("the message")

    monkeypatch.setattr(jaxpar.train.command, "run", fail)
    assert main(["train", "--out", "unused"]) == code
    assert capsys.readouterr().err == "jaxpar: error: the message\n"
