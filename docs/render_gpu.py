"""Tables of the measurements made on a GPU (``benchmarks/gpu_checks.sh``: ``benchmarks/results/*_h200.json``),
each with the command and the commit that made it."""

from __future__ import annotations

from render_kit import load, markdown, pct, table


def _made(data: dict) -> str:
    """The line under a table: its command and commit."""
    return f"\n\nMeasured by `{data['command']}` at commit `{data['commit']}` ({data['run_by']})."


@table("lab-gpu")
def lab_gpu() -> str:
    data = load("lab_gpu_h200.json")
    rows = []
    for r in data["train"]:
        p, m = r["predicted"], r["measured"]
        cells = [f"train: {r['case']}", f"{p['step_s']:.3f}", f"{m['step_s']:.3f}", pct(r["error"]["step_s"], 1, True)]
        rows.append(
            cells
            + [f"{pct(p['mfu'])} / {pct(m['mfu'])}", f"{p['memory_bytes'] / 2**30:.1f} / {m['peak_bytes'] / 2**30:.1f}"]
        )
    for r in data["decode"]:
        p, m = r["predicted"], r["measured"]
        for what, key in (("prefill", "prefill_s"), ("decode step", "decode_step_s")):
            rows.append(
                [
                    f"{what}: batch {r['batch']}, prompt {r['prompt']}",
                    f"{p[key] * 1e3:.2f} ms",
                    f"{m[key] * 1e3:.2f} ms",
                ]
                + [pct(r["error"][key], 1, True), "", ""]
            )
    rates = data["device_rates"]
    header = "case|predicted|measured|error|MFU predicted / measured|memory GiB: estimate / device peak"
    note = (
        f"\n\n`{data['model']}` on one {data['device']} (jax {data['jax']}), profile `{data['hardware']}`. "
        f"The device's own rates: an {rates['matmul_n']}³ bf16 matmul at {rates['matmul_tflops']:.0f} TFLOP/s "
        f"({pct(rates['matmul_share_of_peak'], 0)} of the profile's peak), a copy at {rates['copy_gb_s']:,.0f} GB/s "
        f"({pct(rates['copy_share_of_hbm'], 0)} of its HBM bandwidth). The device peak is the allocator's peak so far "
        "(it only grows from case to case)."
    )
    return markdown(header.split("|"), rows, "lrrrrr") + note + _made(data)


@table("generate-gpu")
def generate_gpu() -> str:
    data = load("generate_gpu_h200.json")
    rows = []
    for model, m in data["models"].items():
        for b in m["batches"]:
            roof = b["roofline"]
            rows.append(
                [f"`{model}`", b["batch"], f"{b['decode_tokens_per_s']:,.1f}", f"{roof['median_step_ms']:.2f}"]
                + [f"{roof['memory_floor_ms']:.2f}", f"{roof['achieved_gb_s']:,.0f}", pct(roof["ratio"])]
            )
    header = "model|batch|decode tok/s|median step ms|memory floor ms|achieved GB/s|share of HBM peak"
    peak = data["peak"]
    note = (
        f"\n\nbf16 weights and compute on one {data['device']} (jax {data['jax']}); prompt {data['prompt']}, "
        f"{data['new_tokens']} greedy tokens. HBM peak {peak['gb_s']:,.0f} GB/s (datasheet); the device's own "
        f"copy reached {peak['measured_copy_gb_s']:,.0f} GB/s. The step program: {data['decode_program']}."
    )
    return markdown(header.split("|"), rows, "lrrrrrr") + note + _made(data)


@table("decode-gpu")
def decode_gpu() -> str:
    data = load("decode_gpu_h200.json")
    rows = []
    for run in data["runs"]:
        for variant, v in run["variants"].items():
            for decoder in ("jaxpar generate", "plain JAX"):
                r = v[decoder]
                if "error" in r:
                    continue
                rows.append(
                    [run["decode_program"], run["host_loop"] if decoder == "jaxpar generate" else "waits for each step"]
                    + [
                        variant,
                        decoder,
                        f"{r['loop_step_ms']:.2f}",
                        f"{r['chained_step_ms']:.2f}",
                        f"{r['dispatch_ms']:.2f}",
                    ]
                    + [r["hlo"]["fusions"]]
                )
    header = "step program|host loop|command buffers|decoder|loop step ms|chained step ms|dispatch ms|fusions"
    first = data["runs"][0]
    note = f"\n\n`{first['model']}`, batch 1, prompt {first['prompt']}, bf16. Measured by `{data['command']}`."
    return markdown(header.split("|"), rows, "llllrrrr") + note


@table("serve-gpu")
def serve_gpu() -> str:
    data = load("serve_gpu_h200.json")
    load_, spec = data["load"], data["speculative"]
    rows = []
    for policy in ("continuous", "static"):
        r = load_[policy]
        ms = lambda key, r=r: f"{r[key]['p50'] * 1e3:.1f} / {r[key]['p99'] * 1e3:.1f}"
        rows.append(
            [policy, f"{r['throughput_tokens_per_s']:,.0f}", ms("ttft_s"), ms("inter_token_s"), ms("end_to_end_s")]
        )
    header = "batching|tok/s|first token ms p50 / p99|inter-token ms p50 / p99|end to end ms p50 / p99"
    pre = data["prefix"]
    note = (
        f"\n\n`{data['model']}` on one {data['device']}, {load_['requests']} requests at {load_['rate_per_s']:.0f}/s. "
        f"Prefix cache: {pct(pre['with_cache']['hit_rate'])} of prefix pages found, "
        f"{pct(pre['time_saved_fraction'])} of the time saved. Speculation (k = {spec['ngram']['k']}): "
        f"n-gram lookup {spec['ngram']['speedup']:.2f}× plain decoding, "
        f"the draft model {spec['draft_model']['speedup']:.2f}×. The step program: {data['step_program']}."
    )
    return markdown(header.split("|"), rows, "lrrrr") + note + _made(data)
