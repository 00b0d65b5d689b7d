"""The run's layout, checked before anything is written: the mesh and rules, the divisibility of the
batch and of every dimension, the pipeline's schedule and stack, and which batch rows each process loads.
"""

from __future__ import annotations

import math

import jax

from jaxpar.layout import Layout, make_layout
from jaxpar.meshes import resolve_mesh_arg
from jaxpar.pipeline.executor import check_stack
from jaxpar.pipeline.ops import check_pipeline
from jaxpar.pipeline.schedules import build
from jaxpar.pipeline.stack import StackSplit
from jaxpar.train.accumulate import GradReduce, check_reduce_once
from jaxpar.train.config import ConfigError, TrainConfig
from jaxpar.train.step import batch_sharding


def plan_layout(cfg: TrainConfig, /, *, devices=None) -> Layout:
    """The checked layout of ``cfg`` (mesh, rules, divisibility of the batch and of every dimension)."""
    preset = resolve_mesh_arg(cfg.mesh)
    stages = preset.mesh.resolve(len(jax.devices() if devices is None else devices)).shape()["stage"]
    uneven = (cfg.pipeline.first_stage_layers, cfg.pipeline.last_stage_layers) != (None, None)
    split = stack_split(cfg, stages) if uneven else None  # the layout holds its padded rows
    extra = None if split is None else split.layout_dims()
    layout = make_layout(
        cfg.model, preset, batch=cfg.batch, seq=cfg.seq, devices=devices, execution=cfg.execution, extra_dims=extra
    )
    if layout.mesh.shape["stage"] > 1:
        _check_pipelined(cfg, layout.mesh.shape)
    if cfg.grad_reduce == GradReduce.STEP:
        check_reduce_once(cfg.model, layout.mesh.shape)
    micro = cfg.batch // batch_slices(cfg, layout)
    sharded = math.prod(layout.mesh.shape[a] for a in layout.rules["batch"])
    if micro % sharded:
        split = (
            f"pipeline.microbatches={cfg.pipeline.microbatches}"
            if layout.mesh.shape["stage"] > 1
            else f"grad_accum={cfg.grad_accum}"
        )
        raise ConfigError(
            f"batch={cfg.batch} / {split} = {micro} rows per slice "
            f"is not divisible by the {sharded} devices the batch is split over "
            f"({' × '.join(f'{a}={layout.mesh.shape[a]}' for a in layout.rules['batch'])})"
        )
    if jax.process_count() > 1:
        check_process_rows(cfg, layout, jax.process_index(), jax.process_count(), jax.local_devices())
    return layout


def stack_split(cfg: TrainConfig, stages: int) -> StackSplit | None:
    """How the pipeline splits and stores the model's stack on ``stages`` stages (None: no pipeline);
    refuses, naming the fields, a split that does not exist."""
    if stages == 1:
        for field in ("first_stage_layers", "last_stage_layers"):
            if getattr(cfg.pipeline, field) is not None:
                raise ConfigError(f"pipeline.{field} is set, but the mesh has no stage axis (stage=1)")
        return None
    p = cfg.pipeline
    return check_stack(cfg.model, stages, p.virtual_stages, None, p.first_stage_layers, p.last_stage_layers)


def _check_pipelined(cfg: TrainConfig, shape) -> None:
    """A mesh with ``stage`` > 1: the schedule, the model's stack and the batch fit the pipeline."""
    stages = shape["stage"]
    check_pipeline(cfg.pipeline.schedule, stages, cfg.pipeline.microbatches, cfg.pipeline.virtual_stages)
    p = cfg.pipeline
    check_stack(cfg.model, stages, p.virtual_stages, p.microbatches, p.first_stage_layers, p.last_stage_layers)
    if cfg.grad_accum != 1:
        raise ConfigError(
            f"grad_accum={cfg.grad_accum} with mesh stage={stages}: the pipeline's microbatches "
            "already accumulate the gradient; set pipeline.microbatches"
        )
    if cfg.batch % cfg.pipeline.microbatches:
        raise ConfigError(f"batch={cfg.batch} is not divisible by pipeline.microbatches={cfg.pipeline.microbatches}")


def batch_slices(cfg: TrainConfig, layout: Layout) -> int:
    """How many slices one step splits its batch into: the pipeline's microbatches, or ``grad_accum``."""
    return cfg.pipeline.microbatches if layout.mesh.shape["stage"] > 1 else cfg.grad_accum


def pipeline_table(cfg: TrainConfig, layout: Layout):
    """The schedule table the train step runs when the mesh has ``stage`` > 1, else None."""
    stages = layout.mesh.shape["stage"]
    if stages == 1:
        return None
    return build(cfg.pipeline.schedule, stages, cfg.pipeline.microbatches, cfg.pipeline.virtual_stages)


def check_process_rows(cfg: TrainConfig, layout: Layout, p: int, n: int, local_devices) -> None:
    """Process ``p`` of ``n`` loads rows [p·b, (p+1)·b) of each global batch, all positions
    (``data.py``), so its ``local_devices`` must hold exactly those. Refuses a layout that splits the
    batch across processes in another order, or splits positions or replicates rows across processes."""
    local = set(local_devices)
    indices = batch_sharding(layout)["inputs"].devices_indices_map((cfg.batch, cfg.seq))
    held = [index for device, index in indices.items() if device in local]
    rows = sorted({r for index in held for r in range(*index[0].indices(cfg.batch))})
    cols = {c for index in held for c in range(*index[1].indices(cfg.seq))}
    b = cfg.batch // n
    if rows != list(range(p * b, (p + 1) * b)) or len(cols) != cfg.seq:
        raise ConfigError(
            f"--mesh {cfg.mesh} on {n} processes: process {p} loads rows {p * b}..{(p + 1) * b - 1} (all "
            f"{cfg.seq} positions) of each batch, but its devices hold rows {rows[0]}..{rows[-1]} "
            f"({len(rows)} rows) and {len(cols)} positions. The axes that split the batch must span the "
            "processes in order and sequence must stay inside each process (docs/scale-out.md)"
        )
