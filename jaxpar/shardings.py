"""What each device holds: per-parameter shardings and memory of a model under a layout.

The model is built abstractly (``nnx.eval_shape`` under the layout: shapes and shardings, no arrays), so
this works for models far larger than the machine, e.g. llama3-405b on 64 simulated devices.

    report = param_shardings(get_model_preset("llama3-8b"), default_layout(cfg, "fsdp_tp"))
    report.per_device_bytes, report.golden(), report.to_json(), format_table(report)

Also the ``jaxpar shardings`` subcommand (``add_arguments`` / ``run``, registered in ``jaxpar.cli``);
its ``--rules`` form prints a preset's rules table instead (``jaxpar.rules_report``).
This module imports jax, flax and the model zoo but touches no backend at import time, so the command can
still simulate devices.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import jax
import numpy as np
from flax import nnx

from jaxpar.execution import moved_field
from jaxpar.layout import Layout, default_batch_seq, make_layout
from jaxpar.mesh import AXES, simulate_cpu_devices
from jaxpar.meshes import PRESETS as MESH_PRESETS
from jaxpar.meshes import resolve_mesh_arg
from jaxpar.models import PRESETS as MODEL_PRESETS
from jaxpar.models import build_model, get_execution_preset, get_model_preset
from jaxpar.rules_report import format_rules, rules_report
from jaxpar.settings import add_set_argument, apply_overrides, positive_int

SpecEntry = None | str | list  # one dimension of a normalised spec: None | axis | [axes]
MiB, GiB = 2**20, 2**30
ADAM_MOMENT_BYTES = 2 * 4  # AdamW keeps two fp32 moments (mu, nu) per parameter element


def normalize_spec(spec, ndim: int, /) -> list[SpecEntry]:
    """A PartitionSpec as a JSON-stable list of length ``ndim`` (trailing ``None`` made explicit).

    Each entry is ``None`` (replicated), an axis name, or a list of axis names; a one-axis tuple becomes
    the plain name, so ``P(('fsdp',))`` and ``P('fsdp')`` compare equal.
    """
    out: list[SpecEntry] = []
    for entry in tuple(spec):
        if entry is None or isinstance(entry, str):
            out.append(entry)
        else:
            axes = [str(a) for a in entry]
            out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    if len(out) > ndim:
        raise ValueError(f"spec {spec} has {len(out)} entries for an array of rank {ndim}")
    return out + [None] * (ndim - len(out))


def _spec_str(spec: list[SpecEntry]) -> str:
    def one(e):
        return "None" if e is None else repr(e) if isinstance(e, str) else "(" + ", ".join(map(repr, e)) + ")"

    return "P(" + ", ".join(one(e) for e in spec) + ")"


@dataclasses.dataclass(frozen=True)
class ParamSharding:
    """One parameter: ``shard_shape`` is what every device holds (jax requires even sharding)."""

    path: str  # e.g. 'blocks/attn/q'
    shape: tuple[int, ...]
    dtype: str
    names: tuple[str | None, ...]  # logical axis names, one per dimension
    spec: tuple[SpecEntry, ...]  # normalised PartitionSpec (see ``normalize_spec``)
    shard_shape: tuple[int, ...]
    bytes_per_device: int

    @property
    def partition_spec(self) -> jax.sharding.PartitionSpec:
        return jax.sharding.PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in self.spec))

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class ShardingReport:
    """Per-parameter shardings of one model under one layout, with memory totals.

    Every device holds one shard of every parameter, so the per-device totals are the same on every
    device (the maximum over devices is that value). With AdamW (two fp32 moments sharded like the
    parameters, gradients not counted):

        per_device_adamw_bytes = Σ_p prod(shard_shape_p) × (itemsize_p + 2 × 4)
    """

    mesh: tuple[tuple[str, int], ...]  # axis -> size, physical order
    rules: str
    params: tuple[ParamSharding, ...]

    @property
    def num_devices(self) -> int:
        return math.prod(n for _, n in self.mesh)

    @property
    def num_params(self) -> int:
        return sum(p.size for p in self.params)

    @property
    def total_bytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    @property
    def per_device_bytes(self) -> int:
        return sum(p.bytes_per_device for p in self.params)

    @property
    def per_device_adamw_bytes(self) -> int:
        return sum(math.prod(p.shard_shape) * (np.dtype(p.dtype).itemsize + ADAM_MOMENT_BYTES) for p in self.params)

    def golden(self) -> dict[str, list]:
        """``{path: [shape, spec]}``: what the golden files store and compare."""
        return {p.path: [list(p.shape), list(p.spec)] for p in self.params}

    def golden_json(self) -> str:
        """``golden()`` as stable JSON: sorted paths, one parameter per line (readable diffs)."""
        lines = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(self.golden().items())]
        return "{\n" + ",\n".join(lines) + "\n}\n"

    def to_dict(self) -> dict:
        return {
            "mesh": dict(self.mesh),
            "rules": self.rules,
            "num_devices": self.num_devices,
            "params": [{**dataclasses.asdict(p), "spec": list(p.spec)} for p in self.params],
            "totals": {
                "num_params": self.num_params,
                "total_bytes": self.total_bytes,
                "per_device_bytes": self.per_device_bytes,
                "per_device_adamw_bytes": self.per_device_adamw_bytes,
            },
        }

    def to_json(self, *, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


# ------------------------------------------------------------------------------------------ building
def default_layout(
    model_cfg, preset, /, *, batch: int | None = None, seq: int | None = None, devices=None, execution=None
) -> Layout:
    """``make_layout`` with the smallest batch / seq the preset (a name, spec or MeshPreset) accepts."""
    if isinstance(preset, str):
        preset = resolve_mesh_arg(preset)
    n = len(jax.devices() if devices is None else devices)
    min_batch, min_seq = default_batch_seq(preset, n)
    return make_layout(
        model_cfg, preset, batch=batch or min_batch, seq=seq or min_seq, devices=devices, execution=execution
    )


def param_shardings(model_cfg, layout: Layout, /) -> ShardingReport:
    """Build ``model_cfg`` abstractly under ``layout`` and report every ``nnx.Param``'s sharding."""
    with layout.activate():
        abstract = nnx.eval_shape(lambda: build_model(model_cfg, rngs=nnx.Rngs(0)))
        state = nnx.state(abstract, nnx.Param)
        shardings = nnx.get_named_sharding(state, layout.mesh)
    by_path = dict(nnx.to_flat_state(shardings))
    params = []
    for path, var in nnx.to_flat_state(state):
        value, sharding = var.get_value(), by_path[path].get_value()
        shape = tuple(value.shape)
        shard = tuple(sharding.shard_shape(shape))
        params.append(
            ParamSharding(
                path="/".join(map(str, path)),
                shape=shape,
                dtype=str(np.dtype(value.dtype)),
                names=tuple(var.get_metadata().get("out_sharding") or (None,) * len(shape)),
                spec=tuple(normalize_spec(sharding.spec, len(shape))),
                shard_shape=shard,
                bytes_per_device=math.prod(shard) * np.dtype(value.dtype).itemsize,
            )
        )
    return ShardingReport(
        mesh=tuple((a, int(n)) for a, n in layout.mesh.shape.items()), rules=layout.rules.name, params=tuple(params)
    )


