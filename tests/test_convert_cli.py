"""``jaxpar convert`` and ``jaxpar train --init-from``: HF folder → model checkpoint → fine-tuning run →
HF folder. With a vanishing learning rate the exported folder gives transformers the original logits,
so the run really started from the converted weights and the export read the run's checkpoint."""

import json

import hf_models
import jax
import numpy as np
import pytest

from jaxpar.cli import main

pytest.importorskip("transformers")
QUIET = ["--set", "log.progress=false", "--set", "log.tensorboard=false"]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    model = hf_models.build("qwen3_moe")
    folder = tmp_path_factory.mktemp("hf") / "qwen3_moe"
    hf_models.save(model, folder)
    return folder, hf_models.logits(model, hf_models.IDS), hf_models.own_noise(model, hf_models.IDS)


def test_hf_to_checkpoint_to_fine_tune_to_hf(hf_folder, tmp_path):
    import torch
    import transformers

    from jaxpar.convert.store import load_model
    from jaxpar.shardings import default_layout

    folder, want, noise = hf_folder
    tol = hf_models.logit_bound(noise)  # a multiple of the HF model's own float32 noise (tests/noise.py)
    ckpt, run, back = tmp_path / "ckpt", tmp_path / "run", tmp_path / "back"
    assert main(["convert", "--from-hf", str(folder), "--out", str(ckpt), "--mesh", "fsdp=4,tensor=2"]) == 0
    assert json.loads((ckpt / "model.json").read_text())["model"]["class"] == "MoEModelConfig"
    layout = default_layout(_cfg(ckpt), "fsdp")
    model, _ = load_model(ckpt, layout)
    with layout.activate():
        got = np.asarray(jax.jit(lambda m, ids: m(ids))(model, hf_models.IDS))
    np.testing.assert_allclose(got, want, atol=tol, rtol=0)

    assert (
        main(
            [
                "train",
                "--init-from",
                str(ckpt),
                "--out",
                str(run),
                "--mesh",
                "data=2,expert=4",
                "--steps",
                "2",
                "--batch",
                "8",
                "--seq",
                "16",
                "--set",
                "optimizer.learning_rate=1e-12",
                *QUIET,
            ]
        )
        == 0
    )
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert first < 6.0  # a random 250-token model starts near ln 250 = 5.52
    assert main(["convert", "--to-hf", str(run), "--out", str(back)]) == 0
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    np.testing.assert_allclose(hf_models.logits(reloaded, hf_models.IDS), want, atol=tol, rtol=0)


def _cfg(ckpt):
    from jaxpar.convert.store import model_config

    return model_config(ckpt)[0]


def test_existing_outputs_are_refused_untouched(hf_folder, tmp_path, capsys):
    folder, *_ = hf_folder
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("keep")
    assert main(["convert", "--from-hf", str(folder), "--out", str(taken)]) == 2
    assert "exists; conversion writes a new folder and never overwrites" in capsys.readouterr().err
    assert [p.name for p in taken.iterdir()] == ["mine.txt"]


def test_init_from_refuses_another_shape(hf_folder, tmp_path, capsys):
    folder, *_ = hf_folder
    ckpt = tmp_path / "ckpt"
    assert main(["convert", "--from-hf", str(folder), "--out", str(ckpt)]) == 0
    code = main(
        [
            "train",
            "--init-from",
            str(ckpt),
            "--out",
            str(tmp_path / "run"),
            "--mesh",
            "dp",
            "--steps",
            "1",
            "--batch",
            "8",
            "--seq",
            "16",
            "--set",
            "model.moe.mlp_dim=64",
            *QUIET,
        ]
    )
    assert code == 2
    assert "--init-from" in capsys.readouterr().err and not (tmp_path / "run" / "checkpoints").exists()


def test_no_checkpoint_is_named(tmp_path, capsys):
    assert main(["convert", "--to-hf", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    assert f"{tmp_path}: holds no complete checkpoint" in capsys.readouterr().err


def test_set_changes_the_converted_model(hf_folder, tmp_path):
    """``convert --from-hf --set``: model fields change the config saved (model.param_dtype as --dtype
    does), execution settings the saved execution; both are read back as set."""
    from jaxpar.convert.store import saved_execution

    folder, *_ = hf_folder
    ckpt = tmp_path / "ckpt"
    settings = ["model.max_seq_len=64", "model.param_dtype=bfloat16", "execution.capacity_factor=2.0"]
    assert (
        main(["convert", "--from-hf", str(folder), "--out", str(ckpt), *[x for s in settings for x in ("--set", s)]])
        == 0
    )
    cfg = _cfg(ckpt)
    assert cfg.max_seq_len == 64 and cfg.param_dtype == "bfloat16"
    assert saved_execution(ckpt).capacity_factor == 2.0
