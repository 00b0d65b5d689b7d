"""Compiled-program accounting: collectives (bytes, mesh axes), memory and flops."""
from jaxpar.analysis.hlo import (
    KINDS,
    Collective,
    CollectiveTotals,
    CompiledReport,
    analyze,
    analyze_compiled,
    expand_replica_groups,
    parse_collectives,
    summarize,
)

__all__ = [
    'KINDS', 'Collective', 'CollectiveTotals', 'CompiledReport', 'analyze', 'analyze_compiled',
    'expand_replica_groups', 'parse_collectives', 'summarize',
]
