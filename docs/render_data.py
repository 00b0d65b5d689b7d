"""Tables of the data pages: packed rows against padded ones, and the loader against the train step
(``benchmarks/data_loader.py``)."""

from __future__ import annotations

from render_kit import load, markdown, pct, table


@table("data-packing")
def data_packing() -> str:
    """Per row length: the share of row tokens that hold documents, packed and one document a row."""
    data = load("data_loader_cpu8.json")
    rows = [
        [
            r["seq"],
            f"{r['packed_rows']:,}",
            pct(r["packed_filled"]),
            f"{r['padded_rows']:,}",
            pct(r["padded_filled"]),
            f"{r['truncated_tokens']:,}",
        ]
        for r in data["packing"]
    ]
    header = [
        "seq",
        "rows, packed",
        "documents / row tokens",
        "rows, one a row",
        "documents / row tokens",
        "tokens cut off, one a row",
    ]
    return markdown(header, rows, "rrrrrr")


@table("data-loader")
def data_loader() -> str:
    """The loader's tokens per second against what the train step consumes, and the corpus they ran on."""
    data = load("data_loader_cpu8.json")
    corpus, loader, step = data["corpus"], data["loader"], data["train_step"]
    rows = [
        ["corpus", f"{corpus['documents']:,} documents, {corpus['tokens']:,} tokens; {corpus['distribution']}"],
        [
            "loader",
            f"{loader['tokens_per_s']:,} tokens/s ({loader['batch']} rows of {loader['seq']}, "
            f"{loader['batches']} batches)",
        ],
        [
            "train step",
            f"{step['tokens_per_s']:,} tokens/s ({step['model']}, {step['mesh']}, {step['step_s']} s a step)",
        ],
        ["loader / step", f"{data['loader_over_step']}×"],
        ["machine", f"{data['cpus']} CPUs ({data['host']}), 8 simulated devices"],
    ]
    return markdown(["", "measured"], rows)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


@table("lora-vs-full")
def lora_vs_full() -> str:
    """LoRA against full fine-tuning (``benchmarks/lora.py``): step time and compiled memory per device."""
    data = load("lora_cpu8.json")
    rows = []
    for r in data["runs"]:
        name = "full" if r["lora"] is None else f"LoRA rank {r['lora']['rank']} on {r['lora']['targets']}"
        rows.append(
            [
                name,
                f"{r['step_s']} s",
                _mib(r["params_bytes"]),
                _mib(r["trained_bytes"]),
                _mib(r["optimizer_bytes"]),
                _mib(r["temp_bytes"]),
            ]
        )
    ratio = data["lora_over_full"]
    rows.append(
        ["LoRA ÷ full", f"{ratio['step_s']}×", "", "", f"{ratio['optimizer_bytes']}×", f"{ratio['temp_bytes']}×"]
    )
    header = ["", "step", "parameters", "trained", "optimizer state", "temporaries"]
    note = (
        f"\n\n{data['model']}, `{data['mesh']}` on 8 simulated devices of {data['cpus']} CPUs ({data['host']}), "
        f"batch {data['batch']} × {data['seq']} tokens; bytes per device, from the compiled step."
    )
    return markdown(header, rows, "lrrrrr") + note


@table("serve-adapters")
def serve_adapters() -> str:
    """Decode with a bank of adapters against without (``benchmarks/serve_adapters.py``)."""
    data = load("serve_adapters_cpu.json")
    rows = [
        [name, f"{r['decode_tokens_per_s']}", f"{r['step_ms']} ms", f"{data['over_no_bank'][name]}×"]
        for name, r in data["runs"].items()
    ]
    note = (
        f"\n\n{data['model']}, {data['requests']} greedy requests of {data['prompt']} + {data['new_tokens']} "
        f"tokens, {data['slots']} decoding together, on one CPU device ({data['cpus']} CPUs, {data['host']}); "
        f"the bank holds {data['adapters']} adapters of rank {data['rank']} on `{data['targets']}`, and the "
        "adapter rows spread over all of them."
    )
    return markdown(["engine", "decode tokens/s", "decode step", "÷ no bank"], rows, "lrrr") + note


@table("grpo-time")
def grpo_time() -> str:
    """GRPO on the toy task (``benchmarks/grpo.py``): the reward, the time split and the rollouts' rate."""
    data = load("grpo_cpu8.json")
    steady, engine = data["steady"], data["engine"]
    rows = [
        [
            "reward, first rollout batch → mean of the last 5",
            f"{data['reward']['first']:.3f} → {data['reward']['last5']}",
        ],
        [
            f"time over {steady['iterations']} rollout batches (after the first, which compiles)",
            f"rollouts {steady['rollout_s']} s (of which the weights onto the engine {steady['sync_s']} s), "
            f"updates {steady['update_s']} s ({pct(steady['rollout_share'])} rollouts)",
        ],
        ["rollout tokens/s in training (median)", f"{steady['rollout_tokens_per_s']}"],
        ["the serving engine alone, same model and requests", f"{engine['tokens_per_s']} tokens/s"],
        ["rollouts ÷ engine alone", f"{data['rollout_over_engine']}×"],
        ["machine", f"{data['cpus']} CPUs ({data['host']}), 8 simulated devices; engine on one"],
    ]
    return markdown(["", "measured"], rows)


@table("quantize")
def quantize() -> str:
    """Each stored format against bfloat16 (``benchmarks/quantize.py``): bytes, decode rate, agreement."""
    data = load("quantize_cpu.json")
    rows = []
    for kind, r in data["formats"].items():
        agree = r.get("agreement")
        rows.append(
            [
                "bfloat16" if kind == "none" else kind,
                f"{r['bytes']['weights'] / 2**20:.1f} MiB",
                f"{r['weights_over_bf16']}×",
                f"{r['bytes']['temporaries'] / 2**20:.1f} MiB",
                f"{r['decode']['batch_1_tokens_per_s']} ({r['speed_over_bf16']['batch_1_tokens_per_s']}×)",
                f"{r['decode']['batch_8_tokens_per_s']} ({r['speed_over_bf16']['batch_8_tokens_per_s']}×)",
                "" if agree is None else f"{agree['relative_error']}",
                "" if agree is None else f"{agree['tokens_agreed']} / {agree['tokens']}",
                "" if agree is None else f"{agree['differences_within_margin']} of {agree['differences']}",
            ]
        )
    header = ["weights", "stored", "÷ bf16", "forward temporaries", "decode tok/s, batch 1", "batch 8"]
    header += ["logit error ÷ logits' std", "tokens agreed", "differences within the margin"]
    note = (
        f"\n\n{data['model']} with random bfloat16 weights on one CPU device ({data['cpus']} CPUs, "
        f"{data['host']}); {data['prompts']} greedy prompts of {data['prompt']} + {data['new_tokens']} tokens. "
        "Tokens agreed: before each row's first difference from the bfloat16 model's; a difference is within "
        "the margin where the bfloat16 model's top two logits were within twice the format's logit error."
    )
    return markdown(header, rows, "lrrrrrrrr") + note
