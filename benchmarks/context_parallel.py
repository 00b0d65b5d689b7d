"""Ring attention (context parallelism): per-device memory against L and n, causal work balance, and a
long-context compile check. Compile only; nothing is executed.

    python benchmarks/context_parallel.py > benchmarks/results/context_parallel_cpu8.json

Prints one JSON object:

(a) ``memory``: for each L and each ring size n (the ``sequence`` axis, on simulated CPU devices), the
    per-device ``compiled.memory_analysis()`` of a jitted grad of sum(ring_attention(q, k, v)) with
    respect to q, k, v: temp, argument and output bytes, their total, and the ratio of each to the
    n = 1 value at the same L. Arguments and outputs are O(L/n); temp holds the (L/2n)² score tiles of
    one (q-half, kv-half) pair, so it falls as ~1/n² until the O(L/n) arrays dominate.
(b) ``imbalance``: per-device computed (q-half, kv-half) pairs of causal attention over the whole ring
    (``ring_work``, the kernel's own skip rule), max/mean, contiguous vs zig-zag storage.
(c) ``long_context``: a length whose dense attention fwd+bwd on one device needs more temp memory than
    ``--budget-gib`` per device (both by formula, fp32 score matrices, and by memory_analysis of the
    dense compile), compiled with ring attention over ``--long-n`` devices and checked against the budget.

Simulated devices share the host: the numbers are XLA:CPU's buffer assignment, not a GPU's, but the
scaling with L and n is the property of the algorithm.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--lengths", default="1024,2048,4096,8192")
    p.add_argument("--ns", default="1,2,4,8")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--long-length", type=int, default=32768)
    p.add_argument("--long-n", type=int, default=8)
    p.add_argument("--budget-gib", type=float, default=4.0)
    return p.parse_args(argv)


AXIS = "sequence"


def _shapes(length, args, dtype):
    import jax

    q = jax.ShapeDtypeStruct((args.batch, length, args.heads, args.head_dim), dtype)
    kv = jax.ShapeDtypeStruct((args.batch, length, args.kv_heads, args.head_dim), dtype)
    idx = jax.ShapeDtypeStruct((args.batch, length), "int32")
    return q, kv, kv, idx


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    row = dict(
        temp=int(m.temp_size_in_bytes), argument=int(m.argument_size_in_bytes), output=int(m.output_size_in_bytes)
    )
    row["total"] = row["temp"] + row["argument"] + row["output"]
    return row


def compile_ring(length: int, n: int, args, dtype="float32"):
    """Compiled fwd+bwd (grad of sum(out) w.r.t. q, k, v) of ring attention over n devices."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxpar.parallel.ring import ring_attention

    mesh = jax.make_mesh((n,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n])
    qkv, idx = P(None, AXIS, None, None), P(None, AXIS)
    body = jax.shard_map(
        lambda q, k, v, i: ring_attention(q, k, v, i, i, axis_name=AXIS),
        mesh=mesh,
        in_specs=(qkv, qkv, qkv, idx),
        out_specs=qkv,
    )
    loss = lambda q, k, v, i: body(q, k, v, i).astype("float32").sum()
    shard = lambda spec: NamedSharding(mesh, spec)
    fn = jax.jit(
        jax.grad(loss, argnums=(0, 1, 2)),
        in_shardings=(shard(qkv),) * 3 + (shard(idx),),
        out_shardings=(shard(qkv),) * 3,
    )
    return fn.lower(*_shapes(length, args, dtype)).compile()


def compile_dense(length: int, args, dtype="float32"):
    """Compiled fwd+bwd of the one-device dense oracle (full [N, L, L] score matrices)."""
    import jax

    from jaxpar.parallel.common import dense_attention

    loss = lambda q, k, v, i: dense_attention(q, k, v, i, i).astype("float32").sum()
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), in_shardings=(dev,) * 4, out_shardings=(dev,) * 3)
    return fn.lower(*_shapes(length, args, dtype)).compile()


def bench_memory(args) -> list[dict]:
    rows = []
    for length in map(int, args.lengths.split(",")):
        base = None
        for n in map(int, args.ns.split(",")):
            t0 = time.perf_counter()
            mem = _memory(compile_ring(length, n, args))
            base = base or mem
            row = dict(
                length=length,
                n=n,
                compile_s=round(time.perf_counter() - t0, 2),
                **mem,
                ratio={k: round(mem[k] / base[k], 4) for k in mem},
            )
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def bench_imbalance(args) -> list[dict]:
    from jaxpar.parallel.ring import ring_work

    rows = []
    for n in (4, 8):
        for layout in ("contiguous", "zigzag"):
            work = ring_work(64 * n, n, layout)
            rows.append(
                dict(
                    n=n,
                    layout=layout,
                    pairs_per_device=work.tolist(),
                    max_over_mean=round(float(work.max() / work.mean()), 4),
                    exact=f"{(4 * n - 1)}/{2 * n + 1}" if layout == "contiguous" else "1",
                )
            )
    return rows


def bench_long_context(args) -> dict:
    length, n, budget = args.long_length, args.long_n, int(args.budget_gib * 2**30)
    b, heads = args.batch, args.heads
    # Formula: dense attention materialises the fp32 score matrix [B, N, L, L]; its backward holds at
    # least the probabilities and their gradient, i.e. two such matrices.
    score = 4 * b * heads * length * length
    t0 = time.perf_counter()
    dense = _memory(compile_dense(length, args))
    dense_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ring = _memory(compile_ring(length, n, args))
    ring_s = time.perf_counter() - t0
    tile = 4 * b * heads * (length // (2 * n)) ** 2
    return dict(
        length=length,
        n=n,
        budget_bytes=budget,
        dense_one_device=dict(
            score_matrix_bytes_formula=score,
            fwd_bwd_bytes_formula_min=2 * score,
            compile_s=round(dense_s, 2),
            **dense,
            exceeds_budget=dense["temp"] > budget,
        ),
        ring_per_device=dict(
            score_tile_bytes_formula=tile, compile_s=round(ring_s, 2), **ring, fits_budget=ring["total"] <= budget
        ),
    )


def main(argv=None) -> int:
    args = _args(argv)
    from jaxpar.mesh import simulate_cpu_devices

    simulate_cpu_devices(args.devices)
    import jax

    t0 = time.perf_counter()
    out = dict(
        benchmark="context_parallel",
        devices=args.devices,
        shape=dict(
            batch=args.batch,
            heads=args.heads,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            dtype="float32",
            causal=True,
        ),
        jax=jax.__version__,
        host=dict(machine=platform.machine(), cpus=os.cpu_count()),
        memory=bench_memory(args),
        imbalance=bench_imbalance(args),
        long_context=bench_long_context(args),
    )
    out["total_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
