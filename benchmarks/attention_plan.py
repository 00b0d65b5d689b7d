"""The layout lab on tpu-recipes' Llama 3.1 layouts on v6e, with XLA's attention and with splash.

    python benchmarks/attention_plan.py --out benchmarks/results/attention_plan_v6e.json

Each layout is priced three times by ``jaxpar plan ... --json`` (one subprocess each: the simulated devices
are set before jax starts), as a user would price it: ``execution.attention_impl=xla`` (every score in HBM),
``=splash`` (the Pallas kernel, priced as a flash kernel), and splash with ``execution.loss_chunks=16`` (the
loss's float32 logits a sixteenth of the tokens at a time). Recorded per run: the command, the predicted
step and MFU, the step's parts, the memory estimate and whether it fits, and the published step of the run
(``benchmarks/published_runs.json``) with the ratio predicted MFU / published MFU (published step /
predicted step, the same tokens and model FLOPs).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (published run's name, model preset, devices, global batch, sequence, remat)
LAYOUTS = [
    ("MaxText Llama3.1-8B, v6e-8", "llama3-8b", 8, 24, 8192, "full"),
    ("MaxText Llama3.1-8B, v6e-256", "llama3-8b", 256, 1024, 8192, "full"),
    ("MaxText Llama3.1-70B, v6e-64", "llama3-70b", 64, 128, 8192, "full"),
]
# (attention kernel, execution.loss_chunks): XLA's attention, splash, splash with the loss in 16 pieces
VARIANTS = (("xla", 1), ("splash", 1), ("splash", 16))


def command(model: str, devices: int, batch: int, seq: int, remat: str, kernel: str, chunks: int) -> list[str]:
    return [
        *("jaxpar", "plan", "--model", model, "--mesh", f"fsdp={devices}", "--devices", str(devices)),
        *("--batch", str(batch), "--seq", str(seq), "--hardware", "tpu-v6e", "--json"),
        *("--set", f"execution.remat={remat}", "--set", f"execution.attention_impl={kernel}"),
        *("--set", f"execution.loss_chunks={chunks}"),
    ]


def price(argv: list[str]) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "jaxpar", *argv[1:]], capture_output=True, text=True, check=True, timeout=1800
    )
    report = json.loads(done.stdout)
    return {
        "predicted_step_s": report["predicted_step_s"],
        "predicted_mfu": report["predicted_mfu"],
        "parts_s": {k: v for k, v in report["times"]["parts"].items() if v},
        "estimated_memory_bytes": report["estimated_memory_bytes"],
        "memory_parts_bytes": report["memory_parts"],
        "fits": report["fits"],
        "assumptions": report["assumptions"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    runs = json.loads((ROOT / "benchmarks" / "published_runs.json").read_text())["runs"]
    published = {r["name"]: r for r in runs}
    rows = []
    for name, model, devices, batch, seq, remat in LAYOUTS:
        step = published[name]["published"]["step_s"]
        for kernel, chunks in VARIANTS:
            argv = command(model, devices, batch, seq, remat, kernel, chunks)
            result = price(argv)
            ratio = step / result["predicted_step_s"]
            row = dict(run=name, kernel=kernel, loss_chunks=chunks, command=" ".join(argv), published_step_s=step)
            rows.append(row | result)
            rows[-1]["predicted_over_published_mfu"] = ratio
            print(
                f"{name} {kernel} loss_chunks={chunks}: {result['predicted_step_s']:.3f} s, "
                f"MFU {result['predicted_mfu']:.1%}, {ratio:.2f}x published, fits {result['fits']}",
                flush=True,
            )
    Path(args.out).write_text(json.dumps({"benchmark": "attention_plan", "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
