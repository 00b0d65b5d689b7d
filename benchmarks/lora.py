"""LoRA against full fine-tuning on ``llama-100m``, 8 simulated CPU devices (``fsdp=8``): the train step's
time, and its compiled memory per device: the parameters, the optimizer state and the temporaries.

The parameter and optimizer bytes are read from the compiled step's own input shardings (each state
array's shard on device 0), the temporaries from ``compiled.memory_analysis()``.

    python benchmarks/lora.py --out benchmarks/results/lora_cpu8.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

MODEL, MESH, BATCH, SEQ, RANK = "llama-100m", "fsdp=8", 8, 512, 16
TARGETS = "q,k,v,o,gate_up,down"


def shard_bytes(abstract, shardings) -> int:
    """Bytes of device 0's shards of ``abstract``'s arrays under ``shardings`` (matching pytrees)."""
    import jax

    total = 0
    for x, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
        total += int(np.prod(s.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize
    return total


def measure(mode: str, steps: int) -> dict:
    import jax
    from flax import nnx

    from jaxpar.layers.lora import LoraConfig, LoraParam
    from jaxpar.layout import make_layout
    from jaxpar.meshes import resolve_mesh_arg
    from jaxpar.models import build_model, get_execution_preset, get_model_preset
    from jaxpar.train.optim import OptimizerConfig, make_optimizer
    from jaxpar.train.step import init_train_state, make_train_step

    cfg, execution = get_model_preset(MODEL), get_execution_preset(MODEL)
    if mode == "lora":
        cfg = dataclasses.replace(cfg, lora=LoraConfig(rank=RANK, targets=TARGETS))
    layout = make_layout(cfg, resolve_mesh_arg(MESH), batch=BATCH, seq=SEQ, execution=execution)
    ts = init_train_state(
        lambda r: build_model(cfg, execution=execution, rngs=r),
        functools.partial(make_optimizer, OptimizerConfig()),
        layout,
    )
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (BATCH, SEQ + 1)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    compiled = make_train_step(ts, layout).lower(ts.state, batch).compile()
    model, opt = nnx.merge(ts.graphdef, ts.state)
    state_shardings = compiled.input_shardings[0][0]
    model_sh, opt_sh = nnx.merge(ts.graphdef, state_shardings)  # the same tree as the state
    params = shard_bytes(nnx.state(model), nnx.state(model_sh))
    trained = shard_bytes(nnx.state(model, LoraParam), nnx.state(model_sh, LoraParam)) if mode == "lora" else params
    optimizer = shard_bytes(nnx.state(opt), nnx.state(opt_sh))
    memory = compiled.memory_analysis()
    state, times = ts.state, []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics.loss)
        if i:
            times.append(time.perf_counter() - t0)
    return dict(
        mode=mode,
        lora=dict(rank=RANK, targets=TARGETS) if mode == "lora" else None,
        step_s=round(statistics.median(times), 3),
        tokens_per_s=round(BATCH * SEQ / statistics.median(times)),
        params_bytes=params,
        trained_bytes=trained,
        optimizer_bytes=optimizer,
        temp_bytes=int(memory.temp_size_in_bytes),
        argument_bytes=int(memory.argument_size_in_bytes),
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    from jaxpar.mesh import simulate_cpu_devices

    simulate_cpu_devices(8)
    rows = [measure(mode, args.steps) for mode in ("full", "lora")]
    full, lora = rows
    result = dict(
        benchmark="lora",
        model=MODEL,
        mesh=MESH,
        batch=BATCH,
        seq=SEQ,
        host=platform.machine(),
        cpus=os.cpu_count(),
        runs=rows,
        lora_over_full=dict(
            step_s=round(lora["step_s"] / full["step_s"], 3),
            optimizer_bytes=round(lora["optimizer_bytes"] / full["optimizer_bytes"], 4),
            temp_bytes=round(lora["temp_bytes"] / full["temp_bytes"], 3),
        ),
    )
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
