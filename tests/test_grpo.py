"""GRPO (jaxpar.rl): the serving engine's log-probs of the tokens it samples are the training forward's on
the same tokens (dense and MoE, on one device and under a decode layout, and again after the engine
takes updated weights); the policy-gradient loss's gradients are the one-device ones on the parallel
layouts within the measured noise, and advantages taken from the wrong rows are caught; a tiny model
learns a toy reward in the process's own rollouts."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from flax import nnx
from invariance import ONE_DEVICE, OPTIMIZER, Run, flat
from noise import Bound, check_mutation_caught, check_run, measure, permuted_rows

from jaxpar.errors import ConfigError
from jaxpar.execution import ExecutionConfig
from jaxpar.inference.engine import Engine
from jaxpar.layers.lora import LoraConfig
from jaxpar.layout import make_layout
from jaxpar.meshes import resolve_mesh_arg
from jaxpar.models import build_model, get_model_preset
from jaxpar.rl.grpo import GRPOConfig, group_advantages, policy_loss, rollout_batch
from jaxpar.rl.loop import _rollouts, run_grpo
from jaxpar.train.optim import OptimizerConfig, make_optimizer
from jaxpar.train.preference import natural_logps
from jaxpar.train.step import init_train_state, make_grad_fn, make_model_fn, make_train_step

ENGINE_BOUND = 1e-5  # the bound on |engine − training forward| per token (float32)
DROPLESS = ExecutionConfig(capacity_factor=None)  # as the engine routes
PROMPTS = [[5, 17, 42, 9], [3, 3, 3], [200, 1, 77, 64, 12, 8], [99]]
CFG = GRPOConfig(prompts=4, group_size=4, max_new_tokens=6)


MODELS = {  # DeepSeek with MLA adapters: the absorbed decode reads kv_b's through its factors
    "tiny-deepseek+lora": dataclasses.replace(
        get_model_preset("tiny-deepseek"), lora=LoraConfig(rank=4, targets="q_a,q_b,kv_a,kv_b,o")
    ),
}


def _engine_against_training(name: str, engine_mesh):
    """max |engine log-prob − training forward log-prob| over every sampled token, for the initial
    weights and again after one update (the engine given the new weights, the same prompts again)."""
    cfg = MODELS.get(name) or get_model_preset(name)
    rows, seq = CFG.prompts * CFG.group_size, 16
    layout = make_layout(cfg, resolve_mesh_arg("fsdp=8"), batch=rows, seq=seq, execution=DROPLESS)
    ts = init_train_state(
        lambda r: build_model(cfg, execution=DROPLESS, rngs=r), functools.partial(make_optimizer, OPTIMIZER), layout
    )
    logps = make_model_fn(ts, layout, natural_logps, layout.sharding(("batch", "length")))
    step = make_train_step(ts, layout, loss_fn=functools.partial(policy_loss, cfg=CFG))
    model_of = lambda s: nnx.merge(ts.graphdef, s)[0]  # noqa: E731
    devices = jax.devices()[:2] if engine_mesh else None  # a decode layout on two of the devices
    engine = Engine(model_of(ts.state), max_slots=rows, page_size=4, max_length=16, mesh=engine_mesh, devices=devices)
    state, errors = ts.state, []
    for it in range(2):
        engine.load_weights(model_of(state))
        done = _rollouts(engine, PROMPTS, CFG, 0, it, ())
        advantages = group_advantages(np.random.default_rng(it).normal(size=(CFG.prompts, CFG.group_size)))
        flat_rows = [
            (r.prompt, r.tokens[len(r.prompt) :], [s.logprob for s in r.token_logprobs], a)
            for group, adv in zip(done, advantages)
            for r, a in zip(group, adv)
        ]
        batch = rollout_batch(flat_rows, seq)
        ours = np.asarray(logps(state, batch))
        mask = batch["mask"] > 0
        errors.append(float(np.max(np.abs(ours[mask] - batch["old_logps"][mask]))))
        state, _ = step(state, batch)  # donates the state the engine's weights were copied from
    assert all(r.finish_reason for group in _rollouts(engine, PROMPTS, CFG, 0, 2, ()) for r in group)  # its own
    return errors


@pytest.mark.parametrize(
    "name, engine_mesh", [("tiny", None), ("tiny", "tensor=2"), ("tiny-moe", None), ("tiny-deepseek+lora", None)]
)
def test_the_engine_samples_with_the_training_forwards_log_probs(name, engine_mesh):
    errors = _engine_against_training(name, engine_mesh)
    assert max(errors) <= ENGINE_BOUND, errors


def _batches(steps: int = 3, rows: int = 8, seq: int = 16, seed: int = 0):
    """Rollout batches of random prompts and completions, advantages and old log-probs near 0's."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        items = []
        for _ in range(rows):
            prompt, n = rng.integers(0, 256, rng.integers(2, 6)).tolist(), int(rng.integers(2, 10))
            items.append(
                (
                    prompt,
                    rng.integers(0, 256, n).tolist(),
                    (-5.5 + 0.1 * rng.normal(size=n)).tolist(),
                    float(rng.normal()),
                )
            )
        out.append(rollout_batch(items, seq))
    return out


