"""The layout lab's step-time model against published runs, leave-one-out (prints one JSON object).

The runs, with the configurations that were measured and where each comes from, are in
``benchmarks/published_runs.json``: MaxText's TPU v5e table (16B-128B on 1-32 slices of v5e-256, published
2023-10-31), its v5p table (32B-1024B on 1-2 slices, 2023-12-15), its Llama2-7B runs on 1-16 A3 nodes
(8 × H100 each, 2024-04-09), torchtitan's H100 tables (2024-12: Llama 3.1 8B on 8 and 128 GPUs in bf16
and Float8, 8B at 32k-256k tokens with context parallelism, 70B with tensor parallelism, 405B on 512 GPUs
with tensor, pipeline and context parallelism), Megatron-LM's weak-scaling table (GPT 1.7B-1T on 32-3072
A100s, tensor × pipeline × data, SC21) and tpu-recipes' MaxText runs on TPU v6e (Llama 3.1 8B/70B,
Mistral 7B, GPT-3 175B, and the MoE Mixtral 8x7B and 8x22B), and its TPU7x (Ironwood) table (Llama 3.1
70B at 8k and 128k tokens, 405B, Qwen3-235B-A22B, DeepSeek-V3, in bf16 and in FP8; gpt-oss-120b in bf16).
Each run is predicted by ``jaxpar.analysis.steptime`` with the constants (``jaxpar.analysis.calibration``)
fitted on the other runs of its chip family; the error is the predicted speed over the published one,
minus 1 (the relative MFU error). The summary gives the errors over all runs and over the runs the fits
use (four runs are predicted but kept out of the fits, each with its reason).

    python benchmarks/plan_validation.py > benchmarks/results/plan_validation.json
"""

from __future__ import annotations

import json

import numpy as np

from jaxpar.analysis.calibration import CALIBRATED, leave_one_out, load_runs
from jaxpar.analysis.hardware import get_hardware
from jaxpar.analysis.steptime import step_seconds


def main() -> None:
    runs = load_runs()
    rows = leave_one_out(runs)
    for run, row in zip(runs, rows):
        parts = step_seconds(run.workload, get_hardware(run.hardware), CALIBRATED)
        row["share_of_step"] = {
            k.removesuffix("_s"): round(float(v / parts["step_s"]), 3) for k, v in parts.items() if k != "step_s"
        }
        row.update(
            error=round(row["error"], 3),
            measured_step_s=round(row["measured_step_s"], 3),
            predicted_step_s=round(row["predicted_step_s"], 3),
            source=run.source,
        )
    summary = dict(
        errors(rows),
        fitted_runs=errors([r for r in rows if r["in_fit"]]),
        not_fitted={r["name"]: r["error"] for r in rows if not r["in_fit"]},
        calibration=dict(
            matmul=CALIBRATED.matmul,
            collective=CALIBRATED.collective,
            dcn=CALIBRATED.dcn,
            grouped=CALIBRATED.grouped,
            fp8=CALIBRATED.fp8,
            grouped_fp8=CALIBRATED.grouped_fp8,
        ),
    )
    print(json.dumps(dict(benchmark="plan_validation", summary=summary, rows=rows), indent=1, ensure_ascii=False))


def errors(rows: list[dict]) -> dict:
    err = np.abs([r["error"] for r in rows])
    return dict(
        runs=len(rows),
        median_abs_error=round(float(np.median(err)), 3),
        max_abs_error=round(float(err.max()), 3),
        over_10_percent=int((err > 0.10).sum()),
        over_20_percent=int((err > 0.20).sum()),
    )


if __name__ == "__main__":
    main()
