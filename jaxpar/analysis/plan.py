"""The layout lab: compile a model's real training step for a layout on simulated devices, read what each
device holds, computes and sends, and predict the step on named hardware.

The step is compiled ahead of time from abstract inputs (``jax.ShapeDtypeStruct`` with shardings), so no
parameter memory is allocated: a 70B model on 256 simulated devices compiles in about 10 s and 0.7 GB.

What the CPU compile cannot say as such (so the lab corrects it, and says so):
    * ``cost_analysis`` counts a while loop's body once, and the layers run in one (``nnx.scan``): the
      training FLOPs are the model's (6 per weight per token plus attention) times 4/3 under full remat
      (the recomputed forward), and HBM traffic is estimated (``costmodel.hbm_bytes``) rather than taken
      from XLA:CPU's unfused per-op count.
    * XLA:CPU runs bf16 collectives in f32 (every all-reduce and all-gather of a bf16 TP model is f32
      in its HLO): collectives on activation axes (tensor, sequence, expert) are counted at the compute
      dtype's width. Weights are float32 parameters, gathered as such.
    * memory per device as XLA:CPU allocates it (arguments + temporaries + outputs − aliased) is
      reported, but it is not what a GPU or TPU needs: XLA:CPU computes bf16 matmuls in f32 and has no
      flash attention (MaxText's Llama2-7B, which trains on 80 GB H100s, compiles here to 137 GB). ``fits``
      uses the analytic estimate (``costmodel.memory_estimate``); ``fits_compiled`` the CPU number.

The prediction: ``jaxpar.analysis.prediction`` (the roofline, every assumption stated, or the mechanism
model of ``jaxpar.analysis.steptime``).

Stage bytes read from the program: each send's size (one microbatch's stage input on one device) is read
from the compiled collective-permutes on ``stage``; how many run per step comes from the table, since
the executor picks each tick's sends by a conditional whose branches the HLO reading counts once per tick
each (``jaxpar.analysis.loops``). Measured per device = sends over the ring × send size / p.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxpar.analysis.costmodel import (
    FLASH_KERNELS,
    Activations,
    flash_attention,
    hbm_bytes,
    measured_bytes,
    memory_parts,
    minimum_bytes,
    pipeline_costs,
    schedule_table,
    stage_input_bytes,
)
from jaxpar.analysis.hardware import get_hardware
from jaxpar.analysis.hlo import analyze_compiled
from jaxpar.analysis.prediction import link_of, step_times
from jaxpar.analysis.prediction import predict as predict  # imported from here by callers
from jaxpar.errors import ConfigError
from jaxpar.execution import ExecutionConfig, Remat
from jaxpar.layout import make_layout
from jaxpar.meshes import resolve_mesh_arg
from jaxpar.models import build_model, get_execution_preset, get_model_preset
from jaxpar.parallel.flash import check_kernel
from jaxpar.pipeline.executor import check_stack
from jaxpar.pipeline.ops import FsdpGather, PipelineConfig
from jaxpar.shardings import param_shardings
from jaxpar.train.accumulate import GradReduce, check_reduce_once
from jaxpar.train.optim import OptimizerConfig, make_optimizer
from jaxpar.train.step import TrainState, batch_sharding, init_program, make_train_step

FLAG_RATIO = 1.2


@dataclasses.dataclass(frozen=True)
class Plan:
    model: str
    mesh: dict
    batch: int
    seq: int
    hardware: str
    per_device_memory_bytes: int
    estimated_memory_bytes: float
    memory_parts: dict  # the estimate's parts: state, kept (for the backward), activations
    fits: bool
    fits_compiled: bool
    flops_per_device: float
    model_flops_per_device: float
    bytes_accessed_per_device: float
    collectives: dict
    bytes_by_axis: dict
    analytic_min_bytes_by_axis: dict
    ratio_by_axis: dict
    flagged: list
    link_by_axis: dict
    predicted_step_s: float
    predicted_tokens_per_s: float
    predicted_mfu: float
    times: dict
    assumptions: dict
    pipeline: dict | None = None  # mesh stage > 1: the schedule, its bubbles, stage sends and memory
    grad_accum: int = 1  # gradient-accumulation slices per step (no pipeline)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def plan_execution(model: str, changes: Mapping[str, Any] | None = None, /) -> ExecutionConfig:
    """The execution the lab prices ``model`` under: the preset's, computing in bfloat16, with ``changes``
    (``ExecutionConfig`` fields: ``--set execution.remat=dots``)."""
    return get_execution_preset(model, **({"dtype": "bfloat16"} | dict(changes or {})))


def cpu_compilable(execution: ExecutionConfig) -> ExecutionConfig:
    """``execution`` as the lab compiles it on CPU: a flash kernel (cuDNN, splash) as XLA's attention (the
    CPU has no cuDNN, and splash would compile as its interpreted grid; a device's attention is local, so
    the program's collectives are the same). The pricing keeps the kernel."""
    flash = str(execution.attention_impl) in FLASH_KERNELS
    return dataclasses.replace(execution, attention_impl=None) if flash else execution


