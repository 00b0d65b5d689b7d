"""Tokens/s of jaxpar's train step against a hand-written plain-JAX step: same model, layout and run.

    python benchmarks/overhead.py --model tiny --devices 8 --meshes dp,fsdp,tp,3d > overhead.json
    python benchmarks/overhead.py --model llama-100m --layers 2 --meshes 3d --batch 8 --seq 64

The reference (``benchmarks/plain_llama.py``) is the step a user would write without jaxpar: a function
over a dict of arrays, ``jax.lax.scan`` + ``jax.checkpoint`` over the stacked layers, sharding constraints
by hand, optax AdamW after clipping, ``jax.jit`` with explicit shardings and the state donated. It starts
from the very parameters our sharded init produced (``nnx.to_pure_dict``), laid out with the same
NamedShardings, and trains on the same batch.

Per mesh preset:
1. correctness: two steps of each from the same state; loss and grad norm must agree to rtol 1e-5 and
   the parameters after each step to 1e-5 of their largest magnitude (``loss_match``; the second step
   matters: AdamW's first update is about -lr·sign(g) and would hide a wrong gradient scale);
2. the compiled programs: per-device collective totals (``jaxpar.analysis``), FLOPs, transcendentals,
   bytes accessed, whether the optimized HLO modules are the same text once names are stripped, and
   the per-opcode instruction-count difference (``hlo_opcode_diff``, ours minus the reference);
3. timing: after a warm-up, ``--rounds`` rounds, each one block of ``--steps`` steps of ours, of the
   reference, and of the reference again from a copy of its state (same executable); the order rotates
   and reverses from round to round. Per-step time of each block; the median over blocks gives
   tokens/s and ``overhead = ours_time / ref_time - 1``. ``overhead_paired`` is the median of the
   per-round ratios (robust to load that drifts during the run), ``overhead_min`` the ratio of the
   fastest blocks, and ``null_overhead_paired`` the same paired ratio for reference vs reference: the
   noise floor of the machine. A gap is a gap only when it stands clear of that floor;
4. host side: the time to flatten each step's argument pytree (the per-call work outside the program).

``--ref-constraints residual`` pins only the residual stream (and the batch) in the reference and lets
GSPMD propagate the rest; the default ``all`` pins the same activations our model does. Simulated CPU
devices share the host's cores: the numbers compare the two steps with each other, not with hardware.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

RTOL = 1e-5


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--layers", type=int, default=None, help="override num_layers (dataclasses.replace)")
    p.add_argument("--meshes", default="dp,fsdp,tp,3d")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=4, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=10, help="timed blocks of each program, interleaved")
    p.add_argument("--ref-constraints", choices=("all", "residual", "none"), default="all")
    return p.parse_args(argv)


# --------------------------------------------------------------------------------- shared set-up
def activation_specs(layout, which: str = "all"):
    """The reference's PartitionSpecs, read once from our layout (the same specs a user would write).

    ``all``: every activation our model pins; ``residual``: the residual stream only; ``none``: nothing."""
    from plain_llama import ActivationSpecs

    s = layout.rules.spec
    resid = dict(mesh=layout.mesh, tokens=s(("batch", "length")), resid=s(("batch", "length", "act_embed")))
    if which == "none":
        return ActivationSpecs()
    if which == "residual":
        return ActivationSpecs(**resid)
    return ActivationSpecs(
        **resid,
        inner=s(("batch", "inner_length", "act_embed")),
        q=s(("batch", "inner_length", "act_heads", None)),
        kv=s(("batch", "inner_length", "act_kv_heads", None)),
        gate_up=s(("batch", "inner_length", None, "act_mlp")),
        hidden=s(("batch", "inner_length", "act_mlp")),
        logits=s(("batch", "inner_length", "act_vocab")),
    )


def reference_hyperparameters(opt_cfg) -> dict:
    """Our optimizer's settings as the reference's keywords: a constant learning rate (the reference
    takes a float, as a hand-written step would; ours evaluates a constant schedule)."""
    if opt_cfg.schedule != "constant" or opt_cfg.warmup_steps:
        raise ValueError(
            f"overhead: the reference has a constant learning rate, not schedule="
            f"{opt_cfg.schedule!r} with warmup_steps={opt_cfg.warmup_steps}"
        )
    return dict(
        learning_rate=opt_cfg.learning_rate,
        b1=opt_cfg.b1,
        b2=opt_cfg.b2,
        eps=opt_cfg.eps,
        weight_decay=opt_cfg.weight_decay,
        clip_norm=opt_cfg.clip_norm,
    )


def copy_tree(tree):
    import jax

    return jax.tree.map(lambda a: jax.device_put(a, a.sharding, may_alias=False), tree)


def build_pair(
    cfg,
    layout,
    *,
    batch: int,
    seq: int,
    seed: int = 0,
    ref_constraints: str = "all",
    init_compiler_options: dict | None = None,
    execution=None,
):
    """Our state and step, the reference's state and step from the same parameters, and one batch.

    ``init_compiler_options``: XLA options for compiling our sharded init (the tests use cheaper LLVM
    settings); ``None`` runs ``init_train_state`` as a user would."""
    import functools

    import jax
    import numpy as np
    import plain_llama
    from flax import nnx
    from jax.sharding import NamedSharding

    from jaxpar.models import ExecutionConfig, build_model
    from jaxpar.train.optim import OptimizerConfig, make_optimizer
    from jaxpar.train.step import TrainState, init_program, init_train_state, make_train_step

    opt_cfg = OptimizerConfig()
    make = (lambda r: build_model(cfg, execution=execution, rngs=r), functools.partial(make_optimizer, opt_cfg), layout)
    if init_compiler_options is None:
        ts = init_train_state(*make, seed=seed)
    else:
        program = init_program(*make, seed=seed)
        with layout.activate():
            state = program.create.lower().compile(compiler_options=init_compiler_options)()
        ts = TrainState(program.graphdef, state, program.shardings)
    model, _ = nnx.merge(ts.graphdef, ts.state)
    params = copy_tree(nnx.to_pure_dict(nnx.state(model, nnx.Param)))  # ours gets donated
    sp = activation_specs(layout, ref_constraints)
    tx = plain_llama.make_optimizer(**reference_hyperparameters(opt_cfg))
    tokens_sharding = NamedSharding(layout.mesh, layout.rules.spec(("batch", "length")))
    hyper = plain_llama.Hyper(cfg, execution or ExecutionConfig())
    ref_step = plain_llama.make_train_step(
        hyper, tx, params, {"inputs": tokens_sharding, "targets": tokens_sharding}, sp
    )
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, seq + 1), dtype=np.int32)
    data = {
        "inputs": jax.device_put(tokens[:, :-1], tokens_sharding),
        "targets": jax.device_put(tokens[:, 1:], tokens_sharding),
    }
    return dict(
        ts=ts, ours=make_train_step(ts, layout), ref_state=plain_llama.init_state(tx, params), ref=ref_step, batch=data
    )


def our_params(graphdef, state):
    from flax import nnx

    return nnx.to_pure_dict(nnx.state(nnx.merge(graphdef, state)[0], nnx.Param))


def param_rel_diff(a, b) -> float:
    """max |a - b| over all leaves, divided by max |a| (both trees of plain arrays, same keys)."""
    import jax
    import numpy as np

    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b), "parameter trees differ"
    diff = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(la, lb))
    scale = max(float(np.max(np.abs(np.asarray(x)))) for x in la)
    return diff / scale


def compare_steps(ours, ts, ref, ref_state, batch, *, steps: int = 2):
    """Run ``steps`` steps of both from the same start; per step: losses, grad norms, param rel diff.

    Returns ``(rows, our_state, ref_state)`` so that the caller can keep training both."""
    state, rows = ts.state, []
    for _ in range(steps):
        state, m = ours(state, batch)
        ref_state, (loss, gnorm) = ref(ref_state, batch)
        rows.append(
            dict(
                loss_ours=float(m.loss),
                loss_ref=float(loss),
                grad_norm_ours=float(m.grad_norm),
                grad_norm_ref=float(gnorm),
                param_rel_diff=param_rel_diff(our_params(ts.graphdef, state), ref_state[0]),
            )
        )
    return rows, state, ref_state


def rows_match(rows, rtol: float = RTOL) -> bool:
    def close(a, b):
        return abs(a - b) <= rtol * abs(b)

    return all(
        close(r["loss_ours"], r["loss_ref"])
        and close(r["grad_norm_ours"], r["grad_norm_ref"])
        and r["param_rel_diff"] <= rtol
        for r in rows
    )


# ------------------------------------------------------------------------------------ measurement
_NAMES = re.compile(r"%[\w.\-]+|\bmetadata=\{[^}]*\}|, op_name=\"[^\"]*\"|channel_id=\d+|^HloModule.*$", re.M)


def _hlo_body(compiled) -> str:
    """Optimized HLO with instruction names, metadata and channel ids removed (comparable text)."""
    return _NAMES.sub("", compiled.as_text())


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?\S+\s*=\s*(?:\(.*?\)|\S+)\s+([a-z][a-z0-9\-]*)\(", re.M)


def opcode_counts(compiled) -> collections.Counter:
    """How many instructions of each opcode the optimized HLO holds (fused computations included)."""
    return collections.Counter(_INSTR.findall(compiled.as_text()))


def opcode_diff(ours, ref) -> dict:
    """Opcodes whose instruction counts differ: ours minus the reference's."""
    a, b = opcode_counts(ours), opcode_counts(ref)
    return {op: a[op] - b[op] for op in sorted(set(a) | set(b)) if a[op] != b[op]}


