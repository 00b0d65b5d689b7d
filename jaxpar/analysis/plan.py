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

Roofline (stated assumptions, every one a parameter of ``predict``):
    compute   training FLOPs per device at ``efficiency`` × peak
    memory    estimated HBM bytes per device at the HBM bandwidth
    links     each axis group's measured bytes over its link: the fast link when the group's devices fit in
              one fast domain (axes are laid out innermost-last: tensor, sequence, expert, fsdp, data), else
              the slow link
    overlap   weight and gradient traffic (groups of data/fsdp/stage axes) hides behind compute up to
              ``overlap`` × compute; activation traffic (tensor, sequence, expert) sits between dependent
              matmuls and is exposed in full
    step      max(compute, memory) + exposed communication
"""
from __future__ import annotations

import dataclasses
import functools
import math

from jaxpar.analysis.costmodel import (AXIS_ORDER, Activations, hbm_bytes, measured_bytes, memory_estimate,
                                      minimum_bytes)
from jaxpar.analysis.hardware import Hardware

WEIGHT_AXES = {"data", "fsdp", "stage"}
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

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def compile_step(cfg, layout, *, batch: int, seq: int):
    """The train step compiled for ``layout`` from abstract state and batch (nothing allocated)."""
    import jax
    import numpy as np

    from jaxpar.models import build_model
    from jaxpar.train.optim import OptimizerConfig, make_optimizer
    from jaxpar.train.step import TrainState, batch_sharding, init_program, make_train_step

    program = init_program(lambda r: build_model(cfg, rngs=r), functools.partial(make_optimizer, OptimizerConfig()),
                           layout)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         jax.eval_shape(program.create), program.shardings)
    step = make_train_step(TrainState(program.graphdef, state, program.shardings), layout)
    data = {k: jax.ShapeDtypeStruct((batch, seq), np.int32, sharding=s) for k, s in batch_sharding(layout).items()}
    return step.lower(state, data).compile()


def activations_of(cfg, *, batch: int, seq: int) -> Activations:
    import numpy as np

    moe, mla = getattr(cfg, "moe", None), getattr(cfg, "mla", None)
    slots = None
    if moe is not None and moe.capacity_factor is not None:
        slots = moe.num_experts * max(1, math.ceil(moe.capacity_factor * seq * moe.top_k / moe.num_experts))
    return Activations(batch=batch, seq=seq, embed_dim=cfg.embed_dim, num_layers=cfg.num_layers,
                       kv_heads=cfg.num_heads if mla else cfg.num_kv_heads,
                       head_dim=(mla.qk_nope_head_dim + mla.qk_rope_head_dim) if mla else cfg.head_dim,
                       num_heads=cfg.num_heads, act_bytes=np.dtype(cfg.dtype).itemsize,
                       context_parallel=cfg.context_parallel, moe_layers=getattr(cfg, "num_moe_layers", 0),
                       top_k=moe.top_k if moe else 0, capacity_slots=slots)


def link_of(key: str, mesh: dict, hw: Hardware) -> tuple[str, float]:
    """The link an axis group's collectives cross: devices are numbered with the last mesh axis fastest,
    so a group spans the block of its outermost axis times everything inside it."""
    axes = key.split("+")
    outer = min(AXIS_ORDER.index(a) for a in axes)
    span = math.prod(mesh.get(a, 1) for a in AXIS_ORDER[outer:])
    return ("fast", hw.fast_link) if span <= hw.fast_domain else ("slow", hw.slow_link)


def predict(measured: dict, *, flops: float, bytes_accessed: float, mesh: dict, hw: Hardware,
            efficiency: float = 0.6, overlap: float = 0.8) -> dict:
    compute = flops / (hw.peak_bf16_flops * efficiency)
    memory = bytes_accessed / hw.hbm_bandwidth
    comm = {key: value / link_of(key, mesh, hw)[1] for key, value in measured.items()}
    hidden = sum(t for k, t in comm.items() if set(k.split("+")) <= WEIGHT_AXES)
    exposed = max(0.0, hidden - overlap * compute) + sum(t for k, t in comm.items()
                                                         if not set(k.split("+")) <= WEIGHT_AXES)
    return dict(compute_s=compute, memory_s=memory, communication_s=comm, exposed_communication_s=exposed,
                step_s=max(compute, memory) + exposed)


def plan(model: str, mesh: str, *, batch: int, seq: int, hardware: str, devices: int | None = None,
         efficiency: float = 0.6, overlap: float = 0.8, **model_overrides) -> Plan:
    """Compile and analyse ``model`` under ``mesh`` on the simulated devices JAX has (or the first
    ``devices``) and predict it on ``hardware`` (see the module docstring)."""
    import jax
    import numpy as np

    from jaxpar.analysis import analyze_compiled
    from jaxpar.analysis.hardware import get_hardware
    from jaxpar.layout import make_layout
    from jaxpar.meshes import resolve_mesh_arg
    from jaxpar.models import get_model_preset
    from jaxpar.shardings import param_shardings

    hw = get_hardware(hardware)
    cfg = get_model_preset(model, **({"dtype": "bfloat16"} | model_overrides))
    layout = make_layout(cfg, resolve_mesh_arg(mesh), batch=batch, seq=seq,
                         devices=None if devices is None else jax.devices()[:devices])
    shape = {a: int(n) for a, n in layout.mesh.shape.items()}
    report = analyze_compiled(compile_step(cfg, layout, batch=batch, seq=seq), mesh=layout.mesh)
    act_scale = np.dtype(cfg.dtype).itemsize / 4
    measured = measured_bytes(report.ops, activation_scale=act_scale)
    shardings, acts = param_shardings(cfg, layout), activations_of(cfg, batch=batch, seq=seq)
    minimum = minimum_bytes(shardings, acts, shape, layout.rules)
    token_axes = {x for x in (*layout.rules["batch"], *layout.rules["inner_length"]) if shape[x] > 1}
    ratio = {k: measured.get(k, 0.0) / v for k, v in minimum.items() if v}
    mem = report.memory
    per_device = mem.get("argument_size_in_bytes", 0) + mem.get("temp_size_in_bytes", 0) + mem.get(
        "output_size_in_bytes", 0) - mem.get("alias_size_in_bytes", 0)
    n = layout.mesh.size
    model_flops = cfg.flops_per_token(seq) * batch * seq / n
    train_flops = model_flops * (4 / 3 if cfg.remat.value == "full" else 1.0)
    hbm = hbm_bytes(shardings, acts, shape, token_axes)
    estimate_bytes = memory_estimate(cfg, shardings, acts, shape, token_axes)
    times = predict(measured, flops=train_flops, bytes_accessed=hbm, mesh=shape, hw=hw, efficiency=efficiency,
                    overlap=overlap)
    return Plan(model=model, mesh={a: v for a, v in shape.items() if v > 1}, batch=batch, seq=seq, hardware=hw.name,
                per_device_memory_bytes=int(per_device), estimated_memory_bytes=estimate_bytes,
                fits=estimate_bytes <= hw.hbm_bytes, fits_compiled=per_device <= hw.hbm_bytes,
                flops_per_device=train_flops, model_flops_per_device=model_flops,
                bytes_accessed_per_device=hbm, collectives=report.collectives.to_json()["by_kind"],
                bytes_by_axis=measured, analytic_min_bytes_by_axis=minimum, ratio_by_axis=ratio,
                flagged=sorted(k for k, r in ratio.items() if r > FLAG_RATIO),
                link_by_axis={k: link_of(k, shape, hw)[0] for k in measured},
                predicted_step_s=times["step_s"], predicted_tokens_per_s=batch * seq / times["step_s"],
                predicted_mfu=model_flops / (times["step_s"] * hw.peak_bf16_flops), times=times,
                assumptions=dict(efficiency=efficiency, overlap=overlap, compute_dtype=cfg.dtype,
                                 remat=cfg.remat.value))