def compile_step(
    cfg,
    layout,
    *,
    batch: int,
    seq: int,
    pipeline=None,
    execution: ExecutionConfig | None = None,
    grad_accum: int = 1,
    fsdp_gather: str = "section",
    grad_reduce: str = "slice",
    split=None,
):
    """The train step compiled for ``layout`` from abstract state and batch (nothing allocated), the model
    run as ``execution`` says (default ``ExecutionConfig()``; ``cpu_compilable``); ``pipeline``: the
    schedule table a mesh with ``stage`` > 1 runs (``pipeline_for``) and ``fsdp_gather`` its executor's,
    ``split`` its split of the stack (``jaxpar.pipeline.stack``; default even);
    ``grad_accum``: slices per step, their gradients reduced as ``grad_reduce`` says."""
    run = cpu_compilable(ExecutionConfig() if execution is None else execution)
    if pipeline is not None and split is None:
        split = check_stack(cfg, pipeline.stages, pipeline.virtual_stages)
    make = lambda r: build_model(cfg, execution=run, rngs=r)
    program = init_program(make, functools.partial(make_optimizer, OptimizerConfig()), layout, stack=split)
    state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        jax.eval_shape(program.create),
        program.shardings,
    )
    ts = TrainState(program.graphdef, state, program.shardings, program.stack)
    step = make_train_step(
        ts, layout, pipeline=pipeline, grad_accum=grad_accum, fsdp_gather=fsdp_gather, grad_reduce=grad_reduce
    )
    data = {k: jax.ShapeDtypeStruct((batch, seq), np.int32, sharding=s) for k, s in batch_sharding(layout).items()}
    return step.lower(state, data).compile()


def activations_of(
    cfg,
    *,
    batch: int,
    seq: int,
    pipeline: tuple | None = None,
    execution: ExecutionConfig | None = None,
    grad_accum: int = 1,
    fsdp_gather: str = "section",
    grad_reduce: str = "slice",
    stage_split: tuple = (),
) -> Activations:
    """``pipeline``: (schedule, microbatches, virtual stages) when the mesh has ``stage`` > 1, and
    ``stage_split`` the layers of each stage where they are uneven; ``execution``: how the model runs
    (default ``ExecutionConfig()``); ``grad_accum``: slices per step (no pipeline)."""
    execution = ExecutionConfig() if execution is None else execution
    moe, mla, cf = cfg.moe, cfg.mla, execution.capacity_factor
    slots = None
    if moe is not None and cf is not None:
        slots = moe.num_experts * max(1, math.ceil(cf * seq * moe.top_k / moe.num_experts))
    return Activations(
        batch=batch,
        seq=seq,
        embed_dim=cfg.embed_dim,
        num_layers=cfg.num_layers,
        kv_heads=cfg.num_heads if mla else cfg.num_kv_heads,
        head_dim=(mla.qk_nope_head_dim + mla.qk_rope_head_dim) if mla else cfg.head_dim,
        num_heads=cfg.num_heads,
        act_bytes=np.dtype(execution.dtype).itemsize,
        context_parallel=execution.context_parallel,
        moe_layers=cfg.num_moe_layers,
        top_k=moe.top_k if moe else 0,
        capacity_slots=slots,
        grad_accum=grad_accum,
        fsdp_gather=str(fsdp_gather),
        grad_reduce=str(grad_reduce),
        stage_split=tuple(stage_split),
        **(dict(zip(("schedule", "microbatches", "virtual_stages"), pipeline)) if pipeline else {}),
    )


