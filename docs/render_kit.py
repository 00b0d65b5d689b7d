"""What every table module of docs/render.py shares: the repository's paths, the registry of tables
(``@table(NAME)``), and the small formatting helpers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
REPO = "https://github.com/jaxpar/jaxpar/blob/main"

TABLES: dict[str, Callable[[], str]] = {}


def table(name: str):
    def register(fn):
        TABLES[name] = fn
        return fn

    return register


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def markdown(header: list[str], rows: list[list], align: str = "") -> str:
    """A markdown table; ``align`` has one letter per column, l or r (default: l for all)."""
    align = align or "l" * len(header)
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = [header, rule, *rows]
    return "\n".join("| " + " | ".join(str(c) for c in line) + " |" for line in lines)


def pct(x: float, digits: int = 1, sign: bool = False) -> str:
    return f"{100 * x:{'+' if sign else ''}.{digits}f}%"


def mesh_text(mesh: dict) -> str:
    return ",".join(f"{a}={n}" for a, n in mesh.items()) or "one device"


def gb_text(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"
