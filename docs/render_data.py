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
