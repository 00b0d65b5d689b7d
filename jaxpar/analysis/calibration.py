"""Calibrating the step-time model on published runs, and its leave-one-out error.

``benchmarks/published_runs.json`` holds runs whose configuration was published with their speed
(MaxText's TPU v5e/v5p tables, its v6e recipes and A3 GPU runs, torchtitan's H100 tables in bf16 and
Float8 with FSDP, context, tensor and pipeline parallelism, Megatron-LM's A100 weak-scaling table with
tensor and pipeline parallelism, tpu-recipes' Mixtral runs on v6e and its Ironwood table): the model's
shape, batch, layout, remat policy, and the speed as published — MFU or TFLOP/s under the publisher's
FLOP convention, or tokens/s. Each becomes a measured step time.
``jaxpar.analysis.steptime`` predicts them from the mechanisms; what no spec sheet gives is fitted per chip
family (``Calibration``): the share of peak a large matmul reaches, and the share of a link's bandwidth a
collective reaches on the fast links and on DCN/IB; then, on the runs whose experts are dropless grouped
matmuls, the share of the matmul share those reach; on the runs in FP8, the share of the FP8 peak their
matmuls reach and, for grouped ones, their own grouped share (each fitted after the ones before, which it
does not touch).

The fit is a grid search (every combination on ``GRID``, the loss evaluated for all at once: the model
takes numpy arrays), minimizing the mean squared log error. Leave-one-out: for each run, fit on the other
runs of its family and predict it; the error is predicted/measured speed − 1 (the MFU error). A run marked
``not_fitted`` (with the reason) is predicted like the others but enters no fit.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import numpy as np

from jaxpar.analysis.hardware import get_hardware
from jaxpar.analysis.steptime import Calibration, model_flops, step_seconds
from jaxpar.analysis.workload import Workload

WORKLOAD_FIELDS = {f.name for f in dataclasses.fields(Workload)}
RUNS = Path(__file__).resolve().parents[2] / "benchmarks" / "published_runs.json"
# descending link efficiencies: among equally good points the fit keeps the fastest links (a run whose
# collectives are all hidden says nothing about them)
GRID = dict(
    matmul=np.round(np.arange(0.40, 1.0001, 0.01), 2),
    collective=np.round(np.arange(1.0, 0.1999, -0.05), 2),
    dcn=np.round(np.arange(1.0, 0.0499, -0.05), 2),
    grouped=np.round(np.arange(1.0, 0.1999, -0.01), 2),
    fp8=np.round(np.arange(0.20, 1.0001, 0.01), 2),
    grouped_fp8=np.round(np.arange(1.0, 0.1999, -0.01), 2),
)


# ``calibrate()`` on benchmarks/published_runs.json (tests/test_steptime.py checks they agree). TPU v5e/v5p:
# 0.78 of peak, DCN at 0.8 of its estimated per-chip bandwidth, ICI at its spec. H100: 0.56, links at spec
# (MaxText's A3 runs and torchtitan's bf16 ones, the latter with FlashAttention-2); torchtitan's Float8 runs
# (8B to 405B, FSDP, context, tensor and pipeline parallel) put its FP8 matmuls at 0.47 of the FP8 peak.
# A100 (Megatron-LM's runs, whose tensor all-reduces and cross-node gradient reduction are exposed): NVLink
# collectives at half the link, InfiniBand at 0.65 of the NICs. TPU v6e (tpu-recipes' MaxText runs, pure
# FSDP on one slice but for Mixtral 8x22B's expert axis): 0.58. Two v6e runs alone say anything about its
# ICI share, and they disagree: GPT-3 175B, whose FSDP gathers outlast the compute they hide behind, fits
# 0.3; Mixtral 8x22B, whose forward all-to-alls are exposed, fits a share above the link's bandwidth. The
# fit settles on the bound, 1.0 (the others fit any share); no v6e run crosses DCN. TPU7x (Ironwood, per
# chip): 0.67, from its three short-context dense runs (the run kept out of the fits is named in
# the JSON with the reason); their FSDP traffic hides at any share, so the links stay at the bound. Its
# dropless MoE runs (Qwen3-235B-A22B, DeepSeek-V3 on 128 and 256 chips) run their experts as grouped matmuls
# (tokamax gmm) at 0.42 of that share, fitted on those three runs after the others. Its FP8 runs (MaxText's
# fp8_full: every weight matmul in FP8): dense ones at 0.55 of the FP8 peak (fitted on the three dense FP8
# runs), grouped ones at 0.29 of that (fitted on the three dropless FP8 runs): FP8 speeds the grouped
# kernels up far less than the dense ones.
CALIBRATED = Calibration(
    matmul={"tpu": 0.78, "tpu-v6e": 0.58, "gpu": 0.56, "a100": 0.69, "tpu7x": 0.67},
    collective={"tpu": 1.0, "tpu-v6e": 1.0, "gpu": 1.0, "a100": 0.5, "tpu7x": 1.0},
    dcn={"tpu": 0.8, "tpu-v6e": 1.0, "gpu": 1.0, "a100": 0.65, "tpu7x": 1.0},
    grouped={"tpu7x": 0.42},
    fp8={"gpu": 0.47, "tpu7x": 0.55},
    grouped_fp8={"tpu7x": 0.29},
)


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    hardware: str
    workload: Workload
    measured_step_s: float
    source: str
    # predicted but kept out of every fit: the run rests on a part of the model no other run exercises, which
    # the shared constants would otherwise bend to absorb (the reason is in benchmarks/published_runs.json)
    fitted: bool = True


def load_runs(path: str | Path = RUNS) -> list[Run]:
    runs = []
    for r in json.loads(Path(path).read_text())["runs"]:
        # the model's shape, and the run's fields as ``Workload`` names them (its defaults for the rest)
        w = Workload(**r["shape"], **{k: v for k, v in r.items() if k in WORKLOAD_FIELDS})
        w.check()
        hw = get_hardware(r["hardware"])
        runs.append(
            Run(
                r["name"],
                r["hardware"],
                w,
                measured_step(w, hw, r["published"]),
                r["source"],
                fitted="not_fitted" not in r,
            )
        )
    return runs


def measured_step(w: Workload, hw, published: dict) -> float:
    """The step time a publication implies: as logged, or its FLOPs per device (its convention) over its
    FLOP/s, or the tokens per device over its tokens/s."""
    if "step_s" in published:  # logged as such, with the tokens/s beside it
        tokens = w.batch * w.seq / w.devices
        if abs(published["step_s"] * published["tokens_per_s_per_device"] / tokens - 1) > 1e-3:
            raise ValueError(
                f"published step {published['step_s']} s at {published['tokens_per_s_per_device']} "
                f"tokens/s is not the configuration's {tokens:.0f} tokens per device"
            )
        return published["step_s"]
    if "tokens_per_s_per_device" in published:
        return w.batch * w.seq / w.devices / published["tokens_per_s_per_device"]
    conv = published["convention"]
    flops = model_flops(
        w,
        causal_attention=conv["attention"] == "causal",
        count_embedding=conv["embedding"] == "counted",
        recomputed_forward=conv.get("recompute") == "full",
    )
    rate = published["mfu"] * hw.peak_bf16_flops if "mfu" in published else published["tflops_per_device"] * 1e12
    return flops / rate


def grid_predictions(runs: list[Run]) -> tuple[np.ndarray, list[tuple]]:
    """Predicted step times [runs, grid points] and the grid points (matmul, collective, dcn)."""
    points = list(itertools.product(GRID["matmul"], GRID["collective"], GRID["dcn"]))
    arr = np.array(points).T
    out = np.empty((len(runs), len(points)))
    for i, run in enumerate(runs):
        hw = get_hardware(run.hardware)
        cal = Calibration({hw.family: arr[0]}, {hw.family: arr[1]}, {hw.family: arr[2]})
        out[i] = np.broadcast_to(step_seconds(run.workload, hw, cal)["step_s"], (len(points),))
    return out, points


def fit(runs: list[Run], preds=None, points=None) -> tuple:
    """The grid point with the least mean squared log error over ``runs`` (one family)."""
    if preds is None:
        preds, points = grid_predictions(runs)
    measured = np.array([r.measured_step_s for r in runs])
    loss = np.mean(np.log(preds / measured[:, None]) ** 2, axis=0)
    return points[int(np.argmin(loss))]


def kind(run: Run) -> str:
    """Which stage of the fit a run informs (``STAGES``): its experts dropless grouped matmuls or not, its
    weight matmuls in FP8 or not."""
    w = run.workload
    if w.fp8:
        return "grouped_fp8" if w.dropless else "fp8"
    return "grouped" if w.dropless else "base"


# after (matmul, collective, dcn) on the ``base`` runs, each share on its own runs, the earlier ones held
STAGES = ("grouped", "fp8", "grouped_fp8")
# the shares each kind of run is priced with, beyond (matmul, collective, dcn)
USES = dict(base=(), grouped=("grouped",), fp8=("fp8",), grouped_fp8=("fp8", "grouped_fp8"))


def fit_share(runs: list[Run], calibration, grid) -> float | None:
    """The value on ``grid`` whose ``calibration(value)`` predicts ``runs`` best (None without runs)."""
    if not runs:
        return None
    loss = sum(
        np.log(step_seconds(r.workload, get_hardware(r.hardware), calibration(grid))["step_s"] / r.measured_step_s) ** 2
        for r in runs
    )
    return float(grid[int(np.argmin(loss))])


def fit_family(runs: list[Run], point: tuple) -> Calibration:
    """One family's constants: ``point`` (matmul, collective, dcn, fitted on its ``base`` runs), then each of
    ``STAGES`` on its own runs (the grouped share on bf16 grouped runs, the FP8 share on dense FP8 runs, the
    FP8 grouped share on FP8 grouped runs), the earlier ones held; a stage without runs keeps its default."""
    fam = get_hardware(runs[0].hardware).family if runs else None
    cal = Calibration(*({fam: float(x)} for x in point))
    for stage in STAGES:
        value = fit_share(
            [r for r in runs if kind(r) == stage],
            lambda x, stage=stage, cal=cal: dataclasses.replace(cal, **{stage: {fam: x}}),
            GRID[stage],
        )
        if value is not None:
            cal = dataclasses.replace(cal, **{stage: {fam: value}})
    return cal


def families(runs: list[Run]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, r in enumerate(runs):
        out.setdefault(get_hardware(r.hardware).family, []).append(i)
    return out


def calibrate(runs: list[Run] | None = None) -> Calibration:
    """The constants fitted on all ``runs`` (default: the published ones), per family (``fit_family``)."""
    runs = load_runs() if runs is None else runs
    out = Calibration({}, {}, {})
    for idx in families(runs).values():
        fitted = [runs[i] for i in idx if runs[i].fitted]
        c = fit_family(fitted, fit([r for r in fitted if kind(r) == "base"]))
        out = Calibration(*({**getattr(out, f.name), **getattr(c, f.name)} for f in dataclasses.fields(Calibration)))
    return out


def leave_one_out(runs: list[Run] | None = None) -> list[dict]:
    """Per run: the constants fitted without it, its predicted and measured step time, and the error of
    the predicted speed (measured step / predicted step − 1)."""
    runs = load_runs() if runs is None else runs
    rows = [None] * len(runs)
    for fam, idx in families(runs).items():
        preds, points = grid_predictions([runs[i] for i in idx])
        for j, i in enumerate(idx):
            keep = [k for k in range(len(idx)) if k != j and runs[idx[k]].fitted and kind(runs[idx[k]]) == "base"]
            point = fit([runs[idx[k]] for k in keep], preds[keep], points)
            cal = fit_family([runs[k] for k in idx if k != i and runs[k].fitted], point)
            fitted = dict(zip(("matmul", "collective", "dcn"), map(float, point)))
            fitted |= {f: getattr(cal, f)[fam] for f in USES[kind(runs[i])] if fam in getattr(cal, f)}
            predicted = (
                float(preds[j, points.index(point)])
                if kind(runs[i]) == "base"
                else float(step_seconds(runs[i].workload, get_hardware(runs[i].hardware), cal)["step_s"])
            )
            rows[i] = dict(
                name=runs[i].name,
                hardware=runs[i].hardware,
                fitted=fitted,
                measured_step_s=runs[i].measured_step_s,
                predicted_step_s=predicted,
                error=runs[i].measured_step_s / predicted - 1,
                in_fit=runs[i].fitted,
            )
    return rows