# ------------------------------------------------------------------------------------------ display
def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.3f} GiB" + (f" ({nbytes / MiB:.3f} MiB)" if nbytes < GiB else "")


def format_table(report: ShardingReport, /) -> str:
    """A readable table: path, shape, spec, shard shape, MiB per device; then the totals."""

    def dims(shape):
        return "×".join(map(str, shape)) or "scalar"

    rows = [("path", "shape", "spec", "shard shape", "MiB/device")]
    rows += [
        (p.path, dims(p.shape), _spec_str(list(p.spec)), dims(p.shard_shape), f"{p.bytes_per_device / MiB:.3f}")
        for p in report.params
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    mesh = ",".join(f"{a}={n}" for a, n in report.mesh if n > 1) or "1 device"
    lines += [
        "",
        f"mesh {mesh} ({report.num_devices} devices), rules {report.rules!r}",
        f"parameters: {report.num_params:,} = {_gib(report.total_bytes)} in total",
        f"per device: {_gib(report.per_device_bytes)} parameters, "
        f"{_gib(report.per_device_adamw_bytes)} with AdamW moments (2 × fp32)",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- command line
HELP = (
    "what each device holds: per-parameter shardings and memory of a model under a mesh preset; "
    "--rules prints a preset's rules table"
)


def add_arguments(parser: argparse.ArgumentParser, /) -> None:
    parser.add_argument("--model", help=f"model preset: {', '.join(MODEL_PRESETS)} (required with --mesh)")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--mesh", help=f"mesh preset ({', '.join(MESH_PRESETS)}) or axis sizes like 'data=2,fsdp=-1'")
    where.add_argument(
        "--rules",
        metavar="PRESET_OR_SPEC",
        help="print the rules table of a mesh preset or axis spec, one line per logical axis; "
        "with --model, as checked against that model",
    )
    parser.add_argument(
        "--devices",
        type=positive_int,
        default=None,
        help="simulate this many CPU devices (default: what the mesh needs, 8 if it fits)",
    )
    parser.add_argument(
        "--batch", type=positive_int, default=None, help="global batch (default: the smallest that splits)"
    )
    parser.add_argument(
        "--seq", type=positive_int, default=None, help="sequence length (default: the smallest that splits)"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    add_set_argument(parser, preset_settings("tiny"), MODEL_TAKES, note=" (with their defaults for --model tiny)")
    parser.set_defaults(_shardings_parser=parser)  # for usage errors argparse cannot express


MODEL_TAKES = ("model.", "execution.")  # what --set changes where the model is a preset


def preset_settings(model: str, /) -> dict:
    """The ``--set`` root of a command that takes a model preset: its model config and execution."""
    return {"model": get_model_preset(model), "execution": get_execution_preset(model)}


def preset_overrides(items: list[str], model: str, /, *, command: str) -> dict:
    """``preset_settings(model)`` with the ``--set`` items applied (``jaxpar.settings``' grammar)."""
    return apply_overrides(
        preset_settings(model),
        items,
        command=command,
        takes=MODEL_TAKES,
        why=" (the layout is --mesh and its flags)",
        refuse=moved_field,
    )


def default_device_count(mesh_config, /) -> int:
    """The devices a mesh needs: its size if fixed, else the smallest multiple of its fixed axes ≥ 8."""
    sizes = [getattr(mesh_config, a) for a in AXES]
    fixed = math.prod(s for s in sizes if s != -1) * math.prod(mesh_config.dcn_sizes().values())
    return fixed if -1 not in sizes else math.lcm(8, fixed)


def run(args: argparse.Namespace, /) -> int:
    if args.rules is not None:
        return _run_rules(args)
    if args.model is None:
        args._shardings_parser.error("--model is required with --mesh (--rules prints a rules table without one)")
    settings = preset_overrides(args.overrides, args.model, command="shardings")
    cfg = settings["model"]
    preset = resolve_mesh_arg(args.mesh)
    simulate_cpu_devices(args.devices if args.devices is not None else default_device_count(preset.mesh))
    layout = default_layout(cfg, preset, batch=args.batch, seq=args.seq, execution=settings["execution"])
    report = param_shardings(cfg, layout)
    if args.json:
        print(report.to_json())
    else:
        print(f"model {args.model}, mesh preset {preset.name}\n")
        print(format_table(report))
    return 0


def _run_rules(args: argparse.Namespace, /) -> int:
    """``--rules``: the table alone needs no devices; checked against ``--model`` it simulates them."""
    if args.model is None and (args.batch is not None or args.seq is not None):
        args._shardings_parser.error("--batch and --seq need --model: the table alone has no batch or sequence")
    if args.overrides:
        args._shardings_parser.error("--set changes the model of a --mesh report; --rules checks the preset as it is")
    preset = resolve_mesh_arg(args.rules, flag="--rules")
    devices = args.devices if args.devices is not None else default_device_count(preset.mesh)
    if args.model is not None:
        simulate_cpu_devices(devices)
    report = rules_report(preset, devices, args.model, batch=args.batch, seq=args.seq)
    print(report.to_json() if args.json else format_rules(report))
    return 0