def compiled_report(compiled, mesh) -> dict:
    from jaxpar.analysis import analyze_compiled

    r = analyze_compiled(compiled, mesh=mesh)
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return dict(
        collectives=r.collectives.to_json()["by_kind"],
        collective_bytes=r.collectives.total_bytes,
        flops=r.flops,
        transcendentals=float(cost.get("transcendentals", 0.0)),
        bytes_accessed=r.bytes_accessed,
        temp_bytes=r.memory.get("temp_size_in_bytes"),
        hlo_instructions=sum(opcode_counts(compiled).values()),
    )


def flatten_us(args, repeat: int = 2000) -> float:
    """Microseconds to flatten ``args`` into leaves (the pytree work of every jit call)."""
    import jax

    t0 = time.perf_counter()
    for _ in range(repeat):
        jax.tree_util.tree_flatten(args)
    return (time.perf_counter() - t0) / repeat * 1e6


def time_interleaved(fns: dict, states: dict, data, *, steps: int, rounds: int):
    """Per-step seconds of each program over ``rounds`` timed blocks of ``steps`` steps.

    The reference runs twice per round from two copies of its state ("ref" and "ref_again", the same
    executable): their ratio is the A/A noise floor of this machine. The order inside a round rotates
    and reverses from round to round, so no program always runs first."""
    import jax

    fns = {**fns, "ref_again": fns["ref"]}
    states = {**states, "ref_again": copy_tree(states["ref"])}
    times = {k: [] for k in fns}

    def block(name):
        st, t0 = states[name], time.perf_counter()
        for _ in range(steps):
            st, metrics = fns[name](st, data)
        jax.block_until_ready((st, metrics))
        states[name] = st
        return (time.perf_counter() - t0) / steps

    for name in fns:  # warm-up (ours and ref already ran twice before)
        block(name)
    names = list(fns)
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order[::-1] if r % 2 else order:
            times[name].append(block(name))
    return times, states


