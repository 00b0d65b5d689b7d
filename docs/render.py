"""Tables of the documentation that come from data: measured results, golden files, the code's own presets.

A page asks for a table with a marker line, ``<!-- table: NAME -->``, and for one figure of the validation
notes with ``<!-- value: NAME FORMAT -->``; ``docs/hooks.py`` substitutes both when mkdocs builds the site.
Every table here is a function of files in the repository (``benchmarks/results/*.json``,
``benchmarks/published_runs.json``, ``tests/golden/``, the notebooks' metadata) or of the presets in the
code, so no measured number is typed into a page by hand.

    python docs/render.py                  # the names of the tables
    python docs/render.py moe-dropped      # one table, as the site shows it
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
REPO = "https://github.com/jaxpar/jaxpar/blob/main"

TABLES: dict[str, Callable[[], str]] = {}


def table(name: str):
    def register(fn):
        TABLES[name] = fn
        return fn

    return register


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def markdown(header: list[str], rows: list[list], align: str = "") -> str:
    """A markdown table; ``align`` has one letter per column, l or r (default: l for all)."""
    align = align or "l" * len(header)
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = [header, rule, *rows]
    return "\n".join("| " + " | ".join(str(c) for c in line) + " |" for line in lines)


def pct(x: float, digits: int = 1, sign: bool = False) -> str:
    return f"{100 * x:{'+' if sign else ''}.{digits}f}%"


def mesh_text(mesh: dict) -> str:
    return ",".join(f"{a}={n}" for a, n in mesh.items()) or "one device"


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


@table("pipeline-bubbles")
def pipeline_bubbles() -> str:
    """The four schedules at the benchmark's p and m: ideal, lockstep and executor bubble, inputs in flight."""
    data, m = _pipeline("tiny")
    rows = []
    for s in SCHEDULES:
        r = m["step"][s]
        rows.append(
            [
                f"`{s}`",
                pct(r["bubble"]),
                pct(r["lockstep_bubble"]),
                pct(r["executor_bubble"]),
                " ".join(str(n) for n in r["peak_in_flight"]),
            ]
        )
    header = [
        f"p = {data['stages']}, m = {data['microbatches']}",
        "ideal bubble",
        "lockstep",
        "executor",
        "stage inputs in flight, per stage",
    ]
    return markdown(header, rows, "lrrrl")


def _pipeline_steps(model: str, bubbles: bool) -> str:
    _, m = _pipeline(model)
    step = m["step"]
    cols = ["fsdp", *SCHEDULES]
    head = [f"`{step['fsdp']['mesh']}`", *(f"{s} ({step[s]['mesh']})" for s in SCHEDULES)]
    rows = [
        ["step time (s)", *(f"{step[c]['step_s']:.3g}" for c in cols)],
        ["compile (s)", *(f"{step[c]['compile_s']:.1f}" for c in cols)],
    ]
    if bubbles:
        rows.append(
            [
                "bubble ideal / lockstep / executor",
                "–",
                *(
                    " / ".join(pct(step[s][k]) for k in ("bubble", "lockstep_bubble", "executor_bubble"))
                    for s in SCHEDULES
                ),
            ]
        )
    return markdown(["", *head], rows, "l" + "r" * len(cols))


@table("pipeline-tiny")
def pipeline_tiny() -> str:
    return _pipeline_steps("tiny", bubbles=True)


@table("pipeline-llama-100m")
def pipeline_llama() -> str:
    return _pipeline_steps("llama-100m", bubbles=False)


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


# --- Context parallelism ------------------------------------------------------------------------------------


def _bytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


