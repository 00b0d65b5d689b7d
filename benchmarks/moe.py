"""MoE measurements (prints one JSON object):

1. dropped fraction against the capacity factor on a skewed router (a few hot experts), one device;
2. all-to-all bytes of a compiled train step against 4·(ep−1)/ep·T·k·cf·D·b per MoE layer;
3. step time of dropless (ragged_dot) against capacity mode, same model and batch, on 8 simulated devices,
   without and with expert parallelism (dropless EP on CPU uses the padded stand-in for the ragged
   all-to-all, which sends ep× the bytes; see jaxpar/parallel/dropless.py).

    python benchmarks/moe.py > benchmarks/results/moe_cpu8.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time


def dropped_vs_capacity(factors, skews, *, hot: int, tokens: int, seed: int = 0) -> list[dict]:
    """Softmax top-2 over 16 experts with router logits ~ N(0, 1) per expert, plus ``skew`` nats for the
    first ``hot`` experts (a constant input feature whose router row carries the offset): per skew and
    capacity factor, the share of assignments capacity drops and the hottest expert's share of the load."""
    import jax
    import numpy as np
    from flax import nnx

    from jaxpar.execution import ExecutionConfig
    from jaxpar.layers.moe import MoE, MoEConfig

    d, e = 64, 16
    x = np.array(jax.random.normal(jax.random.key(seed), (tokens // 256, 256, d)))
    x[..., 0] = 1.0  # the constant feature
    rows = []
    for skew in skews:
        for cf in factors:
            cfg, run = MoEConfig(num_experts=e, top_k=2, mlp_dim=32), ExecutionConfig(capacity_factor=cf)
            layer = MoE(d, cfg, execution=run, dtype="float32", param_dtype="float32", rngs=nnx.Rngs(seed))
            router = np.array(jax.random.normal(jax.random.key(seed + 1), (d, e))) / np.sqrt(d - 1)
            router[0] = 0.0
            router[0, :hot] = skew
            layer.router[...] = router
            _, stats = nnx.jit(lambda m, x: m(x))(layer, x)
            load = np.asarray(stats.expert_load)
            rows.append(
                dict(
                    skew_nats=skew,
                    capacity_factor=cf,
                    dropped_fraction=round(float(stats.dropped_fraction), 4),
                    hottest_share=round(float(load.max() / load.sum()), 4),
                )
            )
    return rows


def _layout_and_step(model: str, mesh: str, *, batch: int, seq: int, **execution):
    """``execution``: changes to the preset's execution settings."""
    import jax
    import numpy as np

    from jaxpar.layout import make_layout
    from jaxpar.meshes import resolve_mesh_arg
    from jaxpar.models import build_model, get_execution_preset, get_model_preset
    from jaxpar.train.optim import OptimizerConfig, make_optimizer
    from jaxpar.train.step import batch_sharding, init_train_state, make_train_step

    cfg, run = get_model_preset(model), get_execution_preset(model, **execution)
    layout = make_layout(cfg, resolve_mesh_arg(mesh), batch=batch, seq=seq, execution=run)
    ts = init_train_state(
        lambda r: build_model(cfg, execution=run, rngs=r),
        functools.partial(make_optimizer, OptimizerConfig()),
        layout,
    )
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq + 1), dtype=np.int32)
    data = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    data = {k: jax.device_put(v, s) for (k, v), s in zip(data.items(), batch_sharding(layout).values())}
    return cfg, run, layout, ts, make_train_step(ts, layout), data


def dispatch_bytes(meshes, *, batch: int, seq: int) -> list[dict]:
    """All-to-all bytes one device sends per step (no remat) against the formula."""
    import math

    from jaxpar.analysis import analyze_compiled
    from jaxpar.parallel.moe import a2a_bytes_formula

    rows = []
    for mesh in meshes:
        cfg, run, layout, ts, step, data = _layout_and_step("tiny-moe", mesh, batch=batch, seq=seq, remat="none")
        report = analyze_compiled(step.lower(ts.state, data).compile(), mesh=layout.mesh)
        sent = sum(c.sent_bytes * c.executions for c in report.ops if c.kind == "all-to-all")
        m, ep = cfg.moe, layout.mesh.shape["expert"]
        slots = m.num_experts * math.ceil(run.capacity_factor * seq * m.top_k / m.num_experts)  # per sequence
        want = cfg.num_moe_layers * a2a_bytes_formula(
            tokens_per_device=batch * seq // layout.mesh.size,
            top_k=m.top_k,
            capacity_factor=slots / (seq * m.top_k),
            embed_dim=cfg.embed_dim,
            ep=ep,
            bytes_per_element=4,
        )
        rows.append(
            dict(
                mesh=mesh,
                ep=ep,
                all_to_all_sent_bytes=round(sent),
                formula_bytes=round(want),
                ratio=round(sent / want, 4) if want else None,
            )
        )
    return rows


def step_times(cases, *, batch: int, seq: int, steps: int) -> list[dict]:
    """Compile every case, then time them in interleaved rounds (one step of each per round), so slow
    drifts of a shared host hit every case alike; the median over rounds per case."""
    import jax

    runs = []
    for label, mesh, capacity_factor in cases:
        step_data = _layout_and_step("tiny-moe", mesh, batch=batch, seq=seq, capacity_factor=capacity_factor)
        ts, step, data = step_data[3:]
        t0 = time.perf_counter()
        compiled = step.lower(ts.state, data).compile()
        compile_s = time.perf_counter() - t0
        state, metrics = compiled(ts.state, data)  # warm-up
        jax.block_until_ready(metrics.loss)
        runs.append(
            dict(
                label=label,
                mesh=mesh,
                cf=capacity_factor,
                compile_s=compile_s,
                fn=compiled,
                state=state,
                data=data,
                times=[],
            )
        )
    for _ in range(steps):
        for run in runs:
            t0 = time.perf_counter()
            run["state"], metrics = run["fn"](run["state"], run["data"])
            jax.block_until_ready(metrics.loss)
            run["times"].append(time.perf_counter() - t0)
    rows = []
    for run in runs:
        median = statistics.median(run["times"])
        rows.append(
            dict(
                mode=run["label"],
                mesh=run["mesh"],
                capacity_factor=run["cf"],
                compile_s=round(run["compile_s"], 2),
                median_step_s=round(median, 4),
                min_step_s=round(min(run["times"]), 4),
                tokens_per_s=round(batch * seq / median, 1),
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    from jaxpar.mesh import simulate_cpu_devices

    simulate_cpu_devices(args.devices)
    import jax

    out = dict(
        benchmark="moe",
        devices=args.devices,
        batch=args.batch,
        seq=args.seq,
        jax=jax.__version__,
        dropped=dropped_vs_capacity([1.0, 1.25, 1.5, 2.0, 3.0, 4.0], [0.0, 0.5, 1.0, 2.0], hot=2, tokens=4096),
        dispatch=dispatch_bytes(
            ["data=4,expert=2", "data=2,expert=4", "data=2,fsdp=2,expert=2"], batch=args.batch, seq=args.seq
        ),
        step_time=step_times(
            [
                ("capacity", "data=8", 2.0),
                ("dropless", "data=8", None),
                ("capacity+EP", "data=2,expert=4", 2.0),
                ("dropless+EP (padded exchange)", "data=2,expert=4", None),
            ],
            batch=args.batch,
            seq=args.seq,
            steps=args.steps,
        ),
    )
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
