"""``jaxpar pipeline``: a pipeline schedule's table as a text Gantt chart, with its bubble and memory.

    jaxpar pipeline --stages 4 --microbatches 8 --schedule 1f1b
    jaxpar pipeline --stages 4 --microbatches 8 --schedule interleaved --virtual-stages 2
    jaxpar pipeline --stages 4 --microbatches 8 --schedule zero_bubble --times 1,1,0.5 --json
    jaxpar pipeline --stages 4 --set pipeline.schedule=interleaved --set pipeline.virtual_stages=3

The bubble is measured twice: ``ideal``, every op starting as soon as its inputs are there (the papers'
pictures), and ``lockstep``, every tick lasting as long as its slowest op (an SPMD executor; jaxpar's is
that, except that its zero_bubble W ticks cost B + W: ``executor_bubble_fraction``). Numpy only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from jaxpar.errors import ConfigError
from jaxpar.pipeline.ops import PipelineConfig, Schedule
from jaxpar.pipeline.schedules import build
from jaxpar.settings import add_set_argument, apply_overrides

# What a schedule's table depends on: the rest of ``PipelineConfig`` places layers and weights.
TAKES = ("pipeline.schedule", "pipeline.microbatches", "pipeline.virtual_stages")

HELP = "print a pipeline schedule (gpipe, 1f1b, interleaved, zero_bubble) as a Gantt chart with its bubble"


def add_arguments(parser: argparse.ArgumentParser, /) -> None:
    parser.add_argument("--stages", type=int, required=True, help="pipeline stages (the mesh's stage axis)")
    parser.add_argument(
        "--microbatches", type=int, default=None, help="microbatches per step (as pipeline.microbatches; default 8)"
    )
    parser.add_argument(
        "--schedule", default=None, help="gpipe, 1f1b, interleaved or zero_bubble (as pipeline.schedule; default 1f1b)"
    )
    parser.add_argument(
        "--virtual-stages",
        type=int,
        default=None,
        help="model chunks per stage (interleaved only; as pipeline.virtual_stages; default 2 for interleaved, else 1)",
    )
    parser.add_argument(
        "--times",
        default=None,
        metavar="F,B[,W]",
        help="durations of one forward, "
        "backward (input gradient where there is a W) and weight gradient of one model chunk "
        "(default 1,1,1 for zero_bubble; 1,2 for the others, whose B then also does W's work)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_set_argument(parser, {"pipeline": PipelineConfig()}, TAKES, note=" (the flags above are their shorthands)")


def parse_times(text: str | None) -> dict:
    """``"1,2"`` or ``"1,1,1"`` as the keyword arguments ``t_f, t_b, t_w`` of ``Table.makespan``."""
    if text is None:
        return {}
    parts = text.split(",")
    try:
        values = [float(x) for x in parts]
    except ValueError:
        values = []
    if not 2 <= len(parts) <= 3 or len(values) != len(parts):
        raise ConfigError(f"--times {text!r}: expected F,B or F,B,W, positive numbers (e.g. 1,2 or 1,1,1)")
    return dict(zip(("t_f", "t_b", "t_w"), values))


def pipeline_config(args: argparse.Namespace, /) -> PipelineConfig:
    """The flags, then ``--set pipeline.…`` (applied after them); interleaved defaults to 2 chunks."""
    flags = dict(schedule=args.schedule, microbatches=args.microbatches, virtual_stages=args.virtual_stages)
    items = [f"pipeline.{k}={v}" for k, v in flags.items() if v is not None] + args.overrides
    cfg = apply_overrides(
        {"pipeline": PipelineConfig()}, items, command="pipeline", takes=TAKES, why=" (a schedule's table)"
    )["pipeline"]
    virtual_given = any(item.partition("=")[0].strip() == "pipeline.virtual_stages" for item in items)
    if cfg.schedule == Schedule.INTERLEAVED and not virtual_given:
        cfg = dataclasses.replace(cfg, virtual_stages=2)
    return cfg


def run(args: argparse.Namespace, /) -> int:
    cfg = pipeline_config(args)
    times = parse_times(args.times)
    table = build(cfg.schedule, args.stages, cfg.microbatches, cfg.virtual_stages)
    report = table.to_json(**times)
    print(json.dumps(report, indent=1) if args.json else format_report(table, report))
    return 0


def format_report(table, report: dict) -> str:
    """The Gantt chart and the measures below it."""
    t = report["times"]
    durations = ", ".join(f"{k}={v:g}" for k, v in t.items())
    formula = report["formula_bubble_fraction"]
    closed = "none for these times (zero_bubble's needs W <= min(F, B))" if formula is None else f"{formula:.2%}"
    chunks = " (chunk a, b, ... of the stage)" if table.virtual_stages > 1 else ""
    legend = "F forward, B backward" + (" (input gradient), W weight gradient" if table.split_backward else "")
    lines = [
        f"{table.schedule}: {table.stages} stages, {table.microbatches} microbatches, "
        f"{table.virtual_stages} chunk(s) per stage; {legend}{chunks}; '.' idle",
        "",
        table.gantt(),
        "",
        f"bubble: {report['bubble_fraction']:.2%} ideal (ops as soon as possible), "
        f"{report['lockstep_bubble_fraction']:.2%} lockstep (a tick lasts its slowest op); "
        f"times {durations}",
        f"closed form: {closed}",
        f"ticks: {table.ticks}; makespan {report['makespan']:g}",
        f"peak activations in flight per stage: {' '.join(map(str, report['peak_in_flight']))} "
        f"(buffers: {table.act_slots} act slots, {table.grad_slots} grad slots)",
    ]
    return "\n".join(lines)
