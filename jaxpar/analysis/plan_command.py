"""``jaxpar plan``: what a model costs per device under a layout, and its predicted step on named hardware.

    jaxpar plan --model llama3-70b --mesh fsdp=32,tensor=8 --batch 256 --seq 4096 --hardware h100 --devices 256
    jaxpar plan ... --json            # one JSON object (see ``jaxpar.analysis.plan.Plan``)
    jaxpar plan --model llama3-8b --mesh stage=4,fsdp=8 --schedule 1f1b --microbatches 16 ...   # a pipeline
    jaxpar plan --inference --model llama3-70b --mesh decode_tp --devices 8 --batch 32 --context 8192 --hardware h100

The train step is compiled on ``--devices`` simulated CPU devices from abstract inputs; nothing the size
of the model is allocated.
"""

from __future__ import annotations

import argparse
import json

from jaxpar.analysis.costmodel import flash_attention
from jaxpar.analysis.hardware import HARDWARE, get_hardware
from jaxpar.analysis.plan_report import candidates_figure as candidates_figure  # imported from here by callers
from jaxpar.analysis.plan_report import format_plan, plot_candidates
from jaxpar.errors import ConfigError, MeshError
from jaxpar.inference.layouts import PRESETS as DECODE_PRESETS
from jaxpar.mesh import simulate_cpu_devices
from jaxpar.meshes import PRESETS as MESH_PRESETS
from jaxpar.models import PRESETS as MODEL_PRESETS
from jaxpar.settings import add_quantize_argument, add_set_argument, changed
from jaxpar.shardings import MODEL_TAKES, preset_overrides, preset_settings

HELP = "compile a model's train step for a layout and predict it on named hardware"
MAX_DEVICES = 2048  # measured on a 2-core, 24 GiB machine: llama3-405b on 2048 compiles in 49 s, 1.35 GB;
# at 4096 XLA:CPU refuses ("Multiprocess computations aren't implemented")


def add_arguments(parser: argparse.ArgumentParser, /) -> None:
    _add_layout(parser)
    _add_workload(parser)
    _add_prediction(parser)
    _add_pipeline(parser)
    add_set_argument(parser, preset_settings("tiny"), MODEL_TAKES, note=" (with their defaults for --model tiny)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _add_layout(parser: argparse.ArgumentParser) -> None:
    """The model and its layout: one mesh, or the search over all of them."""
    parser.add_argument("--model", required=True, help=f"model preset: {', '.join(MODEL_PRESETS)}")
    parser.add_argument(
        "--mesh",
        default=None,
        help=f"mesh preset ({', '.join(MESH_PRESETS)}; with --inference also {', '.join(DECODE_PRESETS)}) "
        "or axis spec, e.g. fsdp=32,tensor=8",
    )
    parser.add_argument(
        "--search",
        action="store_true",
        help="rank every factorization of --devices over the axes the model can use (estimated, not compiled)",
    )
    parser.add_argument(
        "--plot",
        default=None,
        metavar="FILE",
        help="--search: plot memory and traffic per axis of the candidates (needs matplotlib)",
    )


def _add_workload(parser: argparse.ArgumentParser) -> None:
    """What the step runs: a training batch, or serving sequences (``--inference``)."""
    parser.add_argument("--batch", type=int, required=True, help="global batch in sequences")
    parser.add_argument(
        "--seq", type=int, default=None, help="sequence length (training; required without --inference)"
    )
    parser.add_argument(
        "--inference",
        action="store_true",
        help="plan serving instead: the decode layout --mesh "
        "holding --batch sequences of --context positions (prefill, decode step, largest batch)",
    )
    parser.add_argument(
        "--context", type=int, default=None, help="--inference: positions per sequence (prompt + generated)"
    )
    add_quantize_argument(parser, when="--inference, as jaxpar convert --quantize writes them")
    parser.add_argument(
        "--max-step-ms",
        type=float,
        default=None,
        help="--inference --search: rank first the "
        "layouts whose decode step (inter-token latency) is within this bound",
    )


def _add_prediction(parser: argparse.ArgumentParser) -> None:
    """The hardware, the simulated devices, and the settings that force the roofline."""
    parser.add_argument("--hardware", required=True, help=f"one of {', '.join(HARDWARE)}")
    parser.add_argument("--devices", type=int, default=8, help="simulated devices (default 8)")
    parser.add_argument(
        "--efficiency",
        type=float,
        default=None,
        help="force the roofline: share of peak FLOP/s "
        "reached (default: the step-time model from mechanisms, calibrated on published runs; "
        "the roofline with the calibrated matmul share where that model does not apply)",
    )
    parser.add_argument(
        "--overlap",
        type=float,
        default=None,
        help="force the roofline: share of compute time "
        "that hides weight/gradient traffic (default 0.8 in the roofline)",
    )


def _add_pipeline(parser: argparse.ArgumentParser) -> None:
    """The pipeline a mesh with ``stage`` > 1 runs."""
    parser.add_argument(
        "--schedule",
        default=None,
        help="pipeline schedule when the mesh has stage > 1: gpipe, "
        "1f1b, interleaved or zero_bubble (default 1f1b, as pipeline.schedule; --search: each of them)",
    )
    parser.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="pipeline microbatches per step (default 8, as "
        "pipeline.microbatches; --search: the largest m ≤ 4 × stages giving every device "
        "whole rows)",
    )
    parser.add_argument(
        "--fsdp-gather",
        default="section",
        help="when a pipeline gathers its FSDP weights: section (every tick section that runs them) or step "
        "(once, kept whole for the step), as pipeline.fsdp_gather",
    )
    parser.add_argument(
        "--grad-reduce",
        default="slice",
        help="accumulated gradients reduced over the batch axes after every slice (slice) or once a step "
        "(step), as grad_reduce in train",
    )
    parser.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        help="gradient-accumulation slices per step on a mesh without stage (as grad_accum in train: one "
        "slice's activations live at a time; default 1)",
    )
    parser.add_argument(
        "--virtual-stages",
        type=int,
        default=None,
        help="model chunks per stage (interleaved; "
        "default 1, as pipeline.virtual_stages; --search with interleaved: 2)",
    )
    for end in ("first", "last"):
        parser.add_argument(
            f"--{end}-stage-layers",
            type=int,
            default=None,
            help=f"layers on the {end} stage, the other stages splitting the rest evenly (Megatron's uneven "
            f"split, as pipeline.{end}_stage_layers; default: an even split)",
        )


