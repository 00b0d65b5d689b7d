"""``jaxpar train`` with ``objective=dpo``: preference records prepared into pairs, a reference computed
from the initial weights in one pass before the first step (or the adapters switched off), the held-out
preference loss falling below log 2 on a toy task, a run resumed after an interruption giving the same
losses bit for bit (it reads the reference its start wrote), and bad settings refused by name before
any work."""

import json
import math

import numpy as np
import pytest
from test_dpo import preference_records, prepared

from jaxpar.cli import main
from jaxpar.errors import JaxparError
from jaxpar.train.config import apply_overrides, default_config
from jaxpar.train.loop import train

FLAGS = ["model.vocab_size=257", "log.progress=false", "log.tensorboard=false", "objective=dpo", "data.pack=pairs"]
LEARN = ["optimizer.learning_rate=3e-3", "optimizer.warmup_steps=0", "optimizer.schedule=constant", "dpo.beta=0.5"]


def _config(path, *extra, steps=40):
    cfg = default_config("tiny")
    settings = [*FLAGS, *LEARN, "data.source=files", f"data.path={path}", "data.eval_fraction=0.1"]
    settings += ["mesh=fsdp=8", f"steps={steps}", "batch=8", "seq=64", "log.eval_every=20", "checkpoint.every=10"]
    return apply_overrides(cfg, [*settings, *extra])


def _metrics(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepared(tmp_path_factory.mktemp("prefs"), n=300)


def test_dpo_learns_the_toy_preference_and_resumes_bit_for_bit(data, tmp_path):
    whole = train(_config(data), tmp_path / "whole")
    records = _metrics(tmp_path / "whole")
    assert abs(records[0]["loss"] - math.log(2)) <= 1e-6  # the policy is its reference at the first step
    assert {"rewards/accuracy", "rewards/margin", "logps/chosen", "logps/rejected"} <= records[0].keys()
    assert whole.eval_losses[40] < math.log(2) - 0.05  # held-out pairs: the reversal is preferred
    reference = np.load(tmp_path / "whole" / "reference" / "data.p0.npy")
    assert reference.shape == (np.load(data).size,) and reference.min() < 0  # one log-prob per token
    train(_config(data), tmp_path / "cut", stop_after=25)  # interrupted after step 25: resumes from 20
    resumed = train(_config(data), tmp_path / "cut")
    assert resumed.start_step == 20
    assert all(resumed.losses[s] == whole.losses[s] for s in range(21, 41))
    (tmp_path / "cut" / "reference" / "data.p0.npy").unlink()
    with pytest.raises(JaxparError, match="data.p0.npy: missing; a resumed DPO run reads the reference"):
        train(_config(data, steps=50), tmp_path / "cut")


def test_adapters_train_against_the_base_with_no_reference_pass(data, tmp_path):
    cfg = _config(data, "model.lora.rank=4", "log.eval_every=0", steps=3)
    result = train(cfg, tmp_path / "lora")
    assert not (tmp_path / "lora" / "reference").exists()  # dpo.reference=auto: the adapters switched off
    assert abs(result.losses[1] - math.log(2)) <= 1e-6 and len(result.losses) == 3


def test_preference_records_train_from_data_alone(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("JAXPAR_CACHE", str(tmp_path / "cache"))
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in preference_records(40)))
    folder = tmp_path / "tok"
    folder.mkdir()
    from test_corpus import _bpe

    tok = _bpe(folder / "tokenizer.json")
    args = ["train", "--model", "tiny", "--mesh", "data=8", "--batch", "8", "--seq", "32", "--steps", "1"]
    args += ["--data", str(tmp_path / "p.jsonl"), "--tokenizer", str(tok), "--out", str(tmp_path / "run")]
    assert (
        main(
            args + [x for s in ("log.progress=false", "log.eval_every=0", "model.vocab_size=400") for x in ("--set", s)]
        )
        == 0
    )
    assert "pairs in" in capsys.readouterr().out  # found as preference records: pairs, objective=dpo
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["objective"] == "dpo" and config["data"]["pack"] == "pairs"


@pytest.mark.parametrize(
    "settings, words",
    [
        (["data.pack=documents"], "objective=dpo: data.pack=documents gives no pairs"),
        (["objective=lm"], "data.pack=pairs: preference pairs train with objective=dpo"),
        (["dpo.reference=adapters_off"], "dpo.reference=adapters_off: the model has no adapters"),
        (["dpo.beta=0"], "dpo.beta=0.0: must be a positive number"),
        (["dpo.loss=hinge"], "dpo.loss"),
        (["mesh=stage=2,data=4", "pipeline.microbatches=2"], "objective=dpo on a pipeline"),
    ],
)
def test_bad_dpo_settings_are_refused_by_name(data, tmp_path, settings, words):
    with pytest.raises(JaxparError, match=words.replace("(", r"\(").replace(".", r"\.")):
        train(_config(data, *settings), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_pairs_of_other_documents_are_refused(tmp_path):
    (tmp_path / "t.txt").write_text("plain text, not pairs\n" * 20)
    assert main(["prepare", str(tmp_path / "t.txt"), "--bytes", "--out", str(tmp_path / "t.npy")]) == 0
    with pytest.raises(JaxparError, match="holds text documents, not preference pairs"):
        train(_config(tmp_path / "t.npy"), tmp_path / "run")
    assert not (tmp_path / "run").exists()