def check_microbatches(batch: int, microbatches: int, ways: int, split: str, field: str = "pipeline.microbatches"):
    """Refuses a batch the pipeline's microbatches (or ``field``'s slices), split ``ways`` ways (``split``
    names the axes), cannot cut."""
    if batch % microbatches or batch // microbatches % ways:
        raise ConfigError(
            f"batch={batch} / {field}={microbatches} = {batch / microbatches:g} rows "
            f"per slice: must be a whole number divisible by the {ways} devices the batch is "
            f"split over ({split or 'none'})"
        )


def check_grad_accum(mesh: dict, rules, *, batch: int, grad_accum: int) -> None:
    """Refuses, naming ``grad_accum``, slices a step cannot take: fewer than one, beside a pipeline (its
    microbatches accumulate already), or not cutting the batch into whole rows on every device."""
    if grad_accum < 1:
        raise ConfigError(f"grad_accum={grad_accum}: the slices of the batch a step accumulates over (≥ 1)")
    if grad_accum > 1 and mesh.get("stage", 1) > 1:
        raise ConfigError(
            f"grad_accum={grad_accum} with mesh stage={mesh['stage']}: the pipeline's microbatches already "
            "accumulate the gradient; give --microbatches"
        )
    axes = [a for a in rules["batch"] if mesh[a] > 1]
    split = " × ".join(f"{a}={mesh[a]}" for a in axes)
    check_microbatches(batch, grad_accum, math.prod(mesh[a] for a in axes), split, field="grad_accum")


def pipeline_for(
    cfg, mesh: dict, rules, *, batch: int, schedule: str, microbatches: int, virtual_stages: int, ends=(None, None)
):
    """The table a mesh with ``stage`` > 1 runs (None without), refused as the train loop refuses it;
    ``ends``: the first and last stage's layers (``pipeline.first_stage_layers`` / ``last_stage_layers``)."""
    p = mesh.get("stage", 1)
    if p == 1:
        if ends != (None, None):
            raise ConfigError("--first-stage-layers / --last-stage-layers need a mesh with stage > 1")
        return None
    table = schedule_table(str(schedule), p, microbatches, virtual_stages)
    check_stack(cfg, p, virtual_stages, microbatches, *ends)
    axes = [a for a in rules["batch"] if mesh[a] > 1]
    check_microbatches(
        batch, microbatches, math.prod(mesh[a] for a in axes), " × ".join(f"{a}={mesh[a]}" for a in axes)
    )
    return table


def stage_sends_measured(ops, costs: dict, *, act_bytes: int) -> tuple[list, dict]:
    """(the collectives but the stage sends, what the sends cost): ``send_bytes``, one send on one device
    as compiled (counted at the compute dtype's width: XLA:CPU sends bf16 as f32), ``per_device`` (the
    mean over the devices: sends over the ring × send bytes / p) and ``critical_path`` (ticks with
    sends × send bytes). See the module docstring for why the count comes from the table."""
    sends = [op for op in ops if op.kind == "collective-permute" and op.axes == ("stage",)]
    size = float(max((min(op.bytes, act_bytes * math.prod(op.shapes[0])) for op in sends), default=0))
    return [op for op in ops if op not in sends], dict(
        send_bytes=size, per_device=costs["sends"] * size / costs["stages"], critical_path=costs["send_ticks"] * size
    )


def _pipeline_traffic(report, costs, acts, shape, rules, act_scale):
    """Measured bytes per axis group with the stage sends counted per the table, and the stage bytes on
    the critical path (None without a pipeline)."""
    if costs is None:
        return measured_bytes(report.ops, activation_scale=act_scale), None
    ops, sends = stage_sends_measured(report.ops, costs, act_bytes=acts.act_bytes)
    measured = measured_bytes(ops, activation_scale=act_scale)
    others = measured.get("stage", 0.0)
    measured["stage"] = others + sends["per_device"]
    costs.update(
        stage_send_bytes=sends["send_bytes"],
        stage_send_bytes_analytic=stage_input_bytes(acts, shape, rules),
        stage_bytes_per_device=sends["per_device"],
        stage_critical_path_bytes=sends["critical_path"],
    )
    return measured, others + sends["critical_path"]


