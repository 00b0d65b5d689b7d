"""``jaxpar plan``: what a model costs per device under a layout, and its predicted step on named hardware.

    jaxpar plan --model llama3-70b --mesh fsdp=32,tensor=8 --batch 256 --seq 4096 --hardware h100 --devices 256
    jaxpar plan ... --json            # one JSON object (see ``jaxpar.analysis.plan.Plan``)

The train step is compiled on ``--devices`` simulated CPU devices from abstract inputs; nothing the size
of the model is allocated.
"""
from __future__ import annotations

import argparse
import json

HELP = "compile a model's train step for a layout and predict it on named hardware"
MAX_DEVICES = 512          # simulated devices this 2-core, 24 GiB machine compiles real-size layouts on


def add_arguments(parser: argparse.ArgumentParser, /) -> None:
    from jaxpar.analysis.hardware import HARDWARE
    parser.add_argument("--model", required=True, help="model preset")
    parser.add_argument("--mesh", required=True, help="mesh preset or axis spec, e.g. fsdp=32,tensor=8")
    parser.add_argument("--batch", type=int, required=True, help="global batch in sequences")
    parser.add_argument("--seq", type=int, required=True, help="sequence length")
    parser.add_argument("--hardware", required=True, help=f"one of {', '.join(HARDWARE)}")
    parser.add_argument("--devices", type=int, default=8, help="simulated devices (default 8)")
    parser.add_argument("--efficiency", type=float, default=0.6, help="share of peak FLOP/s reached (default 0.6)")
    parser.add_argument("--overlap", type=float, default=0.8, help="share of compute time that hides "
                        "weight/gradient traffic (default 0.8)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                        help="model config field, e.g. remat=dots or context_parallel=ring")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _overrides(items: list[str]) -> dict:
    from jaxpar.rules import LayoutError
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise LayoutError(f"--set {item!r}: expected FIELD=VALUE")
        out[key] = int(value) if value.isdigit() else value
    return out


def run(args: argparse.Namespace, /) -> int:
    from jaxpar.analysis.hardware import get_hardware
    from jaxpar.mesh import MeshError, simulate_cpu_devices

    get_hardware(args.hardware)                                      # unknown names fail before any work
    if not 1 <= args.devices <= MAX_DEVICES:
        raise MeshError(f"--devices={args.devices}: this machine simulates 1..{MAX_DEVICES} devices "
                        f"(llama3-70b on 256 compiles in about 10 s and 0.7 GB)")
    simulate_cpu_devices(args.devices)
    from jaxpar.analysis.plan import plan
    result = plan(args.model, args.mesh, batch=args.batch, seq=args.seq, hardware=args.hardware,
                  efficiency=args.efficiency, overlap=args.overlap, **_overrides(args.overrides))
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
    else:
        print(format_plan(result))
    return 0


def format_plan(p) -> str:
    gb = 1e9
    lines = [f"{p.model} on {p.mesh} ({p.hardware}), batch {p.batch} × seq {p.seq}",
             f"memory per device {p.per_device_memory_bytes / gb:.2f} GB: {'fits' if p.fits else 'DOES NOT FIT'}",
             f"FLOPs per device {p.flops_per_device:.3e} (model FLOPs {p.model_flops_per_device:.3e})",
             "", f"{'axis group':<22}{'link':<6}{'measured GB':>13}{'minimum GB':>12}{'ratio':>8}"]
    for key in sorted(set(p.bytes_by_axis) | set(p.analytic_min_bytes_by_axis)):
        got, want = p.bytes_by_axis.get(key, 0.0), p.analytic_min_bytes_by_axis.get(key, 0.0)
        ratio = f"{got / want:.2f}" if want else "—"
        flag = "  !" if key in p.flagged or not want else ""
        lines.append(f"{key:<22}{p.link_by_axis.get(key, ''):<6}{got / gb:>13.3f}{want / gb:>12.3f}{ratio:>8}{flag}")
    t = p.times
    lines += ["", f"compute {t['compute_s'] * 1e3:.1f} ms, memory {t['memory_s'] * 1e3:.1f} ms, exposed "
              f"communication {t['exposed_communication_s'] * 1e3:.1f} ms",
              f"predicted step {p.predicted_step_s * 1e3:.1f} ms: {p.predicted_tokens_per_s:,.0f} tokens/s, "
              f"MFU {p.predicted_mfu:.1%} (efficiency {p.assumptions['efficiency']}, overlap {p.assumptions['overlap']})"]
    return "\n".join(lines)