def _overrides(items: list[str], model: str) -> dict:
    """``--set`` items (``jaxpar.settings``: the grammar of every command) as keyword arguments of
    ``plan``/``search``: the model fields and execution settings that differ from the preset's."""
    base, new = preset_settings(model), preset_overrides(items, model, command="plan")
    execution = changed(new["execution"], base["execution"])
    return changed(new["model"], base["model"]) | ({"execution": execution} if execution else {})


def run(args: argparse.Namespace, /) -> int:
    get_hardware(args.hardware)  # unknown names fail before any work
    if args.search == bool(args.mesh):
        raise MeshError("give either --mesh (compile and analyse one layout) or --search (rank them all)")
    if not 1 <= args.devices <= MAX_DEVICES:
        raise MeshError(
            f"--devices={args.devices}: this machine simulates 1..{MAX_DEVICES} devices "
            f"(measured here: llama3-405b on 2048 compiles in 49 s and 1.35 GB)"
        )
    _check_mode(args)
    if args.quantize is not None:
        if not args.inference:
            raise ConfigError("--quantize: weights stored quantized are served, not trained; give --inference")
        args.overrides = [*args.overrides, f"model.quantize={args.quantize}"]
    args.settings = _overrides(args.overrides, args.model)  # refused here, before any work
    simulate_cpu_devices(args.devices)
    if args.inference:
        return _inference(args)
    if args.search:
        return _search(args)
    from jaxpar.analysis.plan import plan  # deferred: imports jax, flax and the model zoo

    result = plan(
        args.model,
        args.mesh,
        batch=args.batch,
        seq=args.seq,
        hardware=args.hardware,
        efficiency=args.efficiency,
        overlap=args.overlap,
        schedule=args.schedule,
        microbatches=args.microbatches,
        virtual_stages=args.virtual_stages,
        grad_accum=args.grad_accum,
        fsdp_gather=args.fsdp_gather,
        grad_reduce=args.grad_reduce,
        first_stage_layers=args.first_stage_layers,
        last_stage_layers=args.last_stage_layers,
        **args.settings,
    )
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
    else:
        print(format_plan(result))
    return 0


def _check_mode(args) -> None:
    if args.inference:
        if not args.context or args.context < 1 or args.batch < 1:
            raise MeshError(f"--inference needs --context ≥ 1 (got {args.context}) and --batch ≥ 1 (got {args.batch})")
    elif not args.seq or args.seq < 1:
        raise MeshError(
            f"--seq ≥ 1 is required to plan a training step (got {args.seq}); for serving give --inference --context L"
        )