def grpo_steps(cfg, preset, batches, *, grad_accum=1, execution=DROPLESS, devices=None, kl=0.0) -> Run:
    b, t = batches[0]["inputs"].shape
    layout = make_layout(cfg, preset, batch=b, seq=t, devices=devices, execution=execution)
    ts = init_train_state(
        lambda r: build_model(cfg, execution=execution, rngs=r), functools.partial(make_optimizer, OPTIMIZER), layout
    )
    loss_fn = functools.partial(policy_loss, cfg=dataclasses.replace(CFG, kl=kl))
    if kl:
        initial = make_model_fn(ts, layout, natural_logps, layout.sharding(("batch", "length")))
        batches = [x | {"reference": np.asarray(initial(ts.state, x)) - 0.01} for x in batches]
    step = make_train_step(ts, layout, loss_fn=loss_fn, grad_accum=grad_accum)
    grad_fn = make_grad_fn(ts, layout, loss_fn=loss_fn, grad_accum=grad_accum)
    state, losses, grads = ts.state, [], []
    for data in batches:
        grads.append(flat(grad_fn(state, data)[1]))
        state, metrics = step(state, data)
        losses.append(float(metrics.loss))
    return Run(losses, grads, [], state, {a: n for a, n in layout.mesh.shape.items() if n > 1})


def _one_device(cfg, batches, **kw):
    return grpo_steps(cfg, ONE_DEVICE, batches, devices=jax.devices()[:1], **kw)


def _rows(batches, order):
    return [{k: v[order] for k, v in b.items()} for b in batches]


@pytest.fixture(scope="module")
def grpo_reference():
    batches = _batches()
    cfg = get_model_preset("tiny")
    run = _one_device(cfg, batches, kl=0.05)
    return batches, run, Bound("grpo", measure(run, _one_device(cfg, _rows(batches, permuted_rows(8)), kl=0.05)))


@pytest.mark.parametrize("mesh, grad_accum", [("fsdp=8", 1), ("data=2,tensor=4", 1), ("fsdp=4,tensor=2", 2)])
def test_the_policy_gradient_is_the_same_on_every_layout(grpo_reference, mesh, grad_accum):
    batches, ref, bound = grpo_reference
    cfg = get_model_preset("tiny")
    if grad_accum > 1:
        ref = _one_device(cfg, batches, grad_accum=grad_accum, kl=0.05)
    run = grpo_steps(cfg, resolve_mesh_arg(mesh), batches, grad_accum=grad_accum, kl=0.05)
    check_run(run, ref, bound, f"grpo {mesh} grad_accum={grad_accum}")


def test_advantages_from_the_wrong_rows_are_caught(grpo_reference):
    batches, ref, bound = grpo_reference
    wrong = [b | {"advantages": np.roll(b["advantages"], 1, axis=0)} for b in batches]
    run = _one_device(get_model_preset("tiny"), wrong, kl=0.05)
    check_mutation_caught(run, ref, bound, "advantages rolled by one row")


def test_group_advantages_and_bad_settings():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    adv = group_advantages(rewards)
    np.testing.assert_allclose(adv[0], (rewards[0] - 0.5) / (np.std(rewards[0], ddof=1) + 1e-4), rtol=1e-6)
    assert not adv[1].any()  # a group of equal rewards teaches nothing
    for fields, words in [
        (dict(group_size=1), "grpo.group_size=1"),
        (dict(clip=1.5), "grpo.clip=1.5"),
        (dict(kl=-1.0), "grpo.kl=-1.0"),
    ]:
        with pytest.raises(ConfigError, match=words):
            GRPOConfig(**fields)
    with pytest.raises(ConfigError, match="execution.capacity_factor=1.25: GRPO trains an MoE model dropless"):
        run_grpo(
            get_model_preset("tiny-moe"),
            PROMPTS,
            lambda p, c: 0.0,
            cfg=CFG,
            iterations=1,
            optimizer=OPTIMIZER,
            execution=ExecutionConfig(),
        )


def digit_share(prompt, completion) -> float:
    """The toy reward: the share of the completion's tokens that are ASCII digits."""
    return sum(48 <= t <= 57 for t in completion) / max(len(completion), 1)


def test_a_tiny_model_learns_to_answer_in_digits():
    cfg = dataclasses.replace(get_model_preset("tiny"), vocab_size=257)
    rng = np.random.default_rng(0)
    prompts = [list(f"{a}+{b}=".encode()) for a, b in rng.integers(10, 50, (64, 2))]
    run = run_grpo(
        cfg,
        prompts,
        digit_share,
        cfg=GRPOConfig(prompts=4, group_size=8, max_new_tokens=4, updates=2),
        iterations=40,
        optimizer=OptimizerConfig(learning_rate=3e-3, warmup_steps=0, schedule="constant"),
        mesh="fsdp=8",
        stop_ids=[256],
    )
    rewards = [r["reward"] for r in run.records]
    assert np.mean(rewards[:3]) < 0.2 and np.mean(rewards[-5:]) > 0.8, rewards  # 80 updates
    assert all(r["rollout_tokens_per_s"] > 0 and r["update_s"] > 0 for r in run.records)
