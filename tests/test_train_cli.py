"""``jaxpar train`` from the command line: the embedded default learns its source, every output file is
written, and bad input stops the run with a message naming the field or file before anything is written."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxpar.cli import main
from jaxpar.data import markov_chain

STEPS, MARGIN = 150, 0.2  # the tiny model gets within MARGIN nats of the entropy rate in STEPS steps


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "run"
    argv = [
        "train",
        "--model",
        "tiny",
        "--mesh",
        "dp",
        "--steps",
        str(STEPS),
        "--batch",
        "16",
        "--seq",
        "64",
        "--out",
        str(out),
        "--profile-steps",
        "3:4",
        "--set",
        "optimizer.learning_rate=1e-2",
        "--set",
        "optimizer.warmup_steps=10",
        "--set",
        "log.eval_every=50",
        "--set",
        "log.eval_batches=8",
        "--set",
        "log.progress=false",
        "--set",
        "checkpoint.every=100",
    ]
    assert main(argv) == 0
    return out


def test_tiny_model_learns_the_markov_source(run):
    h = markov_chain(256, branching=8, seed=0).entropy_rate
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[0]["loss"] == pytest.approx(math.log(256), abs=0.05)  # starts at ln V
    evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    assert list(evals) == [50, 100, 150]
    assert evals[50] > evals[100] > evals[150]
    assert h < evals[150] < h + MARGIN, f"eval loss {evals[150]:.4f} vs entropy rate {h:.4f}"
    for r in records:
        assert r["tokens_per_s"] > 0 and r["tflops_per_device"] > 0 and "mfu" not in r  # CPU: peak unknown
        assert math.isfinite(r["grad_norm"]) and r["lr"] >= 0


def test_run_directory_holds_config_checkpoints_events_and_trace(run):
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["embed_dim"] == 64 and config["optimizer"]["learning_rate"] == 1e-2
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir()) == [100, 150]
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert list((run / "profile").rglob("*.xplane.pb"))


def _digest(directory: Path):
    return {p: p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--set", "optimizer.learnig_rate=1"], "did you mean optimizer.learning_rate"),
        (["--seq", "2048"], "seq=2048 is longer than model.max_seq_len=1024"),
        (["--batch", "12"], "batch"),
        (["--set", "data.source=files", "--set", "data.path=/nonexistent/tokens.bin"], "/nonexistent/tokens.bin"),
        (["--set", "model.embed_dim=32"], "model.embed_dim: saved 64, now 32"),
        (["--mesh", "3dd"], "did you mean '3d'"),
    ],
)
def test_bad_input_is_refused_before_any_write(run, capsys, extra, message):
    before = _digest(run)
    argv = [
        "train",
        "--model",
        "tiny",
        "--mesh",
        "dp",
        "--steps",
        str(STEPS),
        "--batch",
        "16",
        "--seq",
        "64",
        "--out",
        str(run),
        "--set",
        "log.progress=false",
        *extra,
    ]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert _digest(run) == before


def test_token_ids_beyond_the_vocab_are_refused(tmp_path, capsys):
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.array([1, 2, 3, 300, 4] * 100, np.uint16))
    out = tmp_path / "run"
    argv = [
        "train",
        "--mesh",
        "dp",
        "--steps",
        "2",
        "--batch",
        "8",
        "--seq",
        "16",
        "--out",
        str(out),
        "--set",
        "data.source=files",
        "--set",
        f"data.path={tokens}",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert str(tokens) in err and "300" in err and "model.vocab_size" in err
    assert not out.exists()


def test_help_lists_the_fields_and_module_entry_point_works():
    result = subprocess.run(
        [sys.executable, "-m", "jaxpar.train", "--help"], capture_output=True, text=True, check=True
    )
    for field in ("optimizer.learning_rate", "data.path", "checkpoint.every", "model.embed_dim", "z_loss"):
        assert field in result.stdout


def test_prepare_then_train_on_token_files(tmp_path, capsys):
    """Text -> ``jaxpar prepare --bytes`` -> ``jaxpar train`` on the token file, with held-out documents."""
    docs = []
    for i in range(6):
        doc = tmp_path / f"doc{i}.txt"
        doc.write_text("".join(f"line {j} of document {i}: the quick brown fox.\n" for j in range(60)))
        docs.append(str(doc))
    tokens = tmp_path / "tokens.bin"
    assert main(["prepare", *docs, "--out", str(tokens), "--bytes", "--eval-fraction", "0.34"]) == 0
    eval_tokens = tmp_path / "tokens.eval.bin"
    assert tokens.is_file() and eval_tokens.is_file()
    out = tmp_path / "run"
    argv = [
        "train",
        "--mesh",
        "dp",
        "--steps",
        "20",
        "--batch",
        "8",
        "--seq",
        "32",
        "--out",
        str(out),
        "--set",
        "data.source=files",
        "--set",
        f"data.path={tokens}",
        "--set",
        f"data.eval_path={eval_tokens}",
        "--set",
        "model.vocab_size=257",
        "--set",
        "optimizer.learning_rate=1e-2",
        "--set",
        "log.eval_every=10",
        "--set",
        "log.progress=false",
        "--set",
        "log.tensorboard=false",
    ]
    capsys.readouterr()
    assert main(argv) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] < records[0]["loss"] - 1.0 and "eval_loss" in records[-1]
    assert "files: 1 file(s)" in capsys.readouterr().out
