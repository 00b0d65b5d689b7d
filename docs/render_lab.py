"""Tables of docs/render.py: the layout lab and its validation; benchmarks; tutorials; numerical tolerances."""

from __future__ import annotations

import importlib.util
from statistics import median

from render_kit import REPO, ROOT, load, markdown, mesh_text, pct, table

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


# --- Numerical tolerances -----------------------------------------------------------------------------------


def _share(record: dict) -> float:
    return max(record["error"][k] / record["tolerance"][k] for k in record["error"])


@table("numerics-families")
def numerics_families() -> str:
    """Per family of numerical tests: the noise its references measured, the worst error as a share of
    its tolerance in any XLA configuration, and the smallest factor by which a mutation missed its bound."""
    data = load("numerics_cpu.json")
    noise: dict = {}
    for run in data["runs"].values():
        for r in run["records"]:
            if "factor" not in r:
                noise.setdefault(r["family"], []).extend(r["noise"].values())
    rows = []
    for fam, s in sorted(data["summary"].items()):
        worst_mutation = min(s["mutations"].items(), key=lambda kv: kv[1]["min_factor"], default=(None, None))
        rows.append(
            [
                fam,
                s["cases"],
                f"{min(noise[fam]):.1e} – {max(noise[fam]):.1e}",
                f"{s['worst_share']:.3f} ({s['worst_case']})",
                "—" if worst_mutation[0] is None else f"{worst_mutation[1]['min_factor']:,.0f}× ({worst_mutation[0]})",
            ]
        )
    header = ["family", "cases", "measured noise", "worst error / tolerance", "smallest mutation / tolerance"]
    return markdown(header, rows, "lrlll")


@table("numerics-cases")
def numerics_cases() -> str:
    """Every case: its noise, tolerance and error under each configuration (the largest quantity bounded)."""
    data = load("numerics_cpu.json")
    configs = list(data["runs"])
    cases: dict = {}
    for config, run in data["runs"].items():
        for r in run["records"]:
            if "factor" not in r:
                cases.setdefault((r["family"], r["case"]), {})[config] = r
    rows = []
    for (fam, case), by_config in sorted(cases.items()):
        cells = [f"{_share(by_config[c]):.3f}" if c in by_config else "—" for c in configs]
        suite = by_config.get(configs[0]) or next(iter(by_config.values()))
        key = max(suite["error"], key=lambda k: suite["error"][k] / suite["tolerance"][k])
        noise, tol = suite["noise"][key], suite["tolerance"][key]
        rows.append([fam, case, key, f"{noise:.1e}", f"{tol:.1e}", *cells])
    header = ["family", "case", "quantity", "noise", "tolerance", *(f"error / tolerance, {c}" for c in configs)]
    return markdown(header, rows, "lllrr" + "r" * len(configs))


@table("attention-plan")
def attention_plan() -> str:
    """tpu-recipes' Llama 3.1 layouts on v6e priced with XLA's attention and with splash
    (``benchmarks/attention_plan.py``)."""
    rows = []
    for r in load("attention_plan_v6e.json")["rows"]:
        parts = r["parts_s"]
        rows.append(
            [
                r["run"],
                f"`{r['kernel']}`",
                r["loss_chunks"],
                f"{r['predicted_step_s']:.2f}",
                f"{r['published_step_s']:.2f}",
            ]
            + [pct(r["predicted_mfu"]), f"{r['predicted_over_published_mfu']:.2f}×", f"{parts['attention_s']:.2f}"]
            + [f"{r['estimated_memory_bytes'] / 1e9:.0f} GB", "yes" if r["fits"] else "no"]
        )
    header = "run|kernel|loss pieces|predicted step s|published step s|predicted MFU|predicted / published MFU"
    header += "|attention s|memory estimate|fits"
    return markdown(header.split("|"), rows, "llrrrrrrrl")