@table("cp-memory")
def cp_memory() -> str:
    """Ring attention fwd+bwd memory per device, as a ratio to one device at the same L."""
    data = load("context_parallel_cpu8.json")
    by = {(r["length"], r["n"]): r for r in data["memory"]}
    lengths, ns = sorted({k[0] for k in by}), sorted({k[1] for k in by} - {1})
    rows = [[f"{L:,}", _bytes(by[L, 1]["total"]), *(f"{by[L, n]['ratio']['total']:.3f}" for n in ns)] for L in lengths]
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
        ["one device, dense attention", _bytes(dense["total"]), _bytes(dense["score_matrix_bytes_formula"]), "no"],
        [
            f"`sequence={data['n']}`, ring, per device",
            _bytes(ring["total"]),
            _bytes(ring["score_tile_bytes_formula"]),
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


# --- Hugging Face -------------------------------------------------------------------------------------------


@table("convert-memory")
def convert_memory() -> str:
    data = load("convert_memory_cpu8.json")
    by = {(r["checkpoint_dtype"], r["layers"], r["mesh"]): r for r in data["rows"]}
    rows = []
    for dtype, layers in sorted({k[:2] for k in by}, key=lambda k: (k[0] != "float32", k[1])):
        first = by[dtype, layers, "fsdp=8"]
        rows.append(
            [
                dtype if dtype == "float32" else f"{dtype} (imported as float32)",
                layers,
                _bytes(first["checkpoint_bytes"]),
                f"{first['peak_over_model']:.2f}×",
                f"{by[dtype, layers, 'none']['peak_over_model']:.2f}×",
            ]
        )
    return markdown(
        ["checkpoint", "layers", "on disk", "`fsdp=8` peak / model", "one device peak / model"], rows, "lrrrr"
    )


@table("convert-growth")
def convert_growth() -> str:
    data = load("convert_memory_cpu8.json")["marginal"]
    rows = [[r["checkpoint_dtype"], r["mesh"], f"{r['peak_growth_over_model_growth']:.2f}"] for r in data]
    return markdown(["checkpoint", "mesh", "peak growth ÷ model growth, 12 → 24 layers"], rows, "llr")


# --- Generation and serving ---------------------------------------------------------------------------------


@table("generate-cpu")
def generate_cpu() -> str:
    data = load("generate_cpu.json")
    rows = []
    for model, m in data["models"].items():
        for b in m["batches"]:
            kv, roof = b["kv"], b["roofline"]
            rows.append(
                [
                    f"`{model}`",
                    b["batch"],
                    f"{b['prefill_tokens_per_s']:,.0f}",
                    f"{b['ttft_s']:.3f}",
                    f"{b['decode_tokens_per_s']:,.1f} ({b['decode_tokens_per_s_per_sequence']:,.1f})",
                    f"{b['inter_token_ms_p50']:.2f} / {b['inter_token_ms_p99']:.2f}",
                    f"{kv['kv_bytes_per_token']:,} = {kv['kv_bytes_per_token_formula']:,}",
                    f"{roof['achieved_gb_s']:.2f}",
                    f"{roof['ratio']:.3f}",
                ]
            )
    header = [
        "model",
        "batch",
        "prefill tok/s",
        "time to first token s",
        "decode tok/s (per sequence)",
        "inter-token p50 / p99 ms",
        "KV bytes/token: cache = formula",
        "achieved GB/s",
        "roofline ratio",
    ]
    return markdown(header, rows, "lr" + "r" * 7)


@table("serve-load")
def serve_load() -> str:
    load_ = load("serve_cpu.json")["load"]
    rows = []
    for policy in ("continuous", "static"):
        r = load_[policy]
        p = lambda key, scale=1.0, fmt=".2f", r=r: f"{r[key]['p50'] * scale:{fmt}} / {r[key]['p99'] * scale:{fmt}}"
        rows.append(
            [
                policy,
                f"{r['throughput_tokens_per_s']:,.0f}",
                p("ttft_s") + " s",
                p("inter_token_s", 1e3, ".1f") + " ms",
                p("end_to_end_s") + " s",
            ]
        )
    return markdown(
        ["policy", "tokens/s", "TTFT p50 / p99", "inter-token p50 / p99", "end-to-end p50 / p99"], rows, "lrrrr"
    )


@table("serve-pages")
def serve_pages() -> str:
    data = load("serve_cpu.json")["load"]
    pages, ratio = data["pages"], data["continuous_over_static"]
    rows = [
        ["throughput, continuous ÷ static", f"{ratio['throughput']:.2f}×"],
        ["page pool used, mean / peak", f"{pct(pages['utilization_mean'], 0)} / {pct(pages['utilization_peak'], 0)}"],
        [
            "internal fragmentation, mean / peak",
            f"{pct(pages['fragmentation_mean'])} / {pct(pages['fragmentation_peak'])}",
        ],
    ]
    return markdown(["continuous batching", ""], rows, "lr")


@table("serve-prefix")
def serve_prefix() -> str:
    data = load("serve_cpu.json")["prefix"]
    rows = [
        [
            label,
            f"{r['seconds']:.2f}",
            f"{r['prompt_tokens_computed']:,}",
            pct(r["hit_rate"]),
        ]
        for label, r in (("prefix cache on", data["with_cache"]), ("prefix cache off", data["without_cache"]))
    ]
    return markdown(["run", "seconds", "prompt tokens computed", "prefix pages found"], rows, "lrrr")


@table("serve-speculative")
def serve_speculative() -> str:
    data = load("serve_cpu.json")["speculative"]
    rows = [["plain decoding", f"{data['plain_tokens_per_s']:,.0f}", "1.00×", f"{data['plain_step_ms']:.1f}", "–"]]
    for label, key in (("n-gram prompt lookup", "ngram"), ("draft model (1 layer)", "draft_model")):
        r = data[key]
        rows.append(
            [
                f"{label}, k = {r['k']}",
                f"{r['tokens_per_s']:,.0f}",
                f"{r['speedup']:.2f}×",
                f"{r['step_ms']:.1f}",
                pct(r["acceptance"]["rate"]),
            ]
        )
    return markdown(["decoding", "tokens/s", "against plain", "step ms", "guesses kept"], rows, "lrrrr")


# --- The layout lab -----------------------------------------------------------------------------------------

SERVE_PLAN = "serve_plan_llama3-70b_h100x8.json"


@table("serve-plan-search")
def serve_plan_search() -> str:
    """``jaxpar plan --inference --search`` for Llama-3-70B on 8 H100s (the JSON it printed)."""
    rows = [
        [
            f"`{mesh_text(p['mesh'])}`",
            f"{p['weight_bytes_per_device'] / 1e9:.2f}",
            f"{p['kv_bytes_per_device'] / 1e9:.2f}",
            "yes" if p["fits"] else "no",
            f"{p['decode_step_s'] * 1e3:.2f}",
            f"{p['time_to_first_token_s'] * 1e3:.0f}",
            f"{p['tokens_per_s']:,.0f}",
            p["max_batch"],
        ]
        for p in load(SERVE_PLAN)["candidates"]
    ]
    header = ["mesh", "weights GB", "KV GB", "fits", "step ms", "TTFT ms", "tokens/s", "max batch"]
    return markdown(header, rows, "lrrlrrrr")


@table("serve-plan-example")
def serve_plan_example() -> str:
    """The best layout of that search as ``jaxpar plan --inference`` prints it (its own formatter)."""
    from jaxpar.analysis.inference_plan import InferencePlan, format_inference_plan

    best = load(SERVE_PLAN)["candidates"][0]
    command = (
        f"$ jaxpar plan --inference --model {best['model']} --mesh {mesh_text(best['mesh'])} --devices 8 "
        f"--batch {best['batch']} --context {best['context']} --hardware {best['hardware']}"
    )
    return f"```text\n{command}\n{format_inference_plan(InferencePlan(**best))}\n```"


def validation() -> tuple[dict, dict]:
    return load("plan_validation.json"), load("plan_validation_notes.json")


def note(row: dict, notes: dict) -> str:
    """The row's note with its figures filled in: from the row itself and from the notes' numbers."""
    text = notes["notes"].get(row["name"], "")
    return text.format(**row, **notes["numbers"])


SHARE_NAMES = {
    "attention": "attention",
    "bubble": "bubble",
    "elementwise": "elementwise",
    "expert_exposed": "expert all-to-all",
    "sequence_exposed": "sequence",
    "stage_exposed": "stage sends",
    "head": "LM head",
    "optimizer": "optimizer",
}


def other_shares(row: dict, floor: float = 0.05) -> str:
    share = row["share_of_step"]
    big = sorted(((v, k) for k, v in share.items() if k in SHARE_NAMES and v >= floor), reverse=True)
    return ", ".join(f"{SHARE_NAMES[k]} {v:.2f}" for v, k in big)


@table("validation-runs")
def validation_runs() -> str:
    data, notes = validation()
    rows = []
    for r in data["rows"]:
        s = r["share_of_step"]
        main = " / ".join(f"{s[k]:.2f}" for k in ("matmul", "tensor_exposed", "fsdp_exposed", "dcn_exposed"))
        name = r["name"] if r["in_fit"] else f"{r['name']} *(not fitted)*"
        rows.append(
            [
                name,
                f"{r['measured_step_s']:.3f}",
                f"{r['predicted_step_s']:.3f}",
                pct(r["error"], sign=True),
                main,
                other_shares(r),
                note(r, notes),
            ]
        )
    header = [
        "run",
        "measured step s",
        "predicted s",
        "error",
        "matmul / tensor / fsdp / dcn exposed",
        "other shares ≥ 0.05",
        "why it misses, what it rests on",
    ]
    return markdown(header, rows, "lrrrlll")


FAMILIES = {
    "tpu-v5p": "MaxText, TPU v5p",
    "tpu-v5e": "MaxText, TPU v5e",
    "h100-a3": "MaxText, H100 (A3)",
    "h100-gt": "torchtitan, H100",
    "a100": "Megatron-LM, A100",
    "tpu-v6e": "MaxText, TPU v6e",
    "tpu7x": "MaxText, TPU7x",
}


def _summary_row(label: str, rows: list[dict]) -> list:
    err = [abs(r["error"]) for r in rows]
    worst = max(rows, key=lambda r: abs(r["error"]))
    return [
        label,
        len(rows),
        pct(median(err)),
        f"{pct(worst['error'], sign=True)} ({worst['name']})",
        sum(e > 0.10 for e in err),
        sum(e > 0.20 for e in err),
    ]


@table("validation-summary")
def validation_summary() -> str:
    """Leave-one-out errors by family of runs, over the runs the fits use, then over all of them."""
    data, _ = validation()
    fitted = [r for r in data["rows"] if r["in_fit"]]
    rows = [_summary_row(label, [r for r in fitted if r["hardware"] == hw]) for hw, label in FAMILIES.items()]
    rows.append(_summary_row("**every fitted run**", fitted))
    rows.append(_summary_row("every run, the unfitted included", data["rows"]))
    header = ["runs", "count", "median abs. error", "largest error", "beyond 10%", "beyond 20%"]
    return markdown(header, rows, "lrrlrr")


CALIBRATION_NAMES = {
    "matmul": "matmul share of peak",
    "collective": "collective efficiency, fast links",
    "dcn": "collective efficiency, DCN / InfiniBand",
    "grouped": "grouped (dropless) matmuls, share of the matmul share",
    "fp8": "FP8 weight matmuls, share of the FP8 peak",
    "grouped_fp8": "FP8 grouped matmuls, share of the FP8 share",
}
CHIP_FAMILIES = {"tpu": "TPU v5e / v5p", "tpu-v6e": "TPU v6e", "tpu7x": "TPU7x", "gpu": "H100", "a100": "A100"}


@table("validation-calibration")
def validation_calibration() -> str:
    """The fitted constants per chip family (``jaxpar.analysis.calibration.CALIBRATED``, as the JSON states)."""
    cal = validation()[0]["summary"]["calibration"]
    rows = [
        [label, *(f"{cal[k][f]:g}" if f in cal[k] else "–" for f in CHIP_FAMILIES)]
        for k, label in CALIBRATION_NAMES.items()
    ]
    return markdown(["constant", *CHIP_FAMILIES.values()], rows, "l" + "r" * len(CHIP_FAMILIES))


# --- Benchmarks ---------------------------------------------------------------------------------------------


@table("layouts")
def layouts() -> str:
    rows = []
    for name in ("layouts_tiny_cpu8.json", "layouts_llama-100m_cpu8.json"):
        for r in load(name)["rows"]:
            rows.append(
                [
                    f"`{r['model']}`",
                    f"`{r['mesh']}`",
                    f"{r['compile_s']:.1f}",
                    f"{r['step_s_median']:.4g}",
                    f"{r['tokens_per_s']:,.0f}",
                    f"{r['collective_bytes_per_device'] / 2**20:,.2f}",
                    f"{r['temp_bytes_per_device'] / 2**20:,.1f}",
                ]
            )
    header = [
        "model",
        "mesh",
        "compile s",
        "median step s",
        "tokens/s",
        "collective MiB/device/step",
        "scratch MiB/device",
    ]
    return markdown(header, rows, "llrrrrr")


@table("overhead")
def overhead() -> str:
    data = load("overhead_tiny_cpu8.json")
    rows = [
        [
            f"`{r['mesh']}`",
            f"{r['ours_tokens_per_s']:,.0f}",
            f"{r['ref_tokens_per_s']:,.0f}",
            pct(r["overhead"], sign=True),
            pct(r["overhead_paired"], sign=True),
            pct(r["null_overhead_paired"], sign=True),
            "yes" if r["loss_match"] and r["collectives_match"] else "no",
            "yes" if r["flops_ours"] == r["flops_ref"] else "no",
        ]
        for r in data["results"]
    ]
    header = [
        "mesh",
        "ours tokens/s",
        "plain JAX tokens/s",
        "overhead",
        "paired median",
        "A/A noise floor",
        "same losses and collectives",
        "same FLOPs",
    ]
    return markdown(header, rows, "lrrrrrll")


# --- Tutorials ----------------------------------------------------------------------------------------------


@table("tutorials")
def tutorials() -> str:
    """The notebooks, what each shows, and the wall time of its recorded run (its metadata)."""
    spec = importlib.util.spec_from_file_location("colab_build", ROOT / "colab" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    rows = [
        [f"[`{name}`]({REPO}/colab/{name}.ipynb)", shows, f"{seconds} s"] for name, shows, seconds in build.index_rows()
    ]
    return markdown(["notebook", "what it shows", "run time"], rows, "llr")


# --- Markers ------------------------------------------------------------------------------------------------

TABLE_MARKER = re.compile(r"^<!-- table: ([\w-]+) -->$", re.M)
VALUE_MARKER = re.compile(r"<!-- value: (\w+) (\S+) -->")


def substitute(text: str) -> str:
    """``text`` with every table and value marker replaced; an unknown name raises KeyError."""
    text = TABLE_MARKER.sub(lambda m: TABLES[m.group(1)](), text)
    numbers = load("plan_validation_notes.json")["numbers"] if VALUE_MARKER.search(text) else {}
    return VALUE_MARKER.sub(lambda m: format(numbers[m.group(1)], m.group(2)), text)


if __name__ == "__main__":
    names = sys.argv[1:]
    print("\n\n".join(TABLES[n]() for n in names) if names else "\n".join(TABLES))
