"""How many times each computation of compiled HLO text runs per call of the program.

An HLO module is a set of computations: ``ENTRY %main (...) -> ... {`` runs once; the others run when an
instruction calls them. The caller names the callee in an attribute (verified on XLA:CPU, jax 0.10):

  * ``while(...), condition=%c, body=%b, backend_config={..."known_trip_count":{"n":"2"}...}``:
    ``%b`` runs n times per execution of the while, ``%c`` n + 1 times. Without ``known_trip_count``
    (a data-dependent ``lax.while_loop``) the count is unknown: the factor is taken as 1 and the
    computations below are marked ``known=False``;
  * ``fusion``/``call``/``async-start``/``custom-call``: ``calls=%f`` or ``to_apply=%f``, once per execution
    (reduction computations of reduce/all-reduce/sort/scatter are also ``to_apply=``; they hold no
    collectives, so their factor does not matter);
  * ``conditional``: ``branch_computations={%a, %b}`` or ``true_computation=``/``false_computation=``:
    each branch counted as if it ran once per execution of the conditional (an upper bound, since
    only one runs).

A computation called from several places runs the sum over its call sites. The call graph of an HLO
module is acyclic, so the counts are finite. Text without computation headers (a bare list of
instructions, as in unit tests) is one anonymous computation that runs once (name ``None``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

_HEADER = re.compile(r"(ENTRY\s+)?%?([\w.\-]+)\s*[({]")
_INSTR = re.compile(r"\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(")
_ONE = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation|select|scatter)"
    r"=%?([\w.\-]+)"
)
_MANY = re.compile(r"\b(branch_computations|called_computations)=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_NOT_A_CALL = ("async-update", "async-done")  # they name the computation their async-start runs


@dataclass(frozen=True)
class Multiplicity:
    """Executions of a computation per program call; ``known``: every enclosing loop count is known."""

    executions: int
    known: bool = True


def iter_computation_lines(hlo_text: str, /) -> Iterator[tuple[str | None, str]]:
    """``(computation name, line)`` for every line but computation headers and closing braces."""
    current = None
    for line in hlo_text.splitlines():
        if line.startswith("}"):
            current = None
        elif (
            line[:1].isspace()
            or not line.rstrip().endswith("{")
            or line.startswith("HloModule")
            or (m := _HEADER.match(line)) is None
        ):
            yield current, line
        else:
            current = m.group(2)


def _callees(line: str, opcode: str):
    """``(callee, factor, known)`` for each computation an instruction line calls."""
    if opcode in _NOT_A_CALL:
        return []
    trip = _TRIP.search(line) if opcode == "while" else None
    n = int(trip.group(1)) if trip else 1
    out = []
    for attr, name in _ONE.findall(line):
        if opcode == "while" and attr in ("body", "condition"):
            out.append((name, n + (attr == "condition" and trip is not None), trip is not None))
        else:
            out.append((name, 1, True))
    for _, names in _MANY.findall(line):
        out.extend((n.strip().lstrip("%"), 1, True) for n in names.split(",") if n.strip())
    return out


def computation_multiplicity(hlo_text: str, /) -> dict[str | None, Multiplicity]:
    """``{computation name: Multiplicity}`` for every computation (and ``None``, the headerless part).

    Computations that nothing calls (the entry) run once.
    """
    callers: dict[str | None, list] = {None: []}
    for comp, line in iter_computation_lines(hlo_text):
        callers.setdefault(comp, [])
        if (m := _INSTR.match(line)) is None:
            continue
        for callee, factor, known in _callees(line, m.group(1)):
            callers.setdefault(callee, []).append((comp, factor, known))
    memo: dict[str | None, Multiplicity] = {}

    def resolve(comp, stack=()):
        if comp not in memo:
            if comp in stack:
                raise ValueError(f"HLO call graph has a cycle through {comp!r}")
            total, known = 0, True
            for caller, factor, edge_known in callers[comp]:
                up = resolve(caller, stack + (comp,))
                total += up.executions * factor
                known = known and up.known and edge_known
            memo[comp] = Multiplicity(total, known) if callers[comp] else Multiplicity(1)
        return memo[comp]

    for comp in callers:
        resolve(comp)
    return memo
