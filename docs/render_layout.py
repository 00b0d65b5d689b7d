"""Tables of docs/render.py: the mesh, the rules and the models; pipelines; context parallelism; experts."""

from __future__ import annotations

import json

from render_kit import ROOT, gb_text, load, markdown, pct, table

# --- The mesh, the rules and the models ---------------------------------------------------------------------


def _mesh_presets():
    from jaxpar.meshes import PRESETS

    return PRESETS


@table("mesh-presets")
def mesh_presets() -> str:
    """The layout presets (``jaxpar.meshes.PRESETS``): name, axis sizes, what it is."""
    rows = [[f"`{p.name}`", f"`{_golden_rules(p.name)['mesh']}`", p.doc] for p in _mesh_presets().values()]
    return markdown(["preset", "axis sizes", "layout"], rows)


def _golden_rules(name: str) -> dict:
    return json.loads((ROOT / "tests" / "golden" / "rules" / f"{name}.json").read_text())


GROUPS = {"params": "parameters", "activations": "activations", "cache": "KV cache"}


@table("logical-axes")
def logical_axes() -> str:
    """The logical axes, by group, as every preset's golden rules table lists them."""
    rules = _golden_rules("dp")
    rows = [
        [GROUPS[group], len(axes), ", ".join(f"`{a}`" for a in axes)]
        for group, axes in rules.items()
        if group in GROUPS
    ]
    rows.append(["**all**", sum(r[1] for r in rows), ""])
    return markdown(["group", "axes", "names"], rows, "lrl")


@table("rules-matrix")
def rules_matrix() -> str:
    """Every preset's rules table (``tests/golden/rules/PRESET.json``): one row per logical axis."""
    presets = list(_mesh_presets())
    tables = {p: _golden_rules(p) for p in presets}
    cell = lambda axes: "·".join(axes) if axes else "–"
    rows = [["*axis sizes*", *(f"`{tables[p]['mesh']}`" for p in presets)]]
    for group in GROUPS:
        for axis in tables[presets[0]][group]:
            rows.append([f"`{axis}`", *(cell(tables[p][group][axis]) for p in presets)])
    return markdown(["logical axis", *(f"`{p}`" for p in presets)], rows)


def _model_rows(moe: bool) -> list[list]:
    from jaxpar.models import PRESETS, PUBLISHED_PARAMS

    rows = []
    for name, cfg in PRESETS.items():
        if hasattr(cfg, "moe") != moe:
            continue
        ours, published = cfg.num_params(), PUBLISHED_PARAMS.get(name)
        note = " (tied embeddings)" if getattr(cfg, "tie_embeddings", False) else ""
        if published is None:
            shown = "– (tests)" if name.startswith("tiny") else "– (benchmarks)"
        elif published == ours:
            shown = f"{published:,}"
        else:  # values a checkpoint stores that the model keeps as state, not parameters
            shown = f"{published:,} (with {published - ours:,} values kept as state)"
        rows.append([f"`{name}`{note}", f"{ours:,}", shown])
    return rows


@table("models-dense")
def models_dense() -> str:
    return markdown(["preset", "parameters", "published"], _model_rows(moe=False), "lrr")


@table("models-moe")
def models_moe() -> str:
    return markdown(["preset", "parameters", "published"], _model_rows(moe=True), "lrr")


# --- Pipelines ----------------------------------------------------------------------------------------------

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zero_bubble"]


def _pipeline(model: str) -> tuple[dict, dict]:
    path = {"tiny": "pipeline_cpu8_tiny.json", "llama-100m": "pipeline_cpu8_llama100m.json"}[model]
    data = load(path)
    return data, data["models"][model]


EXECUTORS = ["one section a tick", "own actions"]


@table("pipeline-bubbles")
def pipeline_bubbles() -> str:
    """The four schedules at the benchmark's p and m: ideal, lockstep and both executors' bubbles, inputs
    in flight."""
    data, m = _pipeline("tiny")
    rows = []
    for s in SCHEDULES:
        runs = [m["step"][f"{s} / {e}"] for e in EXECUTORS]
        rows.append(
            [
                f"`{s}`",
                pct(runs[0]["bubble"]),
                pct(runs[0]["lockstep_bubble"]),
                *(pct(r["executor_bubble"]) for r in runs),
                " ".join(str(n) for n in runs[0]["peak_in_flight"]),
            ]
        )
    header = [
        f"p = {data['stages']}, m = {data['microbatches']}",
        "ideal bubble",
        "lockstep",
        *(f"executor: {e}" for e in EXECUTORS),
        "stage inputs in flight, per stage",
    ]
    return markdown(header, rows, "lrrrrl")


