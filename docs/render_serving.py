"""Tables of docs/render.py: Hugging Face conversion; generation and serving."""

from __future__ import annotations

from render_kit import gb_text, load, markdown, pct, table

from jaxpar.inference.limits import Limits

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
                gb_text(first["checkpoint_bytes"]),
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


@table("decode-peers")
def decode_peers() -> str:
    data = load("decode_peers_cpu.json")
    rows = []
    for run in data["peers"]:
        for batch, by in run["batches"].items():
            for name, r in by.items():
                if isinstance(r, dict):
                    rates = ", ".join(f"{x:,.1f}" for x in r["decode_tokens_per_s"])
                    rows.append(
                        [
                            f"`{run['model']}`",
                            batch,
                            name,
                            f"**{r['median']:,.1f}** ({rates})",
                            pct(r["same_tokens_as_jaxpar"], 0),
                            f"{r['achieved_gb_s']:.2f}",
                            f"{r['share_of_peak']:.3f}",
                        ]
                    )
    header = (
        "model|batch|decoder|decode tok/s: median (rounds)|rows with jaxpar's tokens|GB/s read|share of the copy peak"
    )
    return markdown(header.split("|"), rows, "lrlrrrr")


@table("decode-compile")
def decode_compile() -> str:
    data = load("decode_compile_cpu.json")
    cells = lambda r: [r["layers"], f"{r['lower_s']:.2f}", f"{r['compile_s']:.2f}", f"{r['hlo_instructions']:,}"]
    rows = [cells(r) + [r["large_copies"], r["cache_copies"], f"{r['bytes_ratio']:.3f}"] for r in data["rows"]]
    header = "layers|lower s|compile s|HLO instructions|weight-sized copies|cache copies|bytes moved ÷ floor"
    return markdown(header.split("|"), rows, "rrrrrrr")


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


@table("serve-limits")
def serve_limits() -> str:
    """Every limit of ``jaxpar serve``, from ``jaxpar.inference.limits.Limits`` itself."""
    rows = [[f"`{flag}`", default, answer, what] for flag, default, answer, what in Limits.table()]
    return markdown(["flag", "default", "over it", "what it bounds"], rows, "lrll")


@table("serve-health")
def serve_health() -> str:
    """``/health`` latency while the largest requests are parsed (benchmarks/serve_health.py)."""
    data = load("serve_health_cpu.json")
    rows = []
    for kind in ("idle", "text", "ids", "too_long", "deep"):
        run, ms = data[kind], data[kind]["health_ms"]
        size = f"{run['bytes'] / 2**20:.2f} MiB" if "bytes" in run else "none"
        answered = f"{run['answered_ms_median']:.0f} ms" if "answered_ms_median" in run else ""
        rows.append([kind, size, answered, f"{ms['p50']:.1f}", f"{ms['p99']:.1f}", f"{ms['max']:.1f}"])
    header = ["request in flight", "body", "answered in (median)", "/health p50 ms", "p99 ms", "max ms"]
    return markdown(header, rows, "lrrrrr")
