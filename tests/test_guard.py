"""The non-finite guard, on a poisoned batch: the tiny model's embedding row of token 255 is NaN and the
token appears in the batch of step 3 only, so exactly that step's loss and gradient are NaN.

  stop: the run ends with an error naming step 3 and the last good checkpoint (2); nothing of step 3 is saved.
  skip: step 3 leaves every array of the state bit for bit as it was; the run goes on, finite, to the end;
        more poisoned steps in a row than ``max_skips`` stop it.
"""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpar.checkpoint import Checkpointer
from jaxpar.convert.store import save_model
from jaxpar.models import build_model, get_model_preset
from jaxpar.train.config import apply_overrides, default_config
from jaxpar.train.guard import NonFiniteError
from jaxpar.train.loop import train

B, T, POISON = 4, 16, 255
DEVICES = 2


def _tokens(poisoned_steps) -> np.ndarray:
    """Token stream whose windows are read in order (no shuffle): step k reads windows (k-1)·B .. k·B-1.
    Token 255 sits inside the first window of each poisoned step, never on a window's edge."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, POISON, 40 * B * T + 1).astype(np.int32)
    for step in poisoned_steps:
        tokens[(step - 1) * B * T + T // 2] = POISON
    return tokens


@pytest.fixture(scope="module")
def poisoned_model(tmp_path_factory):
    model = build_model(get_model_preset("tiny"), rngs=nnx.Rngs(0))
    model.embed.embedding[...] = model.embed.embedding[...].at[POISON].set(np.nan)
    return str(save_model(model, tmp_path_factory.mktemp("poisoned") / "model", source={"test": "poisoned"}))


def _cfg(tmp_path, poisoned_model, poisoned_steps, *overrides, steps=5):
    data = tmp_path / "tokens.npy"
    np.save(data, _tokens(poisoned_steps))
    cfg = default_config("tiny", steps=steps, batch=B, seq=T, mesh=f"data={DEVICES}", init_from=poisoned_model)
    return apply_overrides(
        cfg,
        [
            "log.progress=false",
            "log.tensorboard=false",
            "log.eval_every=0",
            "checkpoint.every=1",
            "checkpoint.keep=10",
            "checkpoint.async_save=false",
            "data.source=files",
            f"data.path={data}",
            "data.shuffle=false",
            *overrides,
        ],
    )


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_stop_names_the_step_and_keeps_the_last_good_checkpoint(tmp_path, poisoned_model):
    out = tmp_path / "run"
    with pytest.raises(
        NonFiniteError,
        match=r"step 3: loss nan, gradient norm nan: not finite; stopping "
        r"\(nonfinite=stop\)\. The last good checkpoint is step 2 in ",
    ):
        train(_cfg(tmp_path, poisoned_model, [3]), out, devices=jax.devices()[:DEVICES])
    assert Checkpointer(out / "checkpoints", every=1, keep=10).steps == [1, 2]  # nothing of step 3
    records = _records(out)
    assert [r["step"] for r in records] == [1, 2, 3] and np.isnan(records[-1]["loss"])


def test_skip_leaves_the_state_unchanged_and_goes_on(tmp_path, poisoned_model):
    out = tmp_path / "run"
    result = train(_cfg(tmp_path, poisoned_model, [3], "nonfinite=skip"), out, devices=jax.devices()[:DEVICES])
    records = _records(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [r.get("skipped", False) for r in records] == [False, False, True, False, False]
    assert all(np.isfinite(result.losses[s]) for s in (1, 2, 4, 5)) and np.isnan(result.losses[3])
    saved = Checkpointer(out / "checkpoints", every=1, keep=10)
    assert saved.steps == [1, 2, 3, 4, 5]
    two, three, four = (_saved_arrays(out, s) for s in (2, 3, 4))
    assert two.keys() == three.keys()
    for path in two:  # params, moments and the step count: all of step 2
        np.testing.assert_array_equal(three[path], two[path], err_msg=path)
    assert any(not np.array_equal(four[p], three[p]) for p in three)  # while a finite step does update


def _saved_arrays(out, step) -> dict:
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(
        out / "checkpoints", options=ocp.CheckpointManagerOptions(read_only=True), item_names=("state",)
    ) as manager:
        state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(state)}


def test_skip_stops_after_max_skips_in_a_row(tmp_path, poisoned_model):
    cfg = _cfg(tmp_path, poisoned_model, [2, 3], "nonfinite=skip", "max_skips=1")
    with pytest.raises(
        NonFiniteError,
        match=r"step 3: .*2 non-finite steps in a row, more than max_skips=1; "
        r"stopping\. The last good checkpoint is step 2 ",
    ):
        train(cfg, tmp_path / "run", devices=jax.devices()[:DEVICES])