def bench_mesh(cfg, mesh_name: str, *, batch: int, seq: int, steps: int, rounds: int, ref_constraints: str) -> dict:
    import jax

    from jaxpar.layout import make_layout
    from jaxpar.meshes import resolve_mesh_arg

    layout = make_layout(cfg, resolve_mesh_arg(mesh_name), batch=batch, seq=seq)
    pair = build_pair(cfg, layout, batch=batch, seq=seq, ref_constraints=ref_constraints)
    data = pair["batch"]
    t0 = time.perf_counter()
    ours = pair["ours"].lower(pair["ts"].state, data).compile()
    ours_compile = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = pair["ref"].lower(pair["ref_state"], data).compile()
    ref_compile = time.perf_counter() - t0

    check, state, ref_state = compare_steps(ours, pair["ts"], ref, pair["ref_state"], data)
    same_hlo = _hlo_body(ours) == _hlo_body(ref)
    rep_ours, rep_ref = compiled_report(ours, layout.mesh), compiled_report(ref, layout.mesh)

    times, states = time_interleaved(
        {"ours": ours, "ref": ref}, {"ours": state, "ref": ref_state}, data, steps=steps, rounds=rounds
    )
    med = {k: statistics.median(v) for k, v in times.items()}
    paired = statistics.median(a / b for a, b in zip(times["ours"], times["ref"])) - 1
    null = statistics.median(a / b for a, b in zip(times["ref_again"], times["ref"])) - 1
    tokens = batch * seq
    state, ref_state = states["ours"], states["ref"]
    return dict(
        mesh=mesh_name,
        ours_tokens_per_s=round(tokens / med["ours"], 1),
        ref_tokens_per_s=round(tokens / med["ref"], 1),
        overhead=round(med["ours"] / med["ref"] - 1, 4),
        loss_match=rows_match(check),
        overhead_paired=round(paired, 4),
        overhead_min=round(min(times["ours"]) / min(times["ref"]) - 1, 4),
        null_overhead_paired=round(null, 4),
        step_s={k: [round(t, 5) for t in v] for k, v in times.items()},
        check=check,
        same_hlo=same_hlo,
        hlo_opcode_diff=opcode_diff(ours, ref),
        collectives_match=rep_ours["collectives"] == rep_ref["collectives"],
        flops_ours=rep_ours["flops"],
        flops_ref=rep_ref["flops"],
        transcendentals_ours=rep_ours["transcendentals"],
        transcendentals_ref=rep_ref["transcendentals"],
        compiled_ours=rep_ours,
        compiled_ref=rep_ref,
        compile_s_ours=round(ours_compile, 2),
        compile_s_ref=round(ref_compile, 2),
        flatten_us_ours=round(flatten_us((state, data)), 1),
        flatten_us_ref=round(flatten_us((ref_state, data)), 1),
        state_leaves_ours=len(jax.tree.leaves(state)),
        state_leaves_ref=len(jax.tree.leaves(ref_state)),
    )


