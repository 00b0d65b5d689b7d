"""Packed documents (``data.pack=documents``): how full the rows are, and whether the loader keeps up.

1. **Packing efficiency.** A synthetic chat corpus whose lengths follow a log-normal distribution
   (median 400 tokens, σ = 1: a few short turns, a long tail clipped at 16,384), half its tokens trained.
   Per row length: the share of row tokens that hold documents when packed (``plan_rows``), against one
   document per row padded (and truncated) to the row, as a trainer without packing lays them out.
2. **The loader against the step.** Tokens per second the loader yields (8 rows per batch, grain's 2
   read threads, this process alone), against the tokens per second ``llama-100m``'s train step consumes
   on 8 simulated CPU devices (``fsdp=8``) on the same packed batches.

    python benchmarks/data_loader.py --out benchmarks/results/data_loader_cpu8.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

DOCS, MEDIAN, SIGMA, LONGEST = 20_000, 400, 1.0, 16_384


def corpus(folder: Path, seed: int = 0) -> tuple[Path, np.ndarray]:
    """Token files as ``jaxpar prepare --field messages`` writes them: ids, document offsets, loss mask."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(MEDIAN), SIGMA, DOCS).astype(np.int64), 8, LONGEST)
    ids = rng.integers(3, 32_000, int(lengths.sum()), dtype=np.uint16)
    np.save(folder / "c.npy", ids)
    np.save(folder / "c.docs.npy", np.concatenate([[0], np.cumsum(lengths)]))
    np.save(folder / "c.mask.npy", (rng.random(len(ids)) < 0.5).astype(np.uint8))
    return folder / "c.npy", lengths


def packing(lengths: np.ndarray, seqs) -> list[dict]:
    from jaxpar.data import plan_rows

    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    rows = []
    for seq in seqs:
        plan = plan_rows(starts, lengths, seq + 1)
        padded = float(np.minimum(lengths, seq + 1).sum()) / (len(lengths) * (seq + 1))
        rows.append(
            dict(
                seq=seq,
                packed_rows=plan.rows,
                packed_filled=round(plan.filled(seq + 1), 4),
                padded_rows=len(lengths),
                padded_filled=round(padded, 4),
                truncated_tokens=int(np.maximum(lengths - (seq + 1), 0).sum()),
            )
        )
    return rows


def loader_rate(path: Path, *, seq: int, batch: int, batches: int) -> dict:
    from jaxpar.data import DataConfig, make_loader

    cfg = DataConfig(source="files", path=str(path), pack="documents", eval_fraction=0.01)
    loader = make_loader(cfg, vocab_size=32_000, seq=seq, global_batch=batch, seed=0)
    next(loader)  # the plan and the first reads
    t0 = time.perf_counter()
    for _ in range(batches):
        next(loader)
    seconds = time.perf_counter() - t0
    return dict(
        seq=seq,
        batch=batch,
        batches=batches,
        seconds=round(seconds, 3),
        tokens_per_s=round(batches * batch * seq / seconds),
    )


def step_rate(path: Path, *, seq: int, batch: int, steps: int) -> dict:
    """``llama-100m``'s train step on 8 simulated devices (fsdp=8), fed the loader's packed batches."""
    import functools

    import jax

    from jaxpar.data import DataConfig, make_loader, to_global
    from jaxpar.layout import make_layout
    from jaxpar.meshes import resolve_mesh_arg
    from jaxpar.models import build_model, get_execution_preset, get_model_preset
    from jaxpar.train.loss import BATCH_KEYS
    from jaxpar.train.optim import OptimizerConfig, make_optimizer
    from jaxpar.train.step import batch_sharding, init_train_state, make_train_step

    cfg, execution = get_model_preset("llama-100m"), get_execution_preset("llama-100m")
    layout = make_layout(cfg, resolve_mesh_arg("fsdp=8"), batch=batch, seq=seq, execution=execution)
    make = lambda r: build_model(cfg, execution=execution, rngs=r)
    ts = init_train_state(make, functools.partial(make_optimizer, OptimizerConfig()), layout)
    step = make_train_step(ts, layout)
    data = DataConfig(source="files", path=str(path), pack="documents", eval_fraction=0.01)
    loader = make_loader(data, vocab_size=cfg.vocab_size, seq=seq, global_batch=batch, seed=0)
    sharding = batch_sharding(layout, BATCH_KEYS)
    state, times = ts.state, []
    for i in range(steps + 1):
        batch_arrays = to_global(next(loader), sharding)
        t0 = time.perf_counter()
        state, metrics = step(state, batch_arrays)
        jax.block_until_ready(metrics.loss)
        if i:  # the first step compiles
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    return dict(
        model="llama-100m",
        mesh="fsdp=8",
        seq=seq,
        batch=batch,
        steps=steps,
        step_s=round(step_s, 3),
        tokens_per_s=round(batch * seq / step_s),
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    from jaxpar.mesh import simulate_cpu_devices

    simulate_cpu_devices(8)
    with tempfile.TemporaryDirectory() as tmp:
        path, lengths = corpus(Path(tmp))
        result = dict(
            benchmark="data_loader",
            host=platform.machine(),
            cpus=os.cpu_count(),
            corpus=dict(
                documents=DOCS,
                tokens=int(lengths.sum()),
                median=int(np.median(lengths)),
                p90=int(np.percentile(lengths, 90)),
                longest=int(lengths.max()),
                distribution=f"log-normal, median {MEDIAN}, sigma {SIGMA}, clipped to [8, {LONGEST}]",
            ),
            packing=packing(lengths, (512, 2048, 8192)),
            loader=loader_rate(path, seq=512, batch=8, batches=200),
            train_step=step_rate(path, seq=512, batch=8, steps=args.steps),
        )
    result["loader_over_step"] = round(result["loader"]["tokens_per_s"] / result["train_step"]["tokens_per_s"], 1)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
