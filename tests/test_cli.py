"""The ``jaxpar`` command, run in-process on the 8 test devices (so no --devices, or --devices 8)."""
import json

import pytest

from jaxpar.cli import main


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


def test_shardings_axis_spec(capsys):
    assert main(["shardings", "--model", "tiny", "--mesh", "data=2,fsdp=-1,tensor=2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mesh"]["fsdp"] == 2


@pytest.mark.parametrize("argv,words", [
    (["--model", "llama3-8", "--mesh", "tp"], ["'llama3-8'", "did you mean 'llama3-8b'"]),
    (["--model", "tiny", "--mesh", "tpp"], ["'tpp'", "did you mean 'tp'"]),
    (["--model", "tiny", "--mesh", "tp", "--seq", "3"], ["seq=3", "tensor=8"]),
    (["--model", "tiny", "--mesh", "tensor=4", "--devices", "8"], ["tensor=4", "8 devices"]),
])
def test_errors_exit_2_without_traceback(capsys, argv, words):
    assert main(["shardings", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("jaxpar: error: ") and "Traceback" not in captured.err
    for word in words:
        assert word in captured.err
    assert captured.out == ""


def test_usage_errors_are_argparse_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["shardings", "--model", "tiny", "--mesh", "tp", "--devices", "0"])
    assert exc.value.code == 2 and "positive integer" in capsys.readouterr().err
