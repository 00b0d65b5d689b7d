"""docs/render.py, importable from the tests: the tables the documentation renders from data.

The tests check data (benchmarks/results/*.json, the golden files, the code's presets) and, where a page
shows it, what ``render`` makes of that data; never the prose of the README or of docs/.
"""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_spec = importlib.util.spec_from_file_location("jaxpar_docs_render", ROOT / "docs" / "render.py")
render = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render)


def table_rows(markdown: str) -> list[list[str]]:
    """The body rows of a markdown table (header and rule dropped), each a list of stripped cells."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines[2:]]
