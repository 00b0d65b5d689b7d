"""The step on named hardware, from what the lab measured or estimated: the roofline (``predict``) or the
mechanism model (``jaxpar.analysis.steptime``), as ``step_times`` picks.

Roofline (stated assumptions, every one a parameter of ``predict``):
    compute   training FLOPs per device at ``efficiency`` × peak
    memory    estimated HBM bytes per device at the HBM bandwidth
    bubble    with ``stage`` > 1 (``pipeline_costs``): the stages' busy time max(compute, memory) is
              stretched by 1/(1 − bubble). The bubble is jaxpar's executor's, not the papers': every stage
              runs one section per tick, the one the tick's most expensive action needs (forward, input-
              gradient vjp, full vjp; masked where the action is another), so a tick lasts that section;
              the ideal (event-driven) and lockstep (slowest op per tick) bubbles are reported next to it
              (lockstep equals the executor's except in zero_bubble's W ticks). Durations are the
              executor's: B recomputes its chunk's forward, every B and W runs the LM head (masked) too
              (``costmodel.executor_durations``); the FLOPs per device count that work.
    links     each axis group's measured bytes over its link: the fast link when the group's devices fit in
              one fast domain (axes are laid out innermost-last: tensor, sequence, expert, fsdp, data,
              stage), else the slow link. ``stage`` is outermost: its group spans the whole mesh, so on
              more devices than one fast domain its sends cross the slow link (where pipelines belong)
    overlap   weight and gradient traffic (groups of data/fsdp axes) hides behind compute up to
              ``overlap`` × compute (stretched by the bubble: the executor's masked sections compute);
              activation traffic (tensor, sequence, expert) sits between dependent matmuls and is exposed
              in full. So is ``stage``: the executor sends a tick's outputs after its sections and the next
              tick reads them (a loop-carried dependency XLA does not overlap; real pipelines overlap the
              next microbatch's send with compute, this one does not), and its gradient all-reduce of the
              stage-replicated parameters runs after the last tick. A tick's sends run on every stage at
              once, so the stage time is the sends on the critical path: (ticks with a forward send +
              ticks with a backward send) × one stage input, not the mean bytes per device
    step      max(compute, memory) / (1 − bubble) + exposed communication
"""

from __future__ import annotations

from jaxpar.analysis.calibration import CALIBRATED
from jaxpar.analysis.hardware import Hardware
from jaxpar.analysis.links import group_span
from jaxpar.analysis.steptime import mechanism_times
from jaxpar.analysis.workload import workload_of
from jaxpar.execution import ExecutionConfig

WEIGHT_AXES = {"data", "fsdp"}


def link_of(key: str, mesh: dict, hw: Hardware) -> tuple[str, float]:
    """The link an axis group's collectives cross: the fast one when the block it spans
    (``links.group_span``) fits one fast domain."""
    fits = group_span(key.split("+"), mesh) <= hw.fast_domain
    return ("fast", hw.fast_link) if fits else ("slow", hw.slow_link)


def link_seconds(measured: dict, mesh: dict, hw: Hardware) -> dict:
    """Seconds of each axis group's bytes over the link its collectives cross (``link_of``)."""
    return {key: value / link_of(key, mesh, hw)[1] for key, value in measured.items()}


def predict(
    measured: dict,
    *,
    flops: float,
    bytes_accessed: float,
    mesh: dict,
    hw: Hardware,
    efficiency: float = 0.6,
    overlap: float = 0.8,
    bubble: float = 0.0,
    stage_bytes: float | None = None,
) -> dict:
    """The step time (module docstring). ``bubble``: the pipeline's idle share of stage time;
    ``stage_bytes``: the stage traffic on the step's critical path (default ``measured["stage"]``)."""
    compute = flops / (hw.peak_bf16_flops * efficiency)
    memory = bytes_accessed / hw.hbm_bandwidth
    busy = max(compute, memory) / (1 - bubble)
    traffic = dict(measured) | ({} if stage_bytes is None else {"stage": stage_bytes})
    comm = link_seconds(traffic, mesh, hw)
    hidden = sum(t for k, t in comm.items() if set(k.split("+")) <= WEIGHT_AXES)
    exposed = max(0.0, hidden - overlap * compute / (1 - bubble)) + sum(
        t for k, t in comm.items() if not set(k.split("+")) <= WEIGHT_AXES
    )
    return dict(
        compute_s=compute,
        memory_s=memory,
        bubble_fraction=bubble,
        pipelined_s=busy,
        communication_s=comm,
        exposed_communication_s=exposed,
        step_s=busy + exposed,
    )


def step_times(
    cfg,
    execution: ExecutionConfig,
    shape: dict,
    dcn: dict,
    measured: dict,
    *,
    batch: int,
    seq: int,
    hw: Hardware,
    flops: float,
    bytes_accessed: float,
    efficiency: float | None,
    overlap: float | None,
    stage_bytes: float | None = None,
    pipeline: dict | None = None,
    grad_accum: int = 1,
    grad_reduce: str = "slice",
) -> tuple[dict, dict]:
    """(times, assumptions): the mechanism model (``jaxpar.analysis.steptime``) where it describes the model
    and layout and neither ``efficiency`` nor ``overlap`` is given; otherwise the roofline ``predict`` with
    the calibrated matmul share of the chip's family (or ``efficiency``) and ``overlap`` (default 0.8).
    ``pipeline``: the executor's costs (``pipeline_costs``) where the mesh has ``stage`` > 1: its bubble
    stretches the step. ``grad_accum``: gradient-accumulation slices per step (no pipeline), their gradients
    reduced per slice or once (``grad_reduce``)."""
    base = dict(compute_dtype=execution.dtype, remat=execution.remat.value)
    ici = {a: n // dcn.get(a, 1) for a, n in shape.items()}
    bubble = pipeline["executor_bubble_fraction"] if pipeline else 0.0
    pipe = pipeline and dict(
        microbatches=pipeline["microbatches"],
        virtual_stages=pipeline["virtual_stages"],
        bubble=bubble,
        stage_bytes=stage_bytes,
        fsdp_gather=pipeline.get("fsdp_gather", "section"),
        grad_reduce=pipeline.get("grad_reduce", "slice"),
        executor=pipeline.get("executor", "one section a tick"),
    )
    work = (
        workload_of(
            cfg,
            execution,
            ici,
            batch=batch,
            seq=seq,
            dcn=dcn,
            pipeline=pipe,
            grad_accum=grad_accum,
            grad_reduce=grad_reduce,
        )
        if efficiency is None and overlap is None
        else None
    )
    if work is not None:
        times = mechanism_times(work, hw, CALIBRATED)
        return times, base | dict(model="mechanisms", calibration=times["calibration"])
    efficiency = CALIBRATED.matmul[hw.family] if efficiency is None else efficiency
    overlap = 0.8 if overlap is None else overlap
    times = predict(
        measured,
        flops=flops,
        bytes_accessed=bytes_accessed,
        mesh=shape,
        hw=hw,
        efficiency=efficiency,
        overlap=overlap,
        bubble=bubble,
        stage_bytes=stage_bytes,
    )
    return times, base | dict(model="roofline", efficiency=efficiency, overlap=overlap)
