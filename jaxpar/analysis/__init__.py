"""Compiled-program accounting: collectives (bytes, mesh axes, executions per step), memory, flops."""

from jaxpar.analysis.hlo import (
    KINDS,
    Collective,
    CollectiveTotals,
    CompiledReport,
    analyze,
    analyze_compiled,
    parse_collectives,
    summarize,
)
from jaxpar.analysis.loops import Multiplicity, computation_multiplicity
from jaxpar.analysis.replica_groups import expand_replica_groups

__all__ = [
    "KINDS",
    "Collective",
    "CollectiveTotals",
    "CompiledReport",
    "Multiplicity",
    "analyze",
    "analyze_compiled",
    "computation_multiplicity",
    "expand_replica_groups",
    "parse_collectives",
    "summarize",
]
