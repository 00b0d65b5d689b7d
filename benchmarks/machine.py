"""What a benchmark ran on, recorded beside its numbers (imported by the scripts beside it, which run as
``python benchmarks/<script>.py``)."""

from __future__ import annotations

import os
import platform


def machine() -> dict:
    """The first device's kind, the host's architecture and its CPU count."""
    import jax

    return dict(device=jax.devices()[0].device_kind, host=platform.machine(), cpus=os.cpu_count())
