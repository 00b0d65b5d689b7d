"""Layout search: every factorization of N devices over the mesh axes a model can use, estimated
analytically (no compile: a candidate costs one abstract model build) and ranked by predicted step time
among those that fit.

Estimates per device (the same step-time models as ``jaxpar plan``, ``jaxpar.analysis.prediction``, with
analytic inputs: the mechanisms where they describe the model and layout, else the roofline):
    memory   16 bytes per local parameter element (float32 parameter, gradient, two Adam moments) plus
             activations: the saved layer inputs under full remat (layers × tokens × D × b_a, split by
             tensor's sequence parallelism), one layer's working set (16 × tokens × max(D, F/t) × b_a),
             and float32 logits with their gradient (2 × 4 × tokens × V/t)
    traffic  the analytic minimum bytes per axis group (``costmodel.minimum_bytes``)
    compute  model FLOPs × 4/3 under full remat
    pipeline candidates with ``stage`` > 1 (the layers must split evenly: the layout check refuses
             the rest, naming ``model.num_layers`` and ``stage``): ``schedule`` (1f1b) over m microbatches
             (default the largest m ≤ 4·p that cuts the batch into whole rows per device); compute and
             memory the executor's (``costmodel.pipeline_costs``: stage-granular recompute, the LM head
             on every stage), stretched by the executor's bubble; stage sends exposed, counted on
             the critical path (``jaxpar.analysis.plan``). The minimum traffic of the other axes ignores
             what the executor adds to it: it gathers FSDP weights and reduces data/fsdp gradients once per
             section rather than once per step (``jaxpar plan`` measures it and flags those groups), so
             pipelines combined with fsdp or data rank optimistically here.
    slices   ``grad_accum`` k for candidates without a pipeline: one slice's activations in memory, the
             weights read k times, and the step model's k microbatches (``jaxpar plan --grad-accum``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType

from jaxpar.analysis.costmodel import (
    hbm_bytes,
    memory_estimate,
    minimum_bytes,
    pipeline_costs,
    stage_input_bytes,
    stage_sends,
)
from jaxpar.analysis.hardware import get_hardware
from jaxpar.analysis.plan import (
    activations_of,
    check_grad_accum,
    pipeline_for,
    plan_execution,
    step_times,
    stored_config,
)
from jaxpar.errors import JaxparError
from jaxpar.execution import ExecutionConfig, Remat
from jaxpar.layout import Layout, check_model_layout
from jaxpar.mesh import AXES
from jaxpar.meshes import compose_rules
from jaxpar.models import get_model_preset
from jaxpar.pipeline.ops import Schedule
from jaxpar.pipeline.stack import StackSplit, balanced_ends
from jaxpar.rules import Dim
from jaxpar.shardings import normalize_spec, param_shardings
from jaxpar.train.accumulate import GradReduce, check_reduce_once

SEARCH_AXES = AXES
# what a pipelined candidate reports of its ``pipeline_costs``
PIPELINE_SUMMARY = (
    "schedule",
    "microbatches",
    "virtual_stages",
    "ticks",
    "executor_bubble_fraction",
    "lockstep_bubble_fraction",
    "bubble_fraction",
    "peak_in_flight",
    "executor",
    "stage_layers",  # where the split is uneven (Megatron's, ``balanced_ends``)
)


@dataclasses.dataclass(frozen=True)
class Candidate:
    mesh: dict
    fits: bool
    memory_bytes: float
    predicted_step_s: float
    predicted_mfu: float
    bytes_by_axis: dict
    pipeline: dict | None = None  # stage > 1: schedule, microbatches, virtual stages, bubbles
    # the step's parts (``jaxpar.analysis.prediction.predict``): compute_s, memory_s, communication_s (seconds per
    # axis group), exposed_communication_s, bubble_fraction, pipelined_s, step_s
    times: dict | None = None
    grad_accum: int = 1  # gradient-accumulation slices per step (candidates without a pipeline)


def factorizations(n: int, axes: tuple[str, ...]) -> list[dict]:
    """Every way to write n as a product of sizes over ``axes`` (sizes ≥ 1), in a fixed order."""
    if len(axes) == 1:
        return [{axes[0]: n}]
    return [{axes[0]: d} | rest for d in range(1, n + 1) if n % d == 0 for rest in factorizations(n // d, axes[1:])]


def default_microbatches(stages: int, rows: int, schedule: str) -> int:
    """The largest m ≤ 4·stages dividing the ``rows`` each batch-splitting device group gets (a multiple of
    stages for interleaved); 4·stages when none does (then refused by the checks, with the numbers)."""
    fits = [m for m in range(1, 4 * stages + 1) if rows % m == 0 and (schedule != "interleaved" or m % stages == 0)]
    return max(fits) if rows >= 1 and fits else 4 * stages


def estimate(
    cfg,
    mesh: dict,
    *,
    batch: int,
    seq: int,
    hardware: str,
    efficiency=None,
    overlap=None,
    schedule: str = "1f1b",
    microbatches: int | None = None,
    virtual_stages: int | None = None,
    base=None,
    execution: ExecutionConfig | None = None,
    grad_accum: int = 1,
    grad_reduce: str = "slice",
):
    """One candidate's ``Candidate`` (raises ``LayoutError``/``ConfigError`` when the layout cannot divide
    the model, or the pipeline or ``grad_accum``'s slices the batch), the model run as ``execution`` says
    (default ``ExecutionConfig()``). ``base``: ``base_report(cfg)``, built once for many candidates.
    ``grad_accum`` applies to candidates without a pipeline (a pipeline's microbatches play its part);
    ``grad_reduce`` to both (``jaxpar.train.accumulate.GradReduce``)."""
    execution = ExecutionConfig() if execution is None else execution
    hw = get_hardware(hardware)
    full = {a: mesh.get(a, 1) for a in SEARCH_AXES}
    v = virtual_stages or (2 if schedule == "interleaved" else 1)
    split = uneven_split(cfg, full["stage"], v)
    stored = stored_config(cfg, split.stage_layers if split else ())
    rules = _checked_rules(stored, execution, mesh, full, batch=batch, seq=seq)
    grad_reduce = str(GradReduce.parse(grad_reduce, field="grad_reduce"))
    if grad_reduce == GradReduce.STEP:
        check_reduce_once(cfg, full)
    acts, costs = _pipeline(
        cfg,
        execution,
        full,
        rules,
        batch=batch,
        seq=seq,
        schedule=schedule,
        microbatches=microbatches,
        virtual_stages=v,
        grad_reduce=grad_reduce,
        split=split,
    )
    if costs is None and grad_accum > 1:
        check_grad_accum(full, rules, batch=batch, grad_accum=grad_accum)
        acts = dataclasses.replace(acts, grad_accum=grad_accum, grad_reduce=grad_reduce)
    report = resharded(base if base is not None and stored is cfg else base_report(stored), rules, full)
    return _predicted(
        cfg,
        execution,
        mesh,
        rules,
        acts,
        costs,
        report,
        hw,
        batch=batch,
        seq=seq,
        efficiency=efficiency,
        overlap=overlap,
    )


def _predicted(
    cfg, execution, mesh: dict, rules, acts, costs, report, hw, *, batch, seq, efficiency, overlap
) -> Candidate:
    """The ``Candidate`` of ``mesh``: its minimum traffic, memory and FLOPs per device, and its step
    predicted on ``hw`` (``step_times``); ``costs``: the pipeline's (None without stage)."""
    full = {a: mesh.get(a, 1) for a in SEARCH_AXES}
    token_axes = {a for a in (*rules["batch"], *rules["inner_length"]) if full[a] > 1}
    traffic = minimum_bytes(report, acts, full, rules)
    n = math.prod(full.values())
    model_flops = cfg.flops_per_token(seq) * batch * seq / n
    remat_full = execution.remat == Remat.FULL
    train_flops = costs["flops_per_device"] if costs else model_flops * (4 / 3 if remat_full else 1.0)
    stage_path = _stage_path(acts, costs, full, rules, traffic) if costs else None
    times, _ = step_times(
        cfg,
        execution,
        full,
        {},
        traffic,
        batch=batch,
        seq=seq,
        hw=hw,
        flops=train_flops,
        bytes_accessed=hbm_bytes(report, acts, full, token_axes),
        efficiency=efficiency,
        overlap=overlap,
        stage_bytes=stage_path,
        pipeline=costs,
        grad_accum=acts.grad_accum,
        grad_reduce=acts.grad_reduce,
    )
    memory = memory_estimate(cfg, execution, report, acts, full, token_axes)
    mfu = model_flops / (times["step_s"] * hw.peak_bf16_flops)
    summary = costs and {k: costs[k] for k in PIPELINE_SUMMARY if k in costs}
    return Candidate(
        {a: n for a, n in mesh.items() if n > 1},
        memory <= hw.hbm_bytes,
        memory,
        times["step_s"],
        mfu,
        traffic,
        summary,
        times,
        acts.grad_accum,
    )


def _checked_rules(cfg, execution: ExecutionConfig, mesh: dict, full: dict, *, batch: int, seq: int):
    """The rules of the candidate ``mesh`` (``full``: its size on every axis), checked against the model."""
    spec = ",".join(f"{a}={n}" for a, n in mesh.items() if n > 1) or "data=1"
    rules = compose_rules(spec, {a for a, n in mesh.items() if n > 1})
    return check_model_layout(cfg, execution, rules, full, batch=Dim(batch, "batch"), seq=Dim(seq, "seq"))


def _stage_path(acts, costs: dict, mesh: dict, rules, traffic: dict) -> float:
    """The stage bytes on the critical path: the minimum stage traffic with its mean sends per device
    replaced by the sends on the critical path."""
    send = stage_input_bytes(acts, mesh, rules)
    mean = stage_sends(acts, mesh["stage"]) / mesh["stage"] * send
    return traffic["stage"] - mean + costs["send_ticks"] * send


def _pipeline(
    cfg, execution, mesh: dict, rules, *, batch, seq, schedule, microbatches, virtual_stages, grad_reduce, split
):
    """(Activations, ``pipeline_costs``) of a candidate; costs None without stage. ``split``: the uneven
    split of the stack (``uneven_split``), or None."""
    p, v = mesh["stage"], virtual_stages
    if p == 1:
        return activations_of(cfg, batch=batch, seq=seq, execution=execution), None
    ways = math.prod(mesh[a] for a in rules["batch"])
    m = microbatches or default_microbatches(p, batch // ways if batch % ways == 0 else 0, schedule)
    ends = (split.first, split.last) if split else (None, None)
    pipeline_for(cfg, mesh, rules, batch=batch, schedule=schedule, microbatches=m, virtual_stages=v, ends=ends)
    acts = activations_of(
        cfg,
        batch=batch,
        seq=seq,
        pipeline=(schedule, m, v),
        execution=execution,
        grad_reduce=grad_reduce,
        stage_split=split.stage_layers if split else (),
    )
    return acts, pipeline_costs(cfg, acts, mesh, remat_full=execution.remat == Remat.FULL)


def uneven_split(cfg, stages: int, virtual: int) -> StackSplit | None:
    """Megatron's uneven split (``balanced_ends``) of ``cfg``'s pipelined stack where it does not divide
    evenly over ``stages`` × ``virtual`` chunks; None where it divides, or where no split exists (the
    layout check then refuses it with the numbers)."""
    layers = cfg.num_layers - cfg.first_dense_layers
    ends = balanced_ends(layers, stages, virtual) if stages > 1 and layers % (stages * virtual) else None
    return None if ends is None else StackSplit(layers, stages, virtual, *ends)


@functools.lru_cache(maxsize=16)
def base_report(cfg):
    """The model's parameters (paths, shapes, logical names) from one abstract build on one device."""
    return param_shardings(cfg, Layout(_abstract_mesh({}), compose_rules("data=1", set())))


def resharded(base, rules, mesh: dict) -> types.SimpleNamespace:
    """``base``'s parameters with the specs and shard shapes ``rules`` give them on ``mesh``: what
    ``jaxpar.shardings.param_shardings`` reports for that layout (names and shapes do not depend on it;
    tests/test_plan.py checks the two agree), without building the model again for every candidate."""
    params = []
    for p in base.params:
        spec = tuple(normalize_spec(rules.spec(p.names), len(p.shape)))
        ways = [math.prod(mesh[a] for a in ((e,) if isinstance(e, str) else e or ())) for e in spec]
        shard = tuple(n // w for n, w in zip(p.shape, ways))
        params.append(
            dataclasses.replace(
                p, spec=spec, shard_shape=shard, bytes_per_device=math.prod(shard) * np.dtype(p.dtype).itemsize
            )
        )
    return types.SimpleNamespace(params=tuple(params))


def _abstract_mesh(shape: dict):
    """A mesh over the first N devices JAX has when there are enough, else an abstract one (shapes and
    shardings only: the search never places arrays)."""
    sizes = tuple(shape.get(a, 1) for a in AXES)
    n = math.prod(sizes)
    if n <= jax.device_count():
        return jax.make_mesh(sizes, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=jax.devices()[:n])
    return jax.sharding.AbstractMesh(sizes, AXES)


def search(
    model: str,
    devices: int,
    *,
    batch: int,
    seq: int,
    hardware: str,
    efficiency: float | None = None,
    overlap: float | None = None,
    schedule: str | None = None,
    microbatches: int | None = None,
    virtual_stages: int | None = None,
    execution: Mapping[str, Any] | None = None,
    grad_accum: int = 1,
    grad_reduce: str = "slice",
    **overrides,
) -> tuple[list, list]:
    """(ranked candidates: fitting ones by predicted step time, then the rest by memory; refused
    factorizations with their reasons) of ``model`` (its preset with ``overrides``) run as
    ``plan_execution(model, execution)`` says. ``schedule``, ``microbatches``, ``virtual_stages``: the
    pipeline of candidates with ``stage`` > 1 (defaults: every schedule, each a candidate of its own,
    ``default_microbatches``, 1 chunk a device, 2 interleaved); ``grad_accum``: the slices of candidates
    without one; ``grad_reduce``: when every candidate reduces its accumulated gradients."""
    cfg, run = get_model_preset(model, **overrides), plan_execution(model, execution)
    schedules = [Schedule.parse(schedule, field="--schedule")] if schedule else list(Schedule)
    axes = SEARCH_AXES if cfg.moe is not None else tuple(a for a in SEARCH_AXES if a != "expert")
    ranked, refused, base = [], [], base_report(cfg)
    for mesh in factorizations(devices, axes):
        piped = mesh.get("stage", 1) > 1
        for sched in schedules if piped else schedules[:1]:
            try:
                ranked.append(
                    estimate(
                        cfg,
                        mesh,
                        batch=batch,
                        seq=seq,
                        hardware=hardware,
                        efficiency=efficiency,
                        overlap=overlap,
                        schedule=str(sched),
                        microbatches=microbatches,
                        virtual_stages=virtual_stages,
                        base=base,
                        execution=run,
                        grad_accum=grad_accum,
                        grad_reduce=grad_reduce,
                    )
                )
            except JaxparError as err:
                refused.append((mesh | ({"schedule": str(sched)} if piped else {}), str(err)))
    ranked.sort(key=lambda c: (not c.fits, c.predicted_step_s if c.fits else c.memory_bytes))
    return ranked, refused