def plan(
    model: str,
    mesh: str,
    *,
    batch: int,
    seq: int,
    hardware: str,
    devices: int | None = None,
    efficiency: float | None = None,
    overlap: float | None = None,
    schedule: str | None = None,
    microbatches: int | None = None,
    virtual_stages: int | None = None,
    execution: Mapping[str, Any] | None = None,
    grad_accum: int = 1,
    fsdp_gather: str = "section",
    grad_reduce: str = "slice",
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    **model_overrides,
) -> Plan:
    """Compile and analyse ``model`` (its preset with ``model_overrides``) under ``mesh`` on the simulated
    devices JAX has (or the first ``devices``) and predict it on ``hardware`` (see the module docstring),
    run as ``plan_execution(model, execution)`` says. With ``stage`` > 1 the step runs ``schedule`` over
    ``microbatches``, ``virtual_stages`` and ``fsdp_gather`` (defaults: ``PipelineConfig``'s), its stack
    split evenly or as ``first_stage_layers`` / ``last_stage_layers`` say (Megatron's); without,
    ``grad_accum`` slices of the batch per step, reduced as ``grad_reduce`` says. ``efficiency``/``overlap``:
    force the roofline with these (``step_times``)."""
    hw = get_hardware(hardware)
    cfg, run = get_model_preset(model, **model_overrides), plan_execution(model, execution)
    check_kernel(run.attention_impl, hw.platform, run.context_parallel)  # a kernel the chip cannot run
    preset = resolve_mesh_arg(mesh)
    devices = None if devices is None else jax.devices()[:devices]
    pipe = _pipeline_settings(schedule, microbatches, virtual_stages)
    ends = (first_stage_layers, last_stage_layers)
    split = _uneven_split(cfg, preset, devices, pipe[2], ends)
    extra = None if split is None else split.layout_dims()
    layout = make_layout(cfg, preset, batch=batch, seq=seq, devices=devices, execution=run, extra_dims=extra)
    shape = {a: int(n) for a, n in layout.mesh.shape.items()}
    check_grad_accum(shape, layout.rules, batch=batch, grad_accum=grad_accum)
    table = pipeline_for(
        cfg, shape, layout.rules, batch=batch, schedule=pipe[0], microbatches=pipe[1], virtual_stages=pipe[2], ends=ends
    )
    fsdp_gather = FsdpGather.parse(fsdp_gather, field="pipeline.fsdp_gather")
    grad_reduce = GradReduce.parse(grad_reduce, field="grad_reduce")
    if grad_reduce == GradReduce.STEP:
        check_reduce_once(cfg, layout.mesh.shape)
    acts = activations_of(
        cfg,
        batch=batch,
        seq=seq,
        pipeline=pipe if table else None,
        execution=run,
        grad_accum=grad_accum,
        fsdp_gather=fsdp_gather,
        grad_reduce=grad_reduce,
        stage_split=() if split is None else split.stage_layers,
    )
    step = dict(pipeline=table, execution=run, grad_accum=grad_accum, fsdp_gather=fsdp_gather, grad_reduce=grad_reduce)
    compiled = compile_step(cfg, layout, batch=batch, seq=seq, split=split, **step)
    report = analyze_compiled(compiled, mesh=layout.mesh)
    costs = pipeline_costs(cfg, acts, shape, remat_full=run.remat == Remat.FULL) if table else None
    measured, stage_path = _pipeline_traffic(report, costs, acts, shape, layout.rules, acts.act_bytes / 4)
    return _price(
        model,
        cfg,
        run,
        layout,
        preset,
        hw,
        report,
        acts,
        costs,
        measured,
        stage_path,
        batch=batch,
        seq=seq,
        efficiency=efficiency,
        overlap=overlap,
    )


def stored_config(cfg, stage_split: tuple = ()):
    """``cfg`` as the stages store it: an uneven split (``stage_split``: each stage's layers) pads every
    stage's chunks to the largest one's rows."""
    if not stage_split:
        return cfg
    padding = len(stage_split) * max(stage_split) - sum(stage_split)
    return dataclasses.replace(cfg, num_layers=cfg.num_layers + padding)


def _uneven_split(cfg, preset, devices, virtual: int, ends: tuple):
    """The pipeline's uneven split of the stack (``jaxpar.pipeline.stack``) where ``ends`` sets one (the
    layout then checks its padded storage rows), else None."""
    if ends == (None, None):
        return None
    stages = preset.mesh.resolve(len(jax.devices() if devices is None else devices)).shape()["stage"]
    if stages == 1:
        raise ConfigError("--first-stage-layers / --last-stage-layers need a mesh with stage > 1")
    return check_stack(cfg, stages, virtual, None, *ends)


