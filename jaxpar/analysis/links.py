"""Which links a mesh axis sends over, for the step-time model (``jaxpar.analysis.steptime``).

A TPU slice is a torus whose sides are powers of two (``torus_split``). A mesh axis takes torus sides
innermost first (tensor, sequence, expert, fsdp, data, stage) and sends over both directions of each
side it spans (``axis_links``; tests/test_steptime.py checks the rule against jax's own ``mesh_utils``
assignment). On a GPU an axis whose group, with every axis inside it, fits one NVLink/PCIe domain uses the
fast link, else the NIC.
"""

from __future__ import annotations

import math

from jaxpar.analysis.costmodel import group_key
from jaxpar.mesh import AXES


def torus_split(chip, chips: int) -> list[int]:
    """A slice's torus sides: chip counts are powers of two; the smallest side doubles first
    (v5p-128 = 64 chips = 4×4×4, v5p-256 = 4×4×8, ... as the TPU docs list them; v5e-256 = 16×16)."""
    sides = [1] * chip.torus_dims
    while math.prod(sides) < chips:
        sides[sides.index(min(sides))] *= 2
    return sides


def axis_links(w, chip, *, with_class: bool = False) -> dict:
    """Bandwidth one device sends at before the collective efficiency, per mesh axis of the workload ``w``
    (``jaxpar.analysis.steptime.Workload``; with ``with_class``: (bandwidth, whether it is the slow link)).
    TPU: axes take torus sides innermost first (tensor, sequence, expert, fsdp, data, stage, jaxpar's
    order); an axis uses both directions of each side it spans, whole or in part. GPU: inside a node (the
    group of an axis and everything inside it fits in ``fast_domain``) the fast link, else the NIC."""
    out, inner = {}, 1
    if chip.torus_dims:
        sides = torus_split(chip, math.prod(int(w.mesh.get(a, 1)) for a in w.mesh))
    for axis in reversed(AXES):  # innermost first
        n = int(w.mesh.get(axis, 1))
        if chip.torus_dims:
            out[axis] = (2 * chip.ici_link * max(_take_sides(n, sides), 1), False)
        else:
            inner *= n
            out[axis] = (chip.fast_link, False) if inner <= chip.fast_domain else (chip.slow_link, True)
    return out if with_class else {a: b for a, (b, _) in out.items()}


def _take_sides(n: int, sides: list[int]) -> int:
    """How many torus sides an axis of ``n`` chips spans, taking them out of ``sides``: a side of exactly n if
    there is one, else the smallest sides first (the last one in part, its rest left for the next axis)."""
    sides[:] = sorted(x for x in sides if x > 1)
    if n in sides:
        sides.remove(n)
        return 1
    spanned = 0
    while n > 1 and sides:
        take = math.gcd(sides[0], n)
        if take == 1:  # not a power-of-two split of this side: priced as spanning it
            return spanned + 1
        spanned += 1
        n //= take
        sides[0] //= take
        sides[:] = sorted(x for x in sides if x > 1)
    return spanned


# ring steps of one collective over n devices (NCCL's counts): an all-reduce is a reduce-scatter and an
# all-gather; an all-to-all sends to each peer; a permute (a ring's shift) is one step
def _steps(kind: str, n: int) -> int:
    return {"all-reduce": 2 * (n - 1), "all-gather": n - 1, "reduce-scatter": n - 1, "collective-permute": 1}.get(
        kind, n
    )


def collective_latency(kind: str, n: int, domains: int, chip) -> float:
    """Seconds one collective of ``kind`` over ``n`` devices in ``domains`` fast domains costs beyond its
    bytes: ``chip.collective_base`` plus each ring step's hop, the steps between domains (as many as the
    same collective over one device a domain) at ``slow_hop``, the others at ``fast_hop``."""
    if n <= 1:
        return 0.0
    slow = _steps(kind, domains) if domains > 1 else 0
    return chip.collective_base + (_steps(kind, n) - slow) * chip.fast_hop + slow * chip.slow_hop


def group_span(axes, mesh: dict) -> int:
    """Devices in the block an axis group's collectives cross: devices are numbered with the last mesh axis
    fastest, so a group spans its outermost axis times every axis inside it."""
    outer = min(AXES.index(a) for a in axes)
    return math.prod(mesh.get(a, 1) for a in AXES[outer:])


def latency_by_axis(ops, mesh: dict, chip) -> dict[str, float]:
    """The collectives' latency per axis group of a compiled program's collectives (``ops``: executions
    counted), in seconds: a group meets ceil(``group_span`` / fast_domain) domains."""
    out: dict[str, float] = {}
    for op in ops:
        if not op.axes:
            continue
        n = math.prod(mesh.get(a, 1) for a in op.axes)
        domains = min(n, -(-group_span(op.axes, mesh) // chip.fast_domain))
        key = group_key(op.axes)
        out[key] = out.get(key, 0.0) + op.executions * collective_latency(op.kind, n, domains, chip)
    return out
