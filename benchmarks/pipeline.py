"""Pipeline schedules on simulated CPU devices: step time of each schedule beside fsdp without a
pipeline, compile time and compiled temp memory against the number of microbatches, and each table's
bubble.

    python benchmarks/pipeline.py > benchmarks/results/pipeline_cpu8.json

Prints one JSON object with, per model (``--models``, each with ``--layers`` layers so 4 stages × 2
virtual stages divide them):

(a) ``step``: for ``fsdp=8`` without a pipeline and for each schedule at p = ``--stages``,
    m = ``--microbatches`` (interleaved with v = 2), run two ways: ``grad_reduce=slice`` (the executor
    runs one section a tick on every stage) and ``grad_reduce=step`` (each stage runs its own action,
    ``jaxpar.pipeline.actions``): compile seconds, the median of ``--repeats`` step times after one
    warm-up step (wall and process CPU seconds), the ratio to fsdp, and the table's ideal, lockstep and
    executor bubbles (F = 1, B = 2; split, B = W = 1, and the one-section executor's full vjp 2 in a W
    tick). All with ``--remat`` (default none).
(b) ``by_microbatches``: for 1f1b and gpipe at m ∈ {p, 2p, 4p} with a fixed microbatch of ``--rows``
    sequences (the batch grows with m): compile seconds and ``memory_analysis().temp_size_in_bytes``.

All simulated devices share the host's cores, so absolute times mean little; the ratios between
schedules, the memory and the compile-time trend are the result.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import sys
import time


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--models", default="tiny,llama-100m")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--rows", type=int, default=2, help="sequences per microbatch")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--remat", default="none")
    return p.parse_args(argv)


def _setup(name, layers, mesh, batch, seq, table, devices, remat="full", grad_reduce="slice"):
    import jax
    import numpy as np

    from jaxpar.execution import ExecutionConfig
    from jaxpar.layout import make_layout
    from jaxpar.meshes import resolve_mesh_arg
    from jaxpar.models import build_model, get_model_preset
    from jaxpar.pipeline.executor import check_stack
    from jaxpar.train.optim import OptimizerConfig, make_optimizer
    from jaxpar.train.step import batch_sharding, init_train_state, make_train_step

    cfg = dataclasses.replace(get_model_preset(name), num_layers=layers)
    run = ExecutionConfig(remat=remat)
    layout = make_layout(cfg, resolve_mesh_arg(mesh), batch=batch, seq=seq, devices=jax.devices()[:devices])
    split = None if table is None else check_stack(cfg, table.stages, table.virtual_stages)
    make = lambda r: build_model(cfg, rngs=r, execution=run)
    ts = init_train_state(make, functools.partial(make_optimizer, OptimizerConfig()), layout, stack=split)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq), dtype=np.int32)
    data = {k: jax.device_put(tokens, s) for k, s in batch_sharding(layout).items()}
    t0 = time.perf_counter()
    kw = dict(pipeline=table, grad_reduce=grad_reduce) if table is not None else {}
    step = make_train_step(ts, layout, **kw).lower(ts.state, data).compile()
    return ts, data, step, time.perf_counter() - t0


def _timed(name, layers, mesh, batch, seq, table, devices, repeats, remat, grad_reduce="slice"):
    import jax

    ts, data, step, compile_s = _setup(name, layers, mesh, batch, seq, table, devices, remat, grad_reduce)
    state, times, cpu = ts.state, [], []
    for _ in range(repeats + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        state, metrics = step(state, data)
        jax.block_until_ready(metrics.loss)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    out = {
        "mesh": mesh,
        "compile_s": round(compile_s, 2),
        "step_s": round(statistics.median(times[1:]), 4),
        "cpu_s": round(statistics.median(cpu[1:]), 4),
    }
    if table is not None:
        from jaxpar.pipeline.timing import executor_bubble_fraction, own_action_bubble_fraction

        own = grad_reduce == "step"
        # split: one section a tick runs the full vjp (B + W = 2) in a W tick; own actions a W of 1
        vjp = (1.0, 1.0, 1.0 if own else 2.0) if table.split_backward else (1.0, 2.0)
        executor = own_action_bubble_fraction if own else executor_bubble_fraction
        out |= {
            "grad_reduce": grad_reduce,
            "bubble": round(table.bubble_fraction(), 4),
            "lockstep_bubble": round(table.lockstep_bubble_fraction(), 4),
            "executor_bubble": round(executor(table, *vjp), 4),
            "peak_in_flight": table.peak_in_flight.tolist(),
        }
    return out


def main(argv=None) -> int:
    args = _args(argv)
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    from jaxpar.pipeline import build

    p, m = args.stages, args.microbatches
    batch = args.rows * m
    result = {
        "host": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "devices": args.devices,
        "stages": p,
        "microbatches": m,
        "rows": args.rows,
        "seq": args.seq,
        "remat": args.remat,
        "models": {},
    }
    rest = f"data={args.devices // p}"
    for name in args.models.split(","):
        timed = functools.partial(_timed, name, args.layers, batch=batch, seq=args.seq, devices=args.devices)
        timed = functools.partial(timed, repeats=args.repeats, remat=args.remat)
        steps = {"fsdp": timed(mesh=f"fsdp={args.devices}", table=None)}
        for schedule in ("gpipe", "1f1b", "interleaved", "zero_bubble"):
            table = build(schedule, p, m, 2 if schedule == "interleaved" else 1)
            for grad_reduce, label in (("slice", "one section a tick"), ("step", "own actions")):
                run = timed(mesh=f"stage={p},{rest}", table=table, grad_reduce=grad_reduce)
                steps[f"{schedule} / {label}"] = run | {"vs_fsdp": round(run["step_s"] / steps["fsdp"]["step_s"], 3)}
                print(json.dumps({f"{name} {schedule} / {label}": steps[f"{schedule} / {label}"]}), file=sys.stderr)
        by_m = {}
        for schedule in ("gpipe", "1f1b"):
            for mm in (p, 2 * p, 4 * p):
                table = build(schedule, p, mm)
                _, _, step, compile_s = _setup(
                    name, args.layers, f"stage={p}", args.rows * mm, args.seq, table, p, args.remat, "step"
                )
                by_m[f"{schedule}/m={mm}"] = {
                    "compile_s": round(compile_s, 2),
                    "temp_bytes": step.memory_analysis().temp_size_in_bytes,
                }
        result["models"][name] = {"step": steps, "by_microbatches": by_m}
        print(json.dumps({name: result["models"][name]}), file=sys.stderr)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
