"""Rules you can read: the resolved table of a mesh preset or axis spec, one line per logical axis.

    jaxpar shardings --rules fsdp_tp                  # the preset's table and its mesh sizes
    jaxpar shardings --rules tp --model tiny          # the table as checked against a model

A table needs no devices: a ``-1`` axis is resolved from ``--devices`` (default: what the mesh needs, 8
if it fits) by arithmetic alone. Checked against a model, the table is what ``make_layout`` returns for
the smallest batch and sequence the mesh splits (or ``--batch``/``--seq``), and every line the check
changed is marked and explained: today the one such change is kv heads fewer than the tensor size
(dividing it) replicated over ``tensor``.
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax

from jaxpar.errors import MeshError
from jaxpar.layout import default_batch_seq, layout_dims, make_layout
from jaxpar.models import get_model_preset
from jaxpar.rules import ACTIVATION_AXES, CACHE_AXES, LOGICAL_AXES, PARAM_AXES, Dim, Rules

GROUPS = (
    ("params", "parameters", PARAM_AXES),
    ("activations", "activations", ACTIVATION_AXES),
    ("cache", "KV cache", CACHE_AXES),
)


def axes_text(axes: tuple[str, ...], /) -> str:
    """``replicated``, ``fsdp`` or ``(data, fsdp)``."""
    return "replicated" if not axes else axes[0] if len(axes) == 1 else "(" + ", ".join(axes) + ")"


def table_dict(rules: Rules, /) -> dict[str, dict[str, list[str]]]:
    """``{"params": {axis: [mesh axes]}, "activations": {...}}`` in the order of ``jaxpar.rules``."""
    return {key: {a: list(rules[a]) for a in axes} for key, _, axes in GROUPS}


def readable_json(value, /, indent: int = 0) -> str:
    """JSON with one logical axis (or one change) per line: dicts holding dicts or lists, and lists
    holding dicts, open up; everything else stays on one line. Stable, so golden diffs read line by line."""
    pad, end = "  " * (indent + 1), "\n" + "  " * indent
    if isinstance(value, dict) and any(isinstance(v, (dict, list)) for v in value.values()):
        items = [f"{pad}{json.dumps(k)}: {readable_json(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + end + "}"
    if isinstance(value, list) and any(isinstance(v, dict) for v in value):
        return "[\n" + ",\n".join(pad + json.dumps(v) for v in value) + end + "]"
    return json.dumps(value)


def preset_golden(preset, /) -> dict:
    """What ``tests/golden/rules/*.json`` store: name, unresolved mesh spec and the table (no devices)."""
    return {"rules": preset.rules.name, "mesh": str(preset.mesh), **table_dict(preset.rules)}


@dataclasses.dataclass(frozen=True)
class RuleChange:
    """One line the check against a model changed, and why."""

    axis: str
    before: tuple[str, ...]
    after: tuple[str, ...]
    reason: str


def explain_changes(before: Rules, after: Rules, dims: dict[str, Dim], mesh_shape: dict[str, int]) -> list[RuleChange]:
    """The lines of ``after`` that differ from ``before``, each with the model dimension behind it."""
    out = []
    for axis in LOGICAL_AXES:
        old, new = before[axis], after[axis]
        if old == new:
            continue
        ways = math.prod(mesh_shape[a] for a in old)
        where = "×".join(f"{a}={mesh_shape[a]}" for a in old)
        dim = dims.get(axis)
        if dim is not None and not new and dim.size < ways and ways % dim.size == 0:
            gqa = " (Megatron GQA)" if "kv_heads" in axis else ""
            reason = (
                f"{dim.field}={dim.size} is fewer than {where} and divides it, so every "
                f"{'×'.join(old)} rank holds the whole dimension{gqa}"
            )
        else:
            reason = "changed by the layout check" + (f" ({dim.field}={dim.size}, {where})" if dim else "")
        out.append(RuleChange(axis, old, new, reason))
    return out


@dataclasses.dataclass(frozen=True)
class RulesReport:
    """A rules table resolved on a device count, optionally as checked against one model."""

    preset: object  # jaxpar.meshes.MeshPreset
    num_devices: int
    mesh_shape: dict[str, int]  # every mesh axis, resolved
    rules: Rules  # as checked, or the preset's own without a model
    model: str | None = None
    batch: int | None = None
    seq: int | None = None
    changes: tuple[RuleChange, ...] = ()

    def to_dict(self) -> dict:
        model = (
            None
            if self.model is None
            else {
                "name": self.model,
                "batch": self.batch,
                "seq": self.seq,
                "changes": [
                    {"axis": c.axis, "before": list(c.before), "after": list(c.after), "reason": c.reason}
                    for c in self.changes
                ],
            }
        )
        return {
            "rules": self.rules.name,
            "mesh": str(self.preset.mesh),
            "devices": self.num_devices,
            "mesh_shape": self.mesh_shape,
            **table_dict(self.rules),
            "model": model,
        }

    def to_json(self) -> str:
        return readable_json(self.to_dict())


def rules_report(
    preset, num_devices: int, /, model: str | None = None, *, batch: int | None = None, seq: int | None = None
) -> RulesReport:
    """The table of ``preset`` (a ``MeshPreset``) on ``num_devices``; with ``model`` (a preset name) as
    ``make_layout`` checks it on the jax devices, which must be ``num_devices`` (``simulate_cpu_devices``)."""
    if model is None:
        shape = preset.mesh.resolve(num_devices).shape()
        return RulesReport(preset, num_devices, shape, preset.rules)
    if jax.device_count() != num_devices:
        raise MeshError(
            f"--devices {num_devices}: jax has {jax.device_count()} devices; simulate them before any JAX operation"
        )
    cfg = get_model_preset(model)
    min_batch, min_seq = default_batch_seq(preset, num_devices)
    batch, seq = batch or min_batch, seq or min_seq
    layout = make_layout(cfg, preset, batch=batch, seq=seq)
    shape = {a: int(n) for a, n in layout.mesh.shape.items()}
    dims = layout_dims(cfg, batch=Dim(batch, "batch"), seq=Dim(seq, "seq"))
    changes = explain_changes(preset.rules, layout.rules, dims, shape)
    return RulesReport(preset, num_devices, shape, layout.rules, model, batch, seq, tuple(changes))


def format_rules(report: RulesReport, /) -> str:
    """One line per logical axis, parameters then activations; ``*`` marks a line the check changed."""
    changed = {c.axis: c for c in report.changes}
    width = max(map(len, LOGICAL_AXES))
    sizes = ", ".join(f"{a}={n}" for a, n in report.mesh_shape.items() if n > 1) or "every axis 1"
    head = f"rules {report.rules.name!r}"
    if report.model is not None:
        head += f" checked against model {report.model} (batch {report.batch}, seq {report.seq})"
    devices = f"{report.num_devices} device{'s' if report.num_devices != 1 else ''}"
    lines = [head, f"mesh {report.preset.mesh} on {devices}: {sizes}"]
    for _, title, axes in GROUPS:
        lines += ["", f"{title} ({len(axes)} logical axes)"]
        for axis in axes:
            mark = f"   * was {axes_text(changed[axis].before)}" if axis in changed else ""
            lines.append(f"  {axis.ljust(width)} -> {axes_text(report.rules[axis])}{mark}")
    if report.model is not None:
        n = len(report.changes)
        lines += ["", f"lines the check against {report.model} changed: {n or 'none'}"]
        lines += [f"  {c.axis}: {axes_text(c.before)} -> {axes_text(c.after)}: {c.reason}" for c in report.changes]
    return "\n".join(lines)
