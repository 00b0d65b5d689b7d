"""Compiled-program accounting: collectives, memory and flops of a jitted function.

Everything here reads the compiled (post-SPMD-partitioning) HLO, whose shapes are
per-device. ``Collective.bytes`` is one device's RESULT size for ONE execution of the
instruction (tuple results summed; an async ``-start`` op counts only its result part,
not the operand copy or context scalars). ``Collective.executions`` is how many times
the instruction runs per program call: the product of the trip counts of the while
loops around it (``jaxpar.analysis.loops``; a layer stack under ``nnx.scan`` is one
while loop). A loop whose trip count XLA does not print counts 1 and sets
``trip_count_known=False``. ``summarize`` totals are per program call: count =
executions, bytes = bytes x executions.

Replica groups (partition ids, the mesh axes they span, the formats XLA prints): ``jaxpar.analysis.replica_groups``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import jax

from jaxpar.analysis.loops import computation_multiplicity, iter_computation_lines
from jaxpar.analysis.replica_groups import (
    expand_replica_groups,
    partition_coords,
    ring_size,
    source_target_pairs,
    varying_axes,
)

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "ragged-all-to-all")

_BITS = {
    "pred": 8,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "f4e2m1fn": 4,
    "s8": 8,
    "u8": 8,
    "f8e5m2": 8,
    "f8e4m3fn": 8,
    "f8e4m3": 8,
    "f8e4m3fnuz": 8,
    "f8e5m2fnuz": 8,
    "f8e4m3b11fnuz": 8,
    "f8e3m4": 8,
    "f8e8m0fnu": 8,
    "s16": 16,
    "u16": 16,
    "f16": 16,
    "bf16": 16,
    "s32": 32,
    "u32": 32,
    "f32": 32,
    "s64": 64,
    "u64": 64,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "token": 0,
}

_HEAD = re.compile(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([a-z][a-z0-9\-]*)\(")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_COLL_OP = re.compile(rf"\s(?:{'|'.join(KINDS)})(?:-start)?\(")


@dataclass(frozen=True)
class Collective:
    """One collective instruction. ``bytes``: result bytes of one execution (one device);
    ``executions``: times it runs per program call (loop trip counts multiplied);
    ``trip_count_known``: False when an enclosing loop's trip count is unknown (then
    counted as 1). ``group_size``: devices per replica group; for a collective-permute,
    the largest set of devices its pairs connect (ring length). ``shapes``: the result
    arrays' dimensions."""

    kind: str
    bytes: int
    group_size: int
    axes: tuple[str, ...]
    name: str
    executions: int = 1
    trip_count_known: bool = True
    shapes: tuple[tuple[int, ...], ...] = ()

    @property
    def total_bytes(self) -> int:
        """Result bytes per program call: ``bytes * executions``."""
        return self.bytes * self.executions

    @property
    def sent_bytes(self) -> float:
        """Bytes one device sends per execution with ring algorithms (n = group_size,
        R = result bytes): all-reduce 2(n-1)/n R; all-gather and all-to-all (n-1)/n R;
        reduce-scatter (n-1) R (its result is 1/n of the input); collective-permute R."""
        n = self.group_size
        factor = {"all-reduce": 2 * (n - 1) / n, "reduce-scatter": n - 1, "collective-permute": 1}.get(
            self.kind, (n - 1) / n
        )
        return factor * self.bytes


def _skip(s: str, i: int) -> int:
    """Index of the next character after separators and ``/*...*/`` comments."""
    while s[i] in ", " or s.startswith("/*", i):
        i = s.index("*/", i) + 2 if s[i] == "/" else i + 1
    return i


