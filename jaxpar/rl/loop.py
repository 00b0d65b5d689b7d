"""GRPO with the serving engine in the training process: ``run_grpo``.

Each iteration:

1. the engine (``jaxpar.inference.engine.Engine``, continuous batching over a paged cache) takes the
   training weights (``Engine.load_weights``: copied onto the decode layout, nothing leaves the
   process), and samples ``group_size`` completions for each of ``prompts`` prompts, keeping the
   log-prob of every token it samples;
2. a Python function scores each completion, and the group-relative advantages and the rollout batch
   follow (``jaxpar.rl.grpo``); with ``kl`` > 0 the reference's log-probs of the batch are computed
   (the adapters switched off for a LoRA model, else the initial weights, kept);
3. ``updates`` train steps (``make_train_step`` with ``policy_loss``) on the batch.

The record of each iteration says where the time went (``rollout_s``, of it ``sync_s`` for the weights,
``update_s``) and how fast the engine generated (``rollout_tokens_per_s``, the weights' copy included).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxpar.data import to_global
from jaxpar.errors import ConfigError
from jaxpar.execution import ExecutionConfig
from jaxpar.inference.engine import Engine
from jaxpar.inference.scheduler import Request
from jaxpar.layout import make_layout
from jaxpar.meshes import resolve_mesh_arg
from jaxpar.models import build_model
from jaxpar.rl.grpo import GRPOConfig, group_advantages, policy_loss, rollout_batch
from jaxpar.train.optim import OptimizerConfig, make_optimizer
from jaxpar.train.preference import natural_logps, without_adapters
from jaxpar.train.step import init_train_state, make_model_fn, make_train_step

Reward = Callable[[list[int], list[int]], float]  # (prompt ids, completion ids) -> reward


@dataclasses.dataclass
class GRPORun:
    records: list[dict]  # one per iteration
    state: object  # the train state after the last update
    graphdef: object


def run_grpo(
    model_cfg,
    prompts: Sequence[Sequence[int]],
    reward: Reward,
    *,
    cfg: GRPOConfig,
    iterations: int,
    optimizer: OptimizerConfig,
    mesh: str = "dp",
    execution=None,
    seed: int = 0,
    stop_ids: Sequence[int] = (),
    engine_mesh: str | None = None,
    page_size: int = 16,
    init=None,
    log: Callable[[dict], None] | None = None,
    resume: Callable[[Any], tuple[Any, int]] | None = None,
    save: Callable[[int, Any], None] | None = None,
    until: int | None = None,
) -> GRPORun:
    """Trains ``model_cfg`` (from its initialisation with ``seed``) by GRPO for ``iterations`` rollout
    batches (module docstring) on ``mesh``; the engine decodes on ``engine_mesh`` (a decode layout name
    or spec; default one device). ``init``: a model whose weights the run starts from (e.g. a fine-tuned
    one; a LoRA run takes its base from one without adapters). A completion ends at ``stop_ids`` or
    ``cfg.max_new_tokens``. ``log(record)`` after each iteration, then ``save(iterations done,
    state)``; ``resume(state) -> (state, iterations done)`` picks up a saved run: the iterations that
    follow draw the prompts and sampling seeds an uninterrupted run would (the KL's reference stays the
    starting weights). ``until``: stop after that many iterations (the schedule still spans all). An MoE
    model trains dropless (``execution.capacity_factor=None``), as the engine routes: a token dropped
    in training only would change the ratio's numerator alone."""
    execution = execution or ExecutionConfig(capacity_factor=None)
    if model_cfg.moe is not None and execution.capacity_factor is not None:
        raise ConfigError(
            f"execution.capacity_factor={execution.capacity_factor}: GRPO trains an MoE model dropless (None), "
            "as the engine that samples the rollouts routes"
        )
    rows = cfg.prompts * cfg.group_size
    layout, seq = grpo_layout(model_cfg, prompts, cfg, mesh, execution)
    make = lambda r: build_model(model_cfg, execution=execution, rngs=r)  # noqa: E731
    tx = functools.partial(make_optimizer, optimizer, total_steps=iterations * cfg.updates)
    ts = init_train_state(make, tx, layout, seed=seed)
    state = ts.state if init is None else _with_weights(ts.state, init)
    run = _Run(ts, layout, cfg, seq, functools.partial(policy_loss, cfg=cfg), reward)
    run.reference = _reference(ts, layout, cfg, model_cfg, state)
    state, done = (state, 0) if resume is None else resume(state)
    length = -(-(seq + 1) // page_size) * page_size
    engine = Engine(run.model_of(state), max_slots=rows, page_size=page_size, max_length=length, mesh=engine_mesh)
    rng, records = np.random.default_rng(seed), []
    for it in range(min(iterations, until or iterations)):
        chosen = rng.choice(len(prompts), cfg.prompts, replace=len(prompts) < cfg.prompts)
        if it < done:  # drawn by the run before the resume
            continue
        state, record = run.iteration(engine, state, [list(prompts[k]) for k in chosen], seed, it, stop_ids)
        records.append(record)
        if log is not None:
            log(record)
        if save is not None:
            save(it + 1, state)
    return GRPORun(records, state, ts.graphdef)


def grpo_layout(model_cfg, prompts: Sequence[Sequence[int]], cfg: GRPOConfig, mesh: str, execution):
    """(the training layout of a rollout batch, its padded length); refuses a mesh the batch or the
    model does not divide, naming it."""
    seq = -(-(max(len(p) for p in prompts) + cfg.max_new_tokens) // 8) * 8
    rows = cfg.prompts * cfg.group_size
    return make_layout(model_cfg, resolve_mesh_arg(mesh), batch=rows, seq=seq, execution=execution), seq


class _Run:
    """One GRPO iteration's parts: the train step, the reference's log-probs, the reward."""

    def __init__(self, ts, layout, cfg: GRPOConfig, seq: int, loss_fn, reward: Reward):
        self.ts, self.layout, self.cfg, self.seq, self.reward = ts, layout, cfg, seq, reward
        self.step = make_train_step(ts, layout, loss_fn=loss_fn)
        self.reference = None

    def model_of(self, state):
        return nnx.merge(self.ts.graphdef, state)[0]

    def iteration(self, engine: Engine, state, prompts: list[list[int]], seed: int, it: int, stop_ids):
        """Rollouts on the current weights, rewards, advantages, then ``cfg.updates`` train steps; returns
        (the new state, the iteration's record)."""
        cfg, start = self.cfg, time.perf_counter()
        engine.load_weights(self.model_of(state))
        sync_s = time.perf_counter() - start
        done = _rollouts(engine, prompts, cfg, seed, it, stop_ids)
        rollout_s = time.perf_counter() - start
        rewards = np.array([[self.reward(r.prompt, r.tokens[len(r.prompt) :]) for r in group] for group in done])
        advantages = group_advantages(rewards)
        rows = [_row(r, a) for group, adv in zip(done, advantages) for r, a in zip(group, adv)]
        data = to_global(rollout_batch(rows, self.seq), self.layout.sharding(("batch", "length")))
        if self.reference is not None:
            data["reference"] = self.reference(state, data)
        for _ in range(cfg.updates):
            state, metrics = self.step(state, data)
        loss = float(metrics.loss)  # waits for the updates
        generated = sum(len(r.tokens) - len(r.prompt) for group in done for r in group)
        return state, {
            "iteration": it + 1,
            "reward": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "loss": loss,
            **{k: float(v) for k, v in metrics.extra.items()},
            "sync_s": sync_s,  # the weights onto the engine (part of rollout_s)
            "rollout_s": rollout_s,
            "update_s": time.perf_counter() - start - rollout_s,
            "rollout_tokens": generated,
            "rollout_tokens_per_s": generated / rollout_s,
        }


def _with_weights(state, init):
    """The train state with ``init``'s weights over the model's, each placed as the model's own."""
    current = dict(nnx.to_flat_state(state[0]))
    placed = []
    for path, var in nnx.to_flat_state(nnx.state(init)):
        if path not in current:
            raise ConfigError(f"init: its parameter {'/'.join(map(str, path))} is not one of the model's")
        placed.append((path, var.replace(jax.device_put(var.get_value(), current[path].get_value().sharding))))
    state[0] = nnx.merge_state(state[0], nnx.from_flat_state(placed))
    return state


def _reference(ts, layout, cfg: GRPOConfig, model_cfg, start):
    """``reference(state, batch) -> log-probs [B, T]`` of the KL's reference, or None without a KL: the
    adapters switched off (a LoRA model), else the weights of ``start`` (the run's first state, kept)."""
    if not cfg.kl:
        return None
    if model_cfg.lora.rank:
        fn = lambda model, batch: natural_logps(without_adapters(model), batch)  # noqa: E731
        return make_model_fn(ts, layout, fn, layout.sharding(("batch", "length")))
    initial = jax.tree.map(lambda x: x.copy(), start)
    fn = make_model_fn(ts, layout, natural_logps, layout.sharding(("batch", "length")))
    return lambda state, batch: fn(initial, batch)


def _rollouts(engine: Engine, prompts: list[list[int]], cfg: GRPOConfig, seed: int, it: int, stop_ids):
    """[prompt][completion] finished requests, each sampled with its own seed and its tokens' log-probs."""
    requests = [
        [Request((i, g), p, cfg.max_new_tokens, stop_ids=frozenset(stop_ids)) for g in range(cfg.group_size)]
        for i, p in enumerate(prompts)
    ]
    base = (seed * 1_000_003 + it) * len(prompts) * cfg.group_size
    for n, r in enumerate(r for group in requests for r in group):
        sampling = dict(temperature=cfg.temperature, top_k=0, top_p=1.0, min_p=0.0, seed=base + n, logprobs=0)
        engine.submit(r, sampling)
    while not engine.idle:
        engine.step()
    return requests


def _row(request: Request, advantage: float):
    completion = request.tokens[len(request.prompt) :]
    logps = [score.logprob for score in request.token_logprobs[: len(completion)]]
    return request.prompt, completion, logps, float(advantage)