def _pipeline_steps(model: str) -> str:
    _, m = _pipeline(model)
    step = m["step"]
    rows = [
        [
            "`fsdp`",
            f"`{step['fsdp']['mesh']}`",
            "–",
            f"{step['fsdp']['step_s']:.3g}",
            "1",
            f"{step['fsdp']['cpu_s']:.3g}",
            f"{step['fsdp']['compile_s']:.1f}",
        ]
    ]
    for s in SCHEDULES:
        for e in EXECUTORS:
            r = step[f"{s} / {e}"]
            rows.append(
                [
                    f"`{s}`",
                    f"`{r['mesh']}`",
                    e,
                    f"{r['step_s']:.3g}",
                    f"{r['vs_fsdp']:.2f}",
                    f"{r['cpu_s']:.3g}",
                    f"{r['compile_s']:.1f}",
                ]
            )
    head = ["schedule", "mesh", "executor", "step (s)", "× fsdp", "CPU (s)", "compile (s)"]
    return markdown(head, rows, "lllrrrr")


@table("pipeline-tiny")
def pipeline_tiny() -> str:
    return _pipeline_steps("tiny")


@table("pipeline-llama-100m")
def pipeline_llama() -> str:
    return _pipeline_steps("llama-100m")


@table("pipeline-plan-70b")
def pipeline_plan_70b() -> str:
    """The lab's step breakdown of one pipeline layout under both executors."""
    data = load("pipeline_plan_70b.json")
    names = list(data["runs"])
    runs = [data["runs"][n] for n in names]
    durations = lambda d: ", ".join(f"{k} {v:.2f}" for k, v in d.items())
    parts = sorted({k for r in runs for k, v in r["parts_s"].items() if v and k != "step_s"})
    rows = [
        ["executor", *(r["pipeline"]["executor"] for r in runs)],
        ["durations (chunk forwards)", *(durations(r["pipeline"]["durations"]) for r in runs)],
        ["bubble: executor", *(pct(r["pipeline"]["executor_bubble_fraction"]) for r in runs)],
        [
            "bubble: lockstep / ideal",
            *(
                f"{pct(r['pipeline']['lockstep_bubble_fraction'])} / {pct(r['pipeline']['bubble_fraction'])}"
                for r in runs
            ),
        ],
        [
            "FLOPs per device (× model FLOPs)",
            *(f"{r['flops_per_device']:.3g} ({r['flops_per_device'] / r['model_flops_per_device']:.2f})" for r in runs),
        ],
        *([f"{k.removesuffix('_s')} (s)", *(f"{r['parts_s'].get(k, 0.0):.2f}" for r in runs)] for k in parts),
        ["data-axis bytes per device (GB)", *(f"{r['bytes_by_axis_gb'].get('data', 0.0):.1f}" for r in runs)],
        ["activations per device (GB)", *(f"{r['memory_gb']['activations']:.1f}" for r in runs)],
        ["step (s)", *(f"{r['step_s']:.1f}" for r in runs)],
        ["tokens/s (MFU)", *(f"{r['tokens_per_s']:,} ({pct(r['mfu'])})" for r in runs)],
    ]
    head = [f"{n.split(' / ')[0]}, `--grad-reduce {n.split(' / ')[1]}`" for n in names]
    return markdown(["", *head], rows, "l" + "r" * len(names))


@table("pipeline-microbatches")
def pipeline_microbatches() -> str:
    """Compile time and compiled temp memory against m, GPipe and 1F1B, both models."""
    rows = []
    for model in ("tiny", "llama-100m"):
        _, m = _pipeline(model)
        by = m["by_microbatches"]
        ms = sorted({int(k.split("=")[1]) for k in by})
        for s in ("gpipe", "1f1b"):
            runs = [by[f"{s}/m={n}"] for n in ms]
            rows.append(
                [
                    f"`{model}`",
                    s,
                    " / ".join(str(n) for n in ms),
                    " / ".join(f"{r['compile_s']:.1f}" for r in runs),
                    " / ".join(f"{r['temp_bytes'] / 1e6:.2f}" for r in runs),
                ]
            )
    return markdown(["model", "schedule", "m", "compile s", "temp MB per device"], rows, "llrrr")


def _groups(collectives: dict, where: str) -> str:
    """The collectives of one ``where`` ("in the loop", "once a step") as "kind over axes ×count"."""
    found = [(k.split(": ", 1)[1], v["count"]) for k, v in collectives.items() if k.startswith(where)]
    return "; ".join(f"{name} ×{count}" for name, count in found) or "none"


@table("pipeline-collectives")
def pipeline_collectives() -> str:
    """The compiled step's collectives inside the schedule's loop and once a step, per layout and schedule."""
    data = load("pipeline_program_cpu8.json")
    rows = []
    for schedules in data["collectives"].values():
        for s, r in schedules.items():
            params = f"{r['params']} ({r['params_split_over_fsdp']} split over fsdp)"
            loop, once = (_groups(r["collectives"], w) for w in ("in the loop", "once a step"))
            rows.append([f"`{r['mesh']}`", f"`{s}`", loop, once, params])
    header = ["mesh", "schedule", "inside the schedule's loop (a step's executions)", "once a step", "parameters"]
    return markdown(header, rows, "llllr")