def cpu_name() -> str:
    """The CPU's model name (Linux), or what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv=None) -> int:
    args = _args(argv)
    from jaxpar.mesh import simulate_cpu_devices

    simulate_cpu_devices(args.devices)
    import dataclasses

    import jax

    from jaxpar.models import get_model_preset

    cfg = get_model_preset(args.model)
    if args.layers is not None:
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    rows = []
    for mesh in args.meshes.split(","):
        rows.append(
            bench_mesh(
                cfg,
                mesh,
                batch=args.batch,
                seq=args.seq,
                steps=args.steps,
                rounds=args.rounds,
                ref_constraints=args.ref_constraints,
            )
        )
        r = rows[-1]
        print(
            f"{mesh}: ours {r['ours_tokens_per_s']} tok/s, ref {r['ref_tokens_per_s']} tok/s, "
            f"overhead {r['overhead']:+.2%} (paired {r['overhead_paired']:+.2%}, "
            f"A/A {r['null_overhead_paired']:+.2%}), "
            f"loss_match {r['loss_match']}, collectives_match {r['collectives_match']}",
            file=sys.stderr,
            flush=True,
        )
    out = dict(
        benchmark="overhead",
        model=args.model,
        layers=cfg.num_layers,
        devices=args.devices,
        batch=args.batch,
        seq=args.seq,
        steps=args.steps,
        rounds=args.rounds,
        ref_constraints=args.ref_constraints,
        results=rows,
        jax=jax.__version__,
        cpu=dict(name=cpu_name(), machine=platform.machine(), cpus=os.cpu_count()),
    )
    print(json.dumps(out, indent=1))
    return 0 if all(r["loss_match"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