def _parse_shape(s: str, i: int):
    """Parse an HLO shape at ``s[i:]``; return ((bytes, dims) or nested lists of them, end)."""
    if s[i] == "(":  # a tuple; long ones carry /*index=5*/ comments
        items, i = [], _skip(s, i + 1)
        while s[i] != ")":
            item, i = _parse_shape(s, i)
            items.append(item)
            i = _skip(s, i)
        return items, i + 1
    m = _ARRAY.match(s, i)
    if m is None or m.group(1) not in _BITS:
        raise ValueError(f"cannot parse HLO shape at: {s[i : i + 40]!r}")
    dims = tuple(int(d.lstrip("<=")) for d in m.group(2).split(",") if d)
    i, depth = m.end(), 0
    while i < len(s) and (s[i] == "{" or depth):  # skip the layout, e.g. {1,0:T(8,128)}
        depth += {"{": 1, "}": -1}.get(s[i], 0)
        i += 1
    return (-(-_BITS[m.group(1)] * math.prod(dims) // 8), dims), i


def _leaves(tree) -> list[tuple[int, tuple[int, ...]]]:
    return [x for t in tree for x in _leaves(t)] if isinstance(tree, list) else [tree]


def _result(op: str, tree) -> list[tuple[int, tuple[int, ...]]]:
    """Result bytes; async ``-start`` tuples (other than all-reduce's) also hold operands."""
    if op.endswith("-start") and isinstance(tree, list) and not op.startswith("all-reduce"):
        if isinstance(tree[0], list) or not op.startswith("all-gather"):
            tree = tree[1]  # ((operands), result, ctx...) | (in, out, u32[], u32[])
        else:
            tree = tree[len(tree) // 2 :]  # (operands..., results...)
    return _leaves(tree)


def parse_collectives(hlo_text: str, /, *, mesh=None, device_order=None) -> list[Collective]:
    """All collectives of compiled HLO text, in text order (``-done`` ops skipped), each
    with its executions per program call (see ``jaxpar.analysis.loops``).

    ``mesh`` (a ``jax.sharding.Mesh``) names the axes; ``device_order`` is the
    executable's device assignment (partition id -> device), ``mesh.devices.flat``
    when omitted.
    """
    m = re.search(r"num_partitions=(\d+)", hlo_text)
    num_devices = int(m.group(1)) if m else (mesh.size if mesh is not None else 1)
    coords = partition_coords(mesh, device_order)
    names = tuple(mesh.axis_names) if mesh is not None else ()
    runs = computation_multiplicity(hlo_text)
    out = []
    for comp, line in iter_computation_lines(hlo_text):
        if not any(k in line for k in KINDS) or (head := _HEAD.match(line)) is None:
            continue
        try:
            tree, end = _parse_shape(line, head.end())
        except (ValueError, IndexError):
            if _COLL_OP.search(line):
                raise
            continue  # not an instruction with a plain shape
        op = _OPCODE.match(line, end)
        kind = op.group(1).removesuffix("-start") if op else None
        if kind not in KINDS or op.group(1).endswith("-done"):
            continue
        attrs = line[op.end() :]
        if kind == "collective-permute":
            groups = source_target_pairs(attrs)
            size = ring_size(groups)
        else:
            groups = expand_replica_groups(attrs, num_devices=num_devices)
            size = len(groups[0])
        result, run = _result(op.group(1), tree), runs.get(comp, runs[None])
        out.append(
            Collective(
                kind,
                sum(b for b, _ in result),
                size,
                varying_axes(groups, coords, names),
                head.group(1),
                run.executions,
                run.known,
                tuple(d for _, d in result),
            )
        )
    return out


@dataclass(frozen=True)
class CollectiveTotals:
    """Per-kind and per-(kind, axes) ``{'count', 'bytes'}`` sums of a program's collectives,
    per program call: ``count`` sums executions, ``bytes`` sums ``bytes * executions``.
    ``trip_counts_known``: False when some collective sits in a loop of unknown trip count
    (then counted once per enclosing execution, an underestimate)."""

    by_kind: dict
    by_kind_axes: dict
    total_bytes: int
    trip_counts_known: bool = True

    def _sum(self, field, kind, axes):
        return sum(
            v[field]
            for (k, a), v in self.by_kind_axes.items()
            if kind in (None, k) and (axes is None or set(a) == set(axes))
        )

    def bytes(self, kind: str | None = None, *, axes: tuple[str, ...] | None = None) -> int:
        """Bytes of the collectives of ``kind`` spanning exactly ``axes`` (any order)."""
        return self._sum("bytes", kind, axes)

    def count(self, kind: str | None = None, *, axes: tuple[str, ...] | None = None) -> int:
        return self._sum("count", kind, axes)  # executions, filtered like bytes()

    def to_json(self) -> dict:
        """JSON-ready dict; per-axes keys read ``"kind@axis1+axis2"`` (``"kind@"``: unknown)."""
        return {
            "total_bytes": self.total_bytes,
            "trip_counts_known": self.trip_counts_known,
            "by_kind": self.by_kind,
            "by_kind_axes": {f"{k}@{'+'.join(a)}": v for (k, a), v in self.by_kind_axes.items()},
        }


def summarize(collectives: list[Collective]) -> CollectiveTotals:
    """Sum executions and bytes x executions per kind and per (kind, axes)."""
    by_kind, by_kind_axes = {}, {}
    for c in collectives:
        for table, key in ((by_kind, c.kind), (by_kind_axes, (c.kind, c.axes))):
            entry = table.setdefault(key, {"count": 0, "bytes": 0})
            entry["count"] += c.executions
            entry["bytes"] += c.total_bytes
    return CollectiveTotals(
        by_kind, by_kind_axes, sum(c.total_bytes for c in collectives), all(c.trip_count_known for c in collectives)
    )


@dataclass(frozen=True)
class CompiledReport:
    """Collectives, memory_analysis and cost_analysis of one compiled program (per device)."""

    collectives: CollectiveTotals
    memory: dict
    flops: float
    bytes_accessed: float
    ops: tuple[Collective, ...] = ()

    def to_json(self) -> dict:
        return {
            "collectives": self.collectives.to_json(),
            "memory": dict(self.memory),
            "flops": self.flops,
            "bytes_accessed": self.bytes_accessed,
        }


_MEMORY_FIELDS = (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "temp_size_in_bytes",
    "generated_code_size_in_bytes",
    "alias_size_in_bytes",
    "peak_memory_in_bytes",
)


def analyze_compiled(compiled, /, *, mesh=None) -> CompiledReport:
    """Report on ``jax.jit(f).lower(...).compile()``.

    Without ``mesh``, the mesh of the program's first NamedSharding is used. The
    partition -> device order is that mesh's device order.
    """
    leaves = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
    program_mesh = next(
        (
            s.mesh
            for s in leaves
            if isinstance(s, jax.sharding.NamedSharding) and hasattr(s.mesh, "devices") and s.mesh.axis_names
        ),
        None,
    )
    # a program partitioned over a mesh runs partition i on mesh.devices.flat[i]
    order = None if program_mesh is None else tuple(program_mesh.devices.flat)
    mesh = program_mesh if mesh is None else mesh
    if mesh is not None and (not hasattr(mesh, "devices") or not mesh.axis_names):
        mesh = None  # an AbstractMesh or empty mesh names no devices
    ops = parse_collectives(compiled.as_text(), mesh=mesh, device_order=order)
    try:
        stats = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - some backends have none
        stats = None
    memory = {f: int(getattr(stats, f)) for f in _MEMORY_FIELDS if getattr(stats, f, None) is not None}
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # older jax: [dict]
    return CompiledReport(
        summarize(ops), memory, float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0)), tuple(ops)
    )


def analyze(fn, /, *args, mesh=None, **kwargs) -> CompiledReport:
    """Lower ``fn`` (jitted, or wrapped in ``jax.jit`` here) with ``args``, compile, analyze.

    ``args`` may be arrays or ``jax.ShapeDtypeStruct`` with ``sharding=``.
    """
    lower = getattr(fn, "lower", None) or jax.jit(fn).lower
    return analyze_compiled(lower(*args, **kwargs).compile(), mesh=mesh)