@table("pipeline-memory-formula")
def pipeline_memory_formula() -> str:
    """Compiled temp memory against m beside the stage program's carry, as the formula counts it."""
    data = load("pipeline_program_cpu8.json")
    rows = []
    for s, by_m in data["memory"].items():
        for m, r in by_m.items():
            mb = lambda x: f"{x / 1e6:.3f}"
            kept = mb(r["residual_bytes_per_microbatch"])
            handoff = r.get("handoff_bytes_per_microbatch", 0)
            slots = f"{r['act_slots']} × ({kept} + {mb(handoff)})" if handoff else f"{r['act_slots']} × {kept}"
            rows.append(
                [f"`{s}`", m.split("=")[1], mb(r["temp_bytes"]), slots, mb(r["formula_bytes"]), mb(r["rest_bytes"])]
            )
    header = ["schedule", "m", "temp MB", "act slots × (residuals + handoff) MB", "carry MB (formula)", "rest MB"]
    return markdown(header, rows, "lrrrrr")


# --- Context parallelism ------------------------------------------------------------------------------------


@table("cp-memory")
def cp_memory() -> str:
    """Ring attention fwd+bwd memory per device, as a ratio to one device at the same L."""
    data = load("context_parallel_cpu8.json")
    by = {(r["length"], r["n"]): r for r in data["memory"]}
    lengths, ns = sorted({k[0] for k in by}), sorted({k[1] for k in by} - {1})
    rows = [[f"{L:,}", gb_text(by[L, 1]["total"]), *(f"{by[L, n]['ratio']['total']:.3f}" for n in ns)] for L in lengths]
    return markdown(["L", "one device", *(f"sequence={n}" for n in ns)], rows, "r" * (2 + len(ns)))


@table("cp-imbalance")
def cp_imbalance() -> str:
    data = load("context_parallel_cpu8.json")
    rows = [
        [r["n"], r["layout"], " ".join(map(str, r["pairs_per_device"])), f"{r['max_over_mean']:.3f}", r["exact"]]
        for r in data["imbalance"]
    ]
    return markdown(["n", "storage order", "pairs per device", "max / mean", "exactly"], rows, "rlrrr")


@table("cp-long")
def cp_long() -> str:
    data = load("context_parallel_cpu8.json")["long_context"]
    dense, ring = data["dense_one_device"], data["ring_per_device"]
    rows = [
        ["one device, dense attention", gb_text(dense["total"]), gb_text(dense["score_matrix_bytes_formula"]), "no"],
        [
            f"`sequence={data['n']}`, ring, per device",
            gb_text(ring["total"]),
            gb_text(ring["score_tile_bytes_formula"]),
            "yes",
        ],
    ]
    header = [f"L = {data['length']:,}", "compiled memory", "scores (one matrix or tile)", "fits 4 GiB"]
    return markdown(header, rows, "lrrl")


# --- Mixture of experts -------------------------------------------------------------------------------------


@table("moe-dropped")
def moe_dropped() -> str:
    data = load("moe_cpu8.json")["dropped"]
    skews, cfs = sorted({r["skew_nats"] for r in data}), sorted({r["capacity_factor"] for r in data})
    by = {(r["skew_nats"], r["capacity_factor"]): r for r in data}
    rows = [
        [
            f"{s:g} nat{'' if s == 1 else 's'}",
            f"{by[s, cfs[0]]['hottest_share']:.3f}",
            *(pct(by[s, c]["dropped_fraction"]) for c in cfs),
        ]
        for s in skews
    ]
    return markdown(
        ["hot-expert skew", "hottest expert's share", *(f"cf {c:g}" for c in cfs)], rows, "l" + "r" * (1 + len(cfs))
    )


@table("moe-dispatch")
def moe_dispatch() -> str:
    data = load("moe_cpu8.json")["dispatch"]
    rows = [
        [f"`{r['mesh']}`", r["ep"], f"{r['all_to_all_sent_bytes']:,}", f"{r['formula_bytes']:,}", f"{r['ratio']:g}"]
        for r in data
    ]
    return markdown(["mesh", "ep", "all-to-all bytes sent per device per step", "formula", "ratio"], rows, "lrrrr")


@table("moe-step")
def moe_step() -> str:
    data = load("moe_cpu8.json")["step_time"]
    rows = [
        [
            r["mode"],
            f"`{r['mesh']}`",
            f"{r['median_step_s']:.4f}",
            f"{r['min_step_s']:.4f}",
            f"{r['tokens_per_s']:,.0f}",
        ]
        for r in data
    ]
    return markdown(["mode", "mesh", "median step s", "fastest step s", "tokens/s (median)"], rows, "llrrr")
