"""A LoRA run started --init-from saves its adapters alone (``jaxpar.convert.base``).

One base model checkpoint, and a LoRA run from it of STEPS steps on ``fsdp=4,tensor=2`` with a checkpoint
every STOP steps, saved two ways: adapters alone (the default) and whole. Checked:
  * the adapters-alone checkpoints hold the adapters (and the optimizer's state) and no base array;
  * training is the same program either way: the same losses bit for bit;
  * the run cut after checkpoint STOP (its later checkpoint removed) resumes with the base read from
    init_from again: the same losses and the same final adapters, bit for bit;
  * ``load_model`` of the run gives the base's weights and the trained adapters, bit for bit;
  * a base that changed under init_from is refused, naming the array, by the resume and by the load;
  * the checksums see one value changed and two values traded.
"""

import dataclasses
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpar.checkpoint import CheckpointError
from jaxpar.convert.base import BASE_JSON, checksums
from jaxpar.convert.store import load_model, save_model
from jaxpar.identity import saved_arrays
from jaxpar.layers.lora import LoraParam
from jaxpar.models import build_model, get_model_preset
from jaxpar.train.config import apply_overrides, default_config
from jaxpar.train.loop import plan_layout, train

STEPS, STOP = 4, 2
SETTINGS = [
    "log.progress=false",
    "log.tensorboard=false",
    "log.eval_every=0",
    f"checkpoint.every={STOP}",
    "optimizer.learning_rate=1e-2",
    "model.lora.rank=4",
    "model.lora.targets=q,k,v,o,gate_up,down",
]


def _flat(model, kind=nnx.Param) -> dict:
    return {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, kind))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_ckpt")
    base = build_model(get_model_preset("tiny"), rngs=nnx.Rngs(3))
    save_model(base, tmp / "base", source={"test": True})
    cfg = apply_overrides(default_config("tiny", steps=STEPS, batch=8, seq=16, mesh="fsdp=4,tensor=2"), SETTINGS)
    cfg = dataclasses.replace(cfg, init_from=str(tmp / "base"))
    whole = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, adapters_only=False))
    out = {"alone": train(cfg, tmp / "alone"), "whole": train(whole, tmp / "whole")}
    return tmp, cfg, base, out


def _bytes(folder) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def test_the_checkpoints_hold_the_adapters_alone_and_train_the_same(runs):
    tmp, _, _, out = runs
    saved = saved_arrays(tmp / "alone" / "checkpoints", STEPS)
    model_part = {p for p in saved if p.startswith("0/")}
    assert model_part and all("_lora_" in p for p in model_part), sorted(model_part)[:5]
    whole = {p for p in saved_arrays(tmp / "whole" / "checkpoints", STEPS) if p.startswith("0/")}
    assert model_part < whole and any(p.endswith("attn/q") for p in whole)
    assert _bytes(tmp / "alone" / "checkpoints") < _bytes(tmp / "whole" / "checkpoints")
    assert (tmp / "alone" / BASE_JSON).is_file() and not (tmp / "whole" / BASE_JSON).exists()
    assert out["alone"].losses == out["whole"].losses  # the same program: bit for bit


def _cut(tmp, name: str):
    """A copy of run ``name`` as a run killed after checkpoint STOP leaves it."""
    shutil.copytree(tmp / "alone", tmp / name)
    shutil.rmtree(tmp / name / "checkpoints" / str(STEPS))
    return tmp / name


def test_a_resume_reads_the_base_again_and_continues_bit_for_bit(runs):
    tmp, cfg, base, out = runs
    resumed = train(cfg, _cut(tmp, "resumed"))
    assert resumed.start_step == STOP
    assert {s: out["alone"].losses[s] for s in resumed.losses} == resumed.losses
    layout = plan_layout(cfg)
    got, want = load_model(tmp / "resumed", layout)[0], load_model(tmp / "alone", layout)[0]
    assert all(np.array_equal(a, _flat(want, LoraParam)[k]) for k, a in _flat(got, LoraParam).items())
    trained = _flat(want)
    for k, a in _flat(base).items():  # the loaded model: the base's weights, bit for bit
        assert np.array_equal(trained[k], a), k
    assert any(np.abs(a).max() > 0 for k, a in _flat(want, LoraParam).items() if k.endswith("_lora_b"))


def test_a_base_that_changed_is_refused_by_name(runs):
    tmp, cfg, _, _ = runs
    cut = _cut(tmp, "stale")
    other = build_model(get_model_preset("tiny"), rngs=nnx.Rngs(4))
    save_model(other, tmp / "other", source={"test": True})
    (tmp / "base").rename(tmp / "base.kept")
    (tmp / "other").rename(tmp / "base")
    try:
        with pytest.raises(CheckpointError, match=r"base.json: the base read from init_from is not the one .*differs"):
            load_model(cut, plan_layout(cfg))
        with pytest.raises(CheckpointError, match=r"base.json: the base read from init_from"):
            train(cfg, cut)
    finally:
        (tmp / "base").rename(tmp / "other")
        (tmp / "base.kept").rename(tmp / "base")
    assert sorted(p.name for p in (cut / "checkpoints").iterdir() if p.name.isdigit()) == [str(STOP)]


def test_the_checksums_see_a_changed_value_and_two_traded():
    model = build_model(get_model_preset("tiny"), rngs=nnx.Rngs(0))
    before = checksums(nnx.state(model))
    q = np.asarray(model.blocks.attn.q[...]).copy()
    traded = q.copy()
    traded[0, 0, 0, 0], traded[0, 0, 0, 1] = q[0, 0, 0, 1], q[0, 0, 0, 0]
    changed = q.copy()
    changed[1, 2, 0, 3] = np.nextafter(q[1, 2, 0, 3], np.float32(np.inf))
    for edited, same_sum in ((traded, True), (changed, False)):
        model.blocks.attn.q[...] = jax.numpy.asarray(edited)
        after = checksums(nnx.state(model))
        assert [k for k in before if before[k] != after[k]] == ["blocks/attn/q"]
        assert (after["blocks/attn/q"][0] == before["blocks/attn/q"][0]) == same_sum
