"""GRPO with the engine in the training process (``jaxpar.rl.run_grpo``) on a toy task, 8 simulated CPU
devices: the reward curve, where the time goes (rollouts against updates), and the rollouts' tokens per
second against the serving engine's on the same model and the same requests.

The task: ``tiny`` (byte vocabulary, 257 ids) is asked ``a+b=`` for two-digit a and b and rewarded by
the share of its completion's tokens that are digits (4 tokens at most, EOS ends one early). 4 prompts ×
8 completions a rollout batch, 2 updates on each, ``fsdp=8`` for training, one device for the engine.

The engine's own rate: a fresh ``Engine`` with the same settings (as ``jaxpar serve`` builds one), its
programs compiled first, given the final weights and the last rollout batch's requests at once.

    python benchmarks/grpo.py --out benchmarks/results/grpo_cpu8.json --figure docs/figures/grpo_reward.png
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

ITERATIONS, PROMPTS, GROUP, NEW_TOKENS, UPDATES = 40, 4, 8, 4, 2


def digit_share(prompt, completion) -> float:
    return sum(48 <= t <= 57 for t in completion) / max(len(completion), 1)


def engine_rate(model, prompts, seed: int) -> dict:
    """Tokens per second of a fresh engine (compiled first) on ``prompts`` × GROUP sampled requests."""
    from jaxpar.inference.engine import Engine
    from jaxpar.inference.scheduler import Request

    rows = PROMPTS * GROUP
    engine = Engine(model, max_slots=rows, page_size=16, max_length=16)
    engine.warm_up()
    rates = []
    for rep in range(5):
        requests = [
            Request((i, g), p, NEW_TOKENS, stop_ids=frozenset([256]))
            for i, p in enumerate(prompts)
            for g in range(GROUP)
        ]
        for n, r in enumerate(requests):
            engine.submit(
                r, dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed + 1000 * rep + n, logprobs=0)
            )
        start = time.perf_counter()
        while not engine.idle:
            engine.step()
        seconds = time.perf_counter() - start
        rates.append(sum(len(r.tokens) - len(r.prompt) for r in requests) / seconds)
    return dict(tokens_per_s=round(statistics.median(rates), 1), repeats=len(rates))


def figure(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["iteration"] for r in records]
    mean = np.array([r["reward"] for r in records])
    std = np.array([r["reward_std"] for r in records])
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(x, mean, color="tab:blue", label="mean reward of the rollout batch")
    ax.fill_between(x, mean - std, mean + std, color="tab:blue", alpha=0.2, label="± its standard deviation")
    ax.set_xlabel(f"rollout batch ({UPDATES} updates each)")
    ax.set_ylabel("share of digits in the answer")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("GRPO on tiny: answer a+b= in digits")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--figure", type=Path, required=True)
    args = parser.parse_args(argv)
    from jaxpar.mesh import simulate_cpu_devices

    simulate_cpu_devices(8)
    from flax import nnx

    from jaxpar.models import get_model_preset
    from jaxpar.rl.grpo import GRPOConfig
    from jaxpar.rl.loop import run_grpo
    from jaxpar.train.optim import OptimizerConfig

    cfg = dataclasses.replace(get_model_preset("tiny"), vocab_size=257)
    rng = np.random.default_rng(0)
    prompts = [list(f"{a}+{b}=".encode()) for a, b in rng.integers(10, 50, (64, 2))]
    grpo = GRPOConfig(prompts=PROMPTS, group_size=GROUP, max_new_tokens=NEW_TOKENS, updates=UPDATES)
    optimizer = OptimizerConfig(learning_rate=3e-3, warmup_steps=0, schedule="constant")
    start = time.perf_counter()
    run = run_grpo(
        cfg, prompts, digit_share, cfg=grpo, iterations=ITERATIONS, optimizer=optimizer, mesh="fsdp=8", stop_ids=[256]
    )
    total = time.perf_counter() - start
    steady = run.records[1:]  # the first iteration compiles the engine's programs and the train step
    rollout, update = sum(r["rollout_s"] for r in steady), sum(r["update_s"] for r in steady)
    model = nnx.merge(run.graphdef, run.state)[0]
    engine = engine_rate(model, prompts[:PROMPTS], seed=7)
    rollout_rate = statistics.median(r["rollout_tokens_per_s"] for r in steady)
    result = dict(
        benchmark="grpo",
        model="tiny (vocab 257)",
        mesh="fsdp=8",
        engine_mesh="one device",
        grpo=dataclasses.asdict(grpo),
        iterations=ITERATIONS,
        host=platform.machine(),
        cpus=os.cpu_count(),
        seconds=round(total, 1),
        first_iteration_s=round(run.records[0]["rollout_s"] + run.records[0]["update_s"], 2),
        steady=dict(
            iterations=len(steady),
            rollout_s=round(rollout, 2),
            sync_s=round(sum(r["sync_s"] for r in steady), 2),
            update_s=round(update, 2),
            rollout_share=round(rollout / (rollout + update), 3),
            rollout_tokens_per_s=round(rollout_rate, 1),
        ),
        engine=engine,
        rollout_over_engine=round(rollout_rate / engine["tokens_per_s"], 3),
        reward=dict(
            first=run.records[0]["reward"], last5=round(float(np.mean([r["reward"] for r in run.records[-5:]])), 3)
        ),
        records=[{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in run.records],
    )
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    figure(run.records, args.figure)
    print(json.dumps({k: v for k, v in result.items() if k != "records"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
