"""Replica groups of compiled HLO: the partition ids each group holds, and the mesh axes a group spans.

Replica groups hold partition ids; partition ``i`` runs on device ``i`` of the
executable's device assignment (``mesh.devices.flat[i]`` for a jit over a mesh,
checked with a permuted-device mesh). A collective's ``axes`` (``varying_axes``)
are the mesh axes whose coordinate varies within a replica group (union over
groups; for a collective-permute, over its source/target pairs), in mesh order.

Replica-group formats (all emitted by XLA:CPU in jax 0.10):
  * ``{{0,2},{1,3}}``; ``{}`` is one group holding every partition;
  * iota ``[4,2]<=[2,4]T(1,0)``: ``arange(8).reshape(2,4).transpose(1,0).reshape(4,2)``;
  * ``mesh['axis_0'=4,'axis_1'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_1'}``: an
    XLA-internal mesh (own axis names, unrelated to the JAX mesh) whose device array
    is ``device_ids`` (iota as above; ``arange`` when absent) reshaped to the axis
    sizes. A group is the devices sharing their coordinates on every axis NOT in
    braces (members ordered by the braced axes). ``'a':(p)s`` is the sub-axis of
    size ``s`` below a major part of size ``p`` of axis ``a``.
"""

from __future__ import annotations

import math
import re

import numpy as np

_IOTA = re.compile(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH = re.compile(r"mesh\[([^\]]*)\](?:,\s*device_ids=\((.*?)\))?\s*\{([^}]*)\}")
_LISTS = re.compile(r"\{((?:\{[\d,\s]*\},?\s*)*)\}")


def _ints(text: str) -> list[int]:
    return [int(t) for t in re.findall(r"\d+", text)]


def _iota(reshape, perm, shape) -> np.ndarray:
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    return (ids.transpose(perm) if perm else ids).reshape(shape)


def _mesh_groups(m: re.Match) -> np.ndarray:
    """Expand the ``mesh[...] {axes}`` replica-group form into a [groups, size] array."""
    axes = re.findall(r"'?([^',=\s]+)'?\s*=\s*(\d+)", m.group(1))
    names, sizes = [a for a, _ in axes], [int(z) for _, z in axes]
    ids_text = (m.group(2) or "").strip()
    iota = re.fullmatch(r"(?:\[[\d,]+\]<=)?\[([\d,]+)\](?:T\(([\d,]+)\))?", ids_text)
    if not ids_text:
        ids = np.arange(math.prod(sizes))
    elif iota:
        ids = _iota(_ints(iota.group(1)), _ints(iota.group(2) or ""), -1)
    else:
        ids = np.array(_ints(ids_text))
    refs = [
        (names.index(a), int(p) if p else 1, int(z) if z else None)
        for a, p, z in re.findall(r"'?([\w.\-]+)'?(?::\((\d+)\)(\d+))?", m.group(3))
    ]
    factors, where = [], {}
    for d, size in enumerate(sizes):  # split axes holding sub-axes into their factors
        cuts = sorted({1, size} | {c for r in refs if r[0] == d for c in (r[1], r[1] * (r[2] or size))})
        for lo, hi in list(zip(cuts, cuts[1:])) or [(1, 1)]:  # a size-1 axis: factor 1
            where[d, lo] = len(factors)
            factors.append(hi // lo)
    grouped = [where[d, p] for d, p, _ in refs]
    rest = [f for f in range(len(factors)) if f not in grouped]
    group_size = math.prod(factors[f] for f in grouped)
    return ids.reshape(factors).transpose(rest + grouped).reshape(-1, group_size)


def expand_replica_groups(attrs: str, /, *, num_devices: int) -> list[list[int]]:
    """Replica groups (lists of partition ids) of an instruction's attribute text."""
    if "replica_groups=" not in attrs:
        return [list(range(num_devices))]
    tail = attrs[attrs.index("replica_groups=") + len("replica_groups=") :]
    if (m := _MESH.match(tail)) is not None:
        return _mesh_groups(m).tolist()
    if (m := _IOTA.match(tail)) is not None:
        shape, reshape, perm = (_ints(g or "") for g in m.groups())
        return _iota(reshape, perm, shape).tolist()
    if (m := _LISTS.match(tail)) is not None:
        groups = [_ints(g) for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))]
        return groups or [list(range(num_devices))]
    raise ValueError(f"unknown replica_groups format: {tail[:80]!r}")


def partition_coords(mesh, device_order=None):
    """[num_partitions, mesh.ndim] mesh coordinates of each partition id (None: unknown)."""
    if mesh is None:
        return None
    where = {d.id: idx for idx, d in np.ndenumerate(mesh.devices)}
    order = mesh.devices.flat if device_order is None else device_order
    try:
        return np.array([where[d.id] for d in order]).reshape(-1, mesh.devices.ndim)
    except KeyError:  # the program runs on devices outside this mesh
        return None


def varying_axes(groups, coords, names) -> tuple[str, ...]:
    """The mesh axes (``names``) whose coordinate (``coords``: ``partition_coords``) varies within some
    group of ``groups``; () when the coordinates are unknown or do not cover the groups."""
    if coords is None or not groups or max(max(g) for g in groups) >= len(coords):
        return ()
    varying = np.zeros(len(names), bool)
    for g in groups:
        c = coords[list(g)]
        varying |= (c != c[0]).any(axis=0)
    return tuple(n for n, v in zip(names, varying) if v)


def ring_size(pairs) -> int:
    """The largest set of partitions a collective-permute's (source, target) ``pairs`` connect."""
    sets: dict[int, set] = {}
    for s, t in pairs:
        merged = sets.get(s, {s}) | sets.get(t, {t})
        sets.update(dict.fromkeys(merged, merged))
    return max(map(len, sets.values()), default=1)


def source_target_pairs(attrs: str, /) -> list[list[int]]:
    """The (source, target) partition-id pairs of a collective-permute's attribute text."""
    pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs)
    return [_ints(p) for p in re.findall(r"\{(\d+,\d+)\}", pairs.group(1))]