def _pipeline_settings(schedule: str | None, microbatches: int | None, virtual_stages: int | None) -> tuple:
    """(schedule, microbatches, virtual stages), ``PipelineConfig``'s default for each one not given."""
    default = PipelineConfig()
    return (
        schedule or str(default.schedule),
        microbatches or default.microbatches,
        virtual_stages or default.virtual_stages,
    )


def _price(
    model, cfg, run, layout, preset, hw, report, acts, costs, measured, stage_path, *, batch, seq, efficiency, overlap
) -> Plan:
    """The plan of the compiled step: its FLOPs, HBM traffic and memory per device, the minimum traffic of
    each axis group, and the step predicted on ``hw`` (``step_times``)."""
    shape = {a: int(n) for a, n in layout.mesh.shape.items()}
    remat_full = run.remat == Remat.FULL
    shardings = param_shardings(stored_config(cfg, acts.stage_split), layout)
    minimum = minimum_bytes(shardings, acts, shape, layout.rules)
    token_axes = {x for x in (*layout.rules["batch"], *layout.rules["inner_length"]) if shape[x] > 1}
    model_flops = cfg.flops_per_token(seq) * batch * seq / layout.mesh.size
    train_flops = costs["flops_per_device"] if costs else model_flops * (4 / 3 if remat_full else 1.0)
    hbm = hbm_bytes(shardings, acts, shape, token_axes)
    memory = memory_parts(cfg, run, shardings, acts, shape, token_axes)
    if costs:
        costs["memory"] = memory
    times, assumptions = step_times(
        cfg,
        run,
        shape,
        preset.mesh.dcn_sizes(),
        measured,
        batch=batch,
        seq=seq,
        hw=hw,
        flops=train_flops,
        bytes_accessed=hbm,
        efficiency=efficiency,
        overlap=overlap,
        stage_bytes=stage_path,
        pipeline=costs,
        grad_accum=acts.grad_accum,
        grad_reduce=acts.grad_reduce,
    )
    assumptions["attention"] = "flash" if flash_attention(run) else "xla: every score in HBM"
    plan = _make_plan(
        model,
        batch,
        seq,
        hw,
        shape,
        report,
        measured,
        minimum,
        memory,
        train_flops,
        model_flops,
        hbm,
        times,
        costs,
        assumptions,
    )
    return dataclasses.replace(plan, grad_accum=acts.grad_accum)


def _allocated_bytes(memory: dict) -> int:
    """Memory per device as XLA:CPU allocates it: arguments + temporaries + outputs − aliased."""
    return (
        memory.get("argument_size_in_bytes", 0)
        + memory.get("temp_size_in_bytes", 0)
        + memory.get("output_size_in_bytes", 0)
        - memory.get("alias_size_in_bytes", 0)
    )


def _make_plan(
    model,
    batch,
    seq,
    hw,
    shape,
    report,
    measured,
    minimum,
    memory,
    train_flops,
    model_flops,
    hbm,
    times,
    costs,
    assumptions,
) -> Plan:
    ratio = {k: measured.get(k, 0.0) / v for k, v in minimum.items() if v}
    estimate = memory["state"] + memory["activations"]
    per_device = _allocated_bytes(report.memory)
    return Plan(
        model=model,
        mesh={a: v for a, v in shape.items() if v > 1},
        batch=batch,
        seq=seq,
        hardware=hw.name,
        per_device_memory_bytes=int(per_device),
        estimated_memory_bytes=estimate,
        memory_parts=memory,
        fits=estimate <= hw.hbm_bytes,
        fits_compiled=per_device <= hw.hbm_bytes,
        flops_per_device=train_flops,
        model_flops_per_device=model_flops,
        bytes_accessed_per_device=hbm,
        collectives=report.collectives.to_json()["by_kind"],
        bytes_by_axis=measured,
        analytic_min_bytes_by_axis=minimum,
        ratio_by_axis=ratio,
        flagged=sorted(k for k, r in ratio.items() if r > FLAG_RATIO),
        link_by_axis={k: link_of(k, shape, hw)[0] for k in measured},
        predicted_step_s=times["step_s"],
        predicted_tokens_per_s=batch * seq / times["step_s"],
        predicted_mfu=model_flops / (times["step_s"] * hw.peak_bf16_flops),
        times=times,
        assumptions=assumptions,
        pipeline=costs,
    )
