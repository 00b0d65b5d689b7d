"""The pipeline's compiled program, read without running it (prints one JSON object).

    python benchmarks/pipeline_program.py > benchmarks/results/pipeline_program_cpu8.json

``tiny`` (8 layers) on 8 simulated CPU devices, each stage running its own action (``grad_reduce=step``,
``jaxpar.pipeline.actions``), every schedule (interleaved with v = 2), compiled from abstract state:

(a) ``collectives``: on stage × data, stage × fsdp and stage × tensor, the step's collectives grouped by
    kind and mesh axes, split into those inside the schedule's loop (run every tick) and those run once
    a step, with their count and bytes a step; beside them the number of parameters (gradient buckets)
    and of those split over fsdp.
(b) ``memory``: on stage=4 × data=2 with a fixed microbatch (2 rows of ``--seq`` tokens), for m = p, 2p
    and 4p: the compiled temp bytes per device beside the formula of what the schedule keeps, the carry
    of the stage program: (act slots + 1) × (one microbatch's kept residuals, read from the traced
    forward, + in zero-bubble what its B hands its W + its input and its output gradient) + (grad slots
    + 1) × one cotangent. What is left over
    (the working set of one op) should not grow with m.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections import defaultdict

LAYOUTS = {"stage × data": "stage=4,data=2", "stage × fsdp": "stage=4,fsdp=2", "stage × tensor": "stage=4,tensor=2"}
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zero_bubble": 1}  # name: virtual stages


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    return p.parse_args(argv)


def _compiled(cfg, mesh: str, schedule: str, m: int, rows: int, seq: int):
    from jaxpar.analysis.plan import compile_step
    from jaxpar.layout import make_layout
    from jaxpar.meshes import resolve_mesh_arg
    from jaxpar.pipeline import build

    layout = make_layout(cfg, resolve_mesh_arg(mesh), batch=rows * m, seq=seq)
    table = build(schedule, layout.mesh.shape["stage"], m, SCHEDULES[schedule])
    return compile_step(cfg, layout, batch=rows * m, seq=seq, pipeline=table, grad_reduce="step"), layout, table


def collectives(cfg, mesh: str, schedule: str, m: int, seq: int) -> dict:
    """The step's collectives by (where, kind, axes): count and bytes a step."""
    from jaxpar.analysis.hlo import analyze_compiled
    from jaxpar.shardings import param_shardings

    compiled, layout, _ = _compiled(cfg, mesh, schedule, m, 2, seq)
    groups: dict = defaultdict(lambda: dict(count=0, bytes=0))
    for op in analyze_compiled(compiled, mesh=layout.mesh).ops:
        where = "in the loop" if op.executions > 1 or not op.trip_count_known else "once a step"
        g = groups[f"{where}: {op.kind} over {'×'.join(op.axes) or 'none'}"]
        g["count"] += op.executions
        g["bytes"] += op.bytes * op.executions
    params = param_shardings(cfg, layout).params
    fsdp = sum(any("fsdp" in str(e) for e in p.spec) for p in params)
    return dict(mesh=mesh, params=len(params), params_split_over_fsdp=fsdp, collectives=dict(sorted(groups.items())))


def carry_bytes(cfg, table, rows: int, seq: int, per_chunk: int) -> dict:
    """The stage program's buffers for ``table``: kept residuals of one microbatch (shapes of
    ``kept_vjp`` on a stage's chunk, one device's rows), in a split schedule what its B hands its W
    (``handoff_shapes``), and the activation-sized slots."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxpar.models import build_model
    from jaxpar.pipeline.actions import ABSTRACT_ACTION, ModelParts, handoff_shapes, kept_vjp
    from jaxpar.pipeline.stage import ChunkPrograms
    from jaxpar.train.loss import head_losses

    model = nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0)))
    stack = nnx.PathContains(model.pipeline_stack)
    graphdef, sp, op, sr, rest = nnx.split(model, nnx.All(nnx.Param, stack), nnx.Param, stack, ...)

    def kept(sp, op, sr, rest):
        first = lambda t: jax.tree.map(lambda a: a[:per_chunk], t)
        ids = jnp.zeros((1, rows, seq), jnp.int32)
        tokens, labels = {"ids": ids}, {"targets": ids}
        chunk = ChunkPrograms(
            graphdef, model.pipeline_stack, first(sr), rest, tokens, labels, head_losses, per_chunk, False
        )
        parts = ModelParts(chunk, first(sp), op)
        x = jnp.zeros(parts.chunk_input().shape, parts.chunk_input().dtype)
        action = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), ABSTRACT_ACTION)
        kept = kept_vjp(parts.forward, first(sp), x, action, parts.residual_split())[1]
        handoff = handoff_shapes(parts.forward, first(sp), x, action) if table.split_backward else []
        return kept, handoff

    size = lambda shapes: sum(math.prod(s.shape) * s.dtype.itemsize for s in jax.tree.leaves(shapes))
    residual, handoff = map(size, jax.eval_shape(kept, sp, op, sr, rest))
    act = rows * seq * cfg.embed_dim * 4
    per_slot = residual + handoff + 2 * act  # the kept residuals, the handoff, the chunk's input, its output gradient
    return dict(
        residual_bytes_per_microbatch=residual,
        handoff_bytes_per_microbatch=handoff,
        formula_bytes=(table.act_slots + 1) * per_slot + (table.grad_slots + 1) * act,
        act_slots=table.act_slots,
        grad_slots=table.grad_slots,
    )


def memory(cfg, schedule: str, p: int, seq: int) -> dict:
    out = {}
    for m in (p, 2 * p, 4 * p):
        compiled, layout, table = _compiled(cfg, "stage=4,data=2", schedule, m, 2, seq)
        temp = compiled.memory_analysis().temp_size_in_bytes
        carry = carry_bytes(cfg, table, 1, seq, cfg.num_layers // (p * SCHEDULES[schedule]))
        out[f"m={m}"] = dict(temp_bytes=temp, **carry, rest_bytes=temp - carry["formula_bytes"])
    return out


def main(argv=None) -> int:
    args = _args(argv)
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    from jaxpar.models import get_model_preset

    cfg = dataclasses.replace(get_model_preset(args.model), num_layers=args.layers)
    found = {
        name: {s: collectives(cfg, mesh, s, args.microbatches, args.seq) for s in SCHEDULES}
        for name, mesh in LAYOUTS.items()
    }
    kept = {s: memory(cfg, s, 4, args.seq) for s in SCHEDULES}
    command = " ".join(["python", "benchmarks/pipeline_program.py", *(argv or sys.argv[1:])])
    out = dict(benchmark="pipeline_program", command=command, model=args.model, layers=args.layers, seq=args.seq)
    print(json.dumps(out | dict(microbatches=args.microbatches, collectives=found, memory=kept), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
