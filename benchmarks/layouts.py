"""Compile time and median step time of a model under each mesh preset, on simulated CPU devices.

    python benchmarks/layouts.py --models tiny,llama-100m --devices 8 --steps 5 > layouts.json

Prints one JSON object: the settings, the machine, and a row per (model, mesh preset) with compile_s
(lower + compile of the train step), median/min step_s over ``--steps`` timed steps after one warm-up,
tokens_per_s, and the compiled program's per-device collective bytes and temp memory. Simulated devices
share the host's cores, so step times measure the partitioned program's overheads on CPU, not a
cluster's speed; compare layouts with each other, not with hardware.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,llama-100m")
    p.add_argument("--meshes", default="dp,fsdp,tp,fsdp_tp,hsdp,3d")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    return p.parse_args(argv)


def time_train_step(
    cfg, mesh_name: str, *, batch: int, seq: int, steps: int, warmup: int = 1, devices=None, execution=None
):
    """``cfg``'s train step, run as ``execution`` says (default ``ExecutionConfig()``), under the mesh
    preset ``mesh_name``, compiled (timed) and run ``warmup`` untimed then ``steps`` timed steps on random
    tokens, each to its loss: (layout, compiled, compile_s, step times, last loss)."""
    import functools

    import jax
    import numpy as np

    from jaxpar.layout import make_layout
    from jaxpar.meshes import resolve_mesh_arg
    from jaxpar.models import build_model
    from jaxpar.train.optim import OptimizerConfig, make_optimizer
    from jaxpar.train.step import init_train_state, make_train_step

    layout = make_layout(cfg, resolve_mesh_arg(mesh_name), batch=batch, seq=seq, devices=devices, execution=execution)
    ts = init_train_state(
        lambda r: build_model(cfg, execution=execution, rngs=r),
        functools.partial(make_optimizer, OptimizerConfig()),
        layout,
    )
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq + 1), dtype=np.int32)
    data = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    t0 = time.perf_counter()
    compiled = make_train_step(ts, layout).lower(ts.state, data).compile()
    compile_s = time.perf_counter() - t0
    state, times = ts.state, []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        state, metrics = compiled(state, data)
        jax.block_until_ready(metrics.loss)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return layout, compiled, compile_s, times, float(metrics.loss)


def bench_one(model_name: str, mesh_name: str, *, batch: int, seq: int, steps: int) -> dict:
    from jaxpar.analysis import analyze_compiled
    from jaxpar.models import get_model_preset

    cfg = get_model_preset(model_name)
    layout, compiled, compile_s, times, loss = time_train_step(cfg, mesh_name, batch=batch, seq=seq, steps=steps)
    report = analyze_compiled(compiled, mesh=layout.mesh)
    median = statistics.median(times)
    return dict(
        model=model_name,
        mesh=mesh_name,
        params=cfg.num_params(padded=True),
        compile_s=round(compile_s, 2),
        step_s_median=round(median, 4),
        step_s_min=round(min(times), 4),
        tokens_per_s=round(batch * seq / median, 1),
        loss=loss,
        collective_bytes_per_device=report.collectives.total_bytes,
        temp_bytes_per_device=report.memory.get("temp_size_in_bytes"),
    )


def main(argv=None) -> int:
    args = _args(argv)
    from jaxpar.mesh import simulate_cpu_devices

    simulate_cpu_devices(args.devices)
    rows = []
    for model in args.models.split(","):
        for mesh in args.meshes.split(","):
            rows.append(bench_one(model, mesh, batch=args.batch, seq=args.seq, steps=args.steps))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    import jax

    out = dict(
        benchmark="layouts",
        devices=args.devices,
        batch=args.batch,
        seq=args.seq,
        steps=args.steps,
        jax=jax.__version__,
        host=dict(machine=platform.machine(), cpus=os.cpu_count()),
        rows=rows,
    )
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