def _inference(args) -> int:
    from jaxpar.analysis.inference_plan import (  # deferred: imports jax, flax and the model zoo
        format_inference_plan,
        format_search,
        plan_inference,
        plot_search,
        search_inference,
    )

    bound = args.max_step_ms / 1e3 if args.max_step_ms else None
    if args.search:
        ranked, refused = search_inference(
            args.model,
            args.devices,
            batch=args.batch,
            context=args.context,
            hardware=args.hardware,
            max_step_s=bound,
            efficiency=args.efficiency,
            **args.settings,
        )
        print(
            json.dumps(
                {
                    "candidates": [p.to_json() for p in ranked],
                    "refused": [{"mesh": m, "reason": r} for m, r in refused],
                },
                indent=1,
            )
            if args.json
            else format_search(ranked, refused, max_step_s=bound)
        )
        if args.plot:
            plot_search(
                ranked,
                args.plot,
                title=f"{args.model} serving, {args.devices} × {args.hardware}, batch "
                f"{args.batch} × context {args.context}",
            )
        return 0
    result = plan_inference(
        args.model,
        args.mesh,
        batch=args.batch,
        context=args.context,
        hardware=args.hardware,
        devices=args.devices,
        efficiency=args.efficiency,
        **args.settings,
    )
    print(json.dumps(result.to_json(), indent=1) if args.json else format_inference_plan(result))
    return 0


def _search(args) -> int:
    from jaxpar.analysis.search import search  # deferred: imports jax, flax and the model zoo

    if (args.first_stage_layers, args.last_stage_layers) != (None, None):
        raise ConfigError("--first-stage-layers / --last-stage-layers price one layout: give --mesh, not --search")

    ranked, refused = search(
        args.model,
        args.devices,
        batch=args.batch,
        seq=args.seq,
        hardware=args.hardware,
        efficiency=args.efficiency,
        overlap=args.overlap,
        schedule=args.schedule,
        microbatches=args.microbatches,
        virtual_stages=args.virtual_stages,
        grad_accum=args.grad_accum,
        grad_reduce=args.grad_reduce,
        **args.settings,
    )
    if args.json:
        print(
            json.dumps(
                {"candidates": [c.__dict__ for c in ranked], "refused": [{"mesh": m, "reason": r} for m, r in refused]},
                indent=1,
            )
        )
    else:
        print(
            f"{args.model}: {len(ranked)} layouts of {args.devices} devices ({len(refused)} cannot divide the "
            f"model), batch {args.batch} × seq {args.seq} on {args.hardware}; fitting ones first, fastest first"
        )
        print(_attention_line(args))
        print(f"{'rank':>4}  {'mesh':<40}{'memory GB':>10}{'fits':>6}{'step ms':>10}{'MFU':>7}  pipeline")
        for i, c in enumerate(ranked, 1):
            mesh = ",".join(f"{a}={n}" for a, n in c.mesh.items()) or "one device"
            pipe = (
                (f"grad_accum {c.grad_accum}" if c.grad_accum > 1 else "")
                if c.pipeline is None
                else (
                    f"{c.pipeline['schedule']} m={c.pipeline['microbatches']}"
                    f"{f' v={v}' if (v := c.pipeline['virtual_stages']) > 1 else ''}"
                    f", bubble {c.pipeline['executor_bubble_fraction']:.0%}"
                    f"{f', layers {split}' if (split := c.pipeline.get('stage_layers')) else ''}"
                )
            )
            print(
                f"{i:>4}  {mesh:<40}{c.memory_bytes / 1e9:>10.1f}{'yes' if c.fits else 'no':>6}"
                f"{c.predicted_step_s * 1e3:>10.1f}{c.predicted_mfu:>7.1%}  {pipe}".rstrip()
            )
    if args.plot:
        plot_candidates(ranked, args.plot, title=f"{args.model}, {args.devices} × {args.hardware}")
    return 0


def _attention_line(args) -> str:
    """Which attention kernel the ranking priced (``costmodel.flash_attention``)."""
    from jaxpar.analysis.plan import plan_execution  # deferred: imports jax, flax and the model zoo

    if flash_attention(plan_execution(args.model, args.settings.get("execution"))):
        return "attention: a flash kernel (cuDNN, splash or ring)"
    return (
        "attention: XLA's, every score in HBM (jaxpar's default); --set execution.attention_impl=cudnn (GPUs) "
        "or =splash (TPUs) prices a flash kernel"
    )
