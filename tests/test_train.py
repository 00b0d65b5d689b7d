"""The training loop end to end: resume is exact, restore reshards, bad run directories are refused
untouched, gradient accumulation and z-loss do what they say, the tiny model learns the Markov source."""

import dataclasses
import functools
import hashlib
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxpar.checkpoint import Checkpointer, CheckpointError, abstract_like
from jaxpar.layout import make_layout
from jaxpar.meshes import get_mesh_preset
from jaxpar.models import ExecutionConfig, build_model, get_model_preset
from jaxpar.train.config import apply_overrides, default_config
from jaxpar.train.loop import plan_layout, train
from jaxpar.train.loss import next_token_loss
from jaxpar.train.optim import OptimizerConfig, make_optimizer
from jaxpar.train.step import init_program, init_train_state, make_train_step

QUIET = ["log.progress=false", "log.tensorboard=false", "log.eval_every=0", "checkpoint.every=3"]


def _cfg(*overrides, mesh="fsdp", steps=6):
    return apply_overrides(
        default_config("tiny", steps=steps, batch=8, seq=16, mesh=mesh),
        [*QUIET, "optimizer.learning_rate=1e-2", "optimizer.warmup_steps=2", *overrides],
    )


def _tree_digest(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    return train(_cfg(), out)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("interrupted")
    first = train(_cfg(), out, stop_after=4)  # killed after step 4: the last checkpoint is step 3
    snapshot = tmp_path_factory.mktemp("snapshot") / "run"
    shutil.copytree(out, snapshot)
    second = train(_cfg(), out)  # the same command again
    return first, second, snapshot


def test_resume_gives_exactly_the_uninterrupted_losses(uninterrupted, interrupted):
    first, second, _ = interrupted
    assert first.last_step == 4 and second.start_step == 3 and second.last_step == 6
    ref = uninterrupted.losses
    assert [first.losses[s] for s in (1, 2, 3, 4)] == [ref[s] for s in (1, 2, 3, 4)]
    assert [second.losses[s] for s in (4, 5, 6)] == [ref[s] for s in (4, 5, 6)]  # bit for bit
    assert ref[6] < ref[1] - 0.05, "the run must actually train for this comparison to mean anything"
    records = [json.loads(line) for line in (second.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 4, 5, 6]  # appended, step 4 again
    assert set(records[0]) >= {"step", "loss", "grad_norm", "lr", "tokens_per_s", "tflops_per_device"}


def test_a_finished_run_does_nothing(uninterrupted):
    again = train(_cfg(), uninterrupted.out_dir)
    assert again.start_step == again.last_step == 6 and not again.losses


def test_restore_under_another_mesh_reshards(uninterrupted, interrupted, tmp_path):
    _, _, snapshot = interrupted  # checkpoint of step 3, written under fsdp
    cfg = get_model_preset("tiny")
    states = {}
    for name in ("fsdp", "3d"):
        layout = make_layout(cfg, get_mesh_preset(name), batch=8, seq=16)
        program = init_program(
            lambda r: build_model(cfg, rngs=r), lambda m: make_optimizer(_cfg().optimizer, m, total_steps=6), layout
        )
        ckpt = Checkpointer(snapshot / "checkpoints", every=3, keep=3)
        states[name] = ckpt.restore(3, abstract_like(jax.eval_shape(program.create), program.shardings))[0]
        ckpt.close()
    for a, b in zip(jax.tree.leaves(states["fsdp"]), jax.tree.leaves(states["3d"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    specs = {str(x.sharding.spec) for x in jax.tree.leaves(states["3d"])}
    assert any("tensor" in s for s in specs), "3d must hold the restored weights split over tensor"
    run = tmp_path / "run"
    shutil.copytree(snapshot, run)
    resumed = train(_cfg(mesh="3d"), run)
    assert resumed.start_step == 3
    np.testing.assert_allclose(
        [resumed.losses[s] for s in (4, 5, 6)], [uninterrupted.losses[s] for s in (4, 5, 6)], rtol=1e-5
    )


@pytest.mark.parametrize(
    "override, fields",
    [
        ("model.embed_dim=32", ["model.embed_dim: saved 64, now 32"]),
        ("model.num_kv_heads=4", ["model.num_kv_heads: saved 2, now 4"]),
        ("seq=32", ["seq: saved 16, now 32"]),
    ],
)
def test_incompatible_run_directory_is_refused_untouched(uninterrupted, override, fields):
    before = _tree_digest(uninterrupted.out_dir)
    with pytest.raises(CheckpointError) as err:
        train(_cfg(override), uninterrupted.out_dir)
    for field in fields:
        assert field in str(err.value)
    assert "step 6" in str(err.value)
    assert _tree_digest(uninterrupted.out_dir) == before


def test_read_settings_may_change_on_resume_the_stream_may_not():
    from jaxpar.identity import stream_differences
    from jaxpar.train.config import to_dict

    saved = to_dict(_cfg())
    assert stream_differences(saved, to_dict(_cfg("data.num_threads=8", "data.prefetch=1"))) == []
    assert stream_differences(saved, to_dict(_cfg("data.markov_seed=5", "data.num_threads=8"))) == [
        "data.markov_seed: saved 0, now 5"
    ]


def test_batch_not_divisible_by_data_axes():
    with pytest.raises(Exception, match=r"batch=8 / grad_accum=4 = 2 rows per slice is not divisible by the 4"):
        plan_layout(_cfg("grad_accum=4", mesh="3d"))
    with pytest.raises(Exception, match=r"batch.*6.*fsdp"):
        plan_layout(dataclasses.replace(_cfg(), batch=6))


def test_grad_accum_gives_the_same_update_as_one_big_batch():
    """k=4 accumulated slices vs the whole batch: same loss, same gradient norm, same parameters
    after the update (AdamW eps=1e-3 so float noise in near-zero gradients is not amplified; see
    test_invariance)."""
    cfg = get_model_preset("tiny")
    layout = make_layout(cfg, get_mesh_preset("3d"), batch=16, seq=32)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (16, 33), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    tx = functools.partial(make_optimizer, OptimizerConfig(learning_rate=1e-2, eps=1e-3))
    results = {}
    for k in (1, 4):
        ts = init_train_state(lambda r: build_model(cfg, rngs=r), tx, layout)
        state, metrics = make_train_step(ts, layout, grad_accum=k, z_loss=1e-3)(ts.state, batch)
        results[k] = metrics, [np.asarray(x) for x in jax.tree.leaves(state)]
    (m1, p1), (m4, p4) = results[1], results[4]
    np.testing.assert_allclose([m4.loss, m4.grad_norm, m4.z_loss], [m1.loss, m1.grad_norm, m1.z_loss], rtol=1e-5)
    for a, b in zip(p1, p4):
        np.testing.assert_allclose(b, a, atol=1e-6 * max(1.0, float(np.max(np.abs(a)))))
    first = init_train_state(lambda r: build_model(cfg, rngs=r), tx, layout)
    moved = sum(float(np.max(np.abs(np.asarray(a) - b))) for a, b in zip(jax.tree.leaves(first.state), p1))
    assert moved > 1e-3, "the update must move the parameters"


def test_z_loss_is_the_mean_squared_log_partition():
    cfg = get_model_preset("tiny")
    model = build_model(cfg, rngs=__import__("flax").nnx.Rngs(0))
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 9), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    total, parts = next_token_loss(model, batch, z_loss=1e-2)
    logits = np.asarray(model(batch["inputs"]), np.float64)
    log_z = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
    ce = np.mean(log_z - np.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0])
    np.testing.assert_allclose(
        [float(parts.cross_entropy), float(parts.z_loss), float(total)],
        [ce, 1e-2 * np.mean(log_z**2), ce + 1e-2 * np.mean(log_z**2)],
        rtol=1e-5,
    )
    assert float(next_token_loss(model, batch)[1].z_loss) == 0.0


def test_bf16_compute_keeps_float32_params_optimizer_state_and_loss():
    cfg = get_model_preset("tiny")
    layout = make_layout(cfg, get_mesh_preset("3d"), batch=8, seq=16)
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (8, 17), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    losses = {}
    for name, run in (("bf16", ExecutionConfig(dtype="bfloat16")), ("fp32", ExecutionConfig())):
        ts = init_train_state(
            lambda r, run=run: build_model(cfg, execution=run, rngs=r),
            functools.partial(make_optimizer, OptimizerConfig()),
            layout,
        )
        state, metrics = make_train_step(ts, layout)(ts.state, batch)
        floats = [x for x in jax.tree.leaves(state) if jax.numpy.issubdtype(x.dtype, jax.numpy.floating)]
        assert {str(x.dtype) for x in floats} == {"float32"}
        assert metrics.loss.dtype == np.float32
        losses[name] = float(metrics.loss)
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=2e-2)
