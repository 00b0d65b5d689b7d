"""Tables of the documentation that come from data: measured results, golden files, the code's own presets.

A page asks for a table with a marker line, ``<!-- table: NAME -->``, and for one figure of the validation
notes with ``<!-- value: NAME FORMAT -->``; ``docs/hooks.py`` substitutes both when mkdocs builds the site.
Every table here is a function of files in the repository (``benchmarks/results/*.json``,
``benchmarks/published_runs.json``, ``tests/golden/``, the notebooks' metadata) or of the presets in the
code, so no measured number is typed into a page by hand. The tables live in the modules beside this file,
by topic (``render_layout``, ``render_serving``, ``render_lab``, ``render_arch``, ``render_gpu``,
``render_data``; their shared helpers in ``render_kit``).

    python docs/render.py                  # the names of the tables
    python docs/render.py moe-dropped      # one table, as the site shows it
"""

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the table modules beside this file

import render_arch  # noqa: E402
import render_data  # noqa: E402
import render_gpu  # noqa: E402
import render_lab  # noqa: E402
import render_layout  # noqa: E402
import render_serving  # noqa: E402
from render_kit import TABLES, load  # noqa: E402
from render_lab import (  # noqa: E402, F401  (the names tests/rendered.py reads)
    CALIBRATION_NAMES,
    CHIP_FAMILIES,
    note,
    serve_plan_example,
    tutorials,
    validation_calibration,
    validation_runs,
)
from render_layout import logical_axes, models_dense, models_moe, rules_matrix  # noqa: E402, F401

MODULES = (
    render_layout,
    render_serving,
    render_lab,
    render_arch,
    render_gpu,
    render_data,
)  # importing them registered their tables in TABLES

# --- Markers ------------------------------------------------------------------------------------------------

TABLE_MARKER = re.compile(r"^<!-- table: ([\w-]+) -->$", re.M)
VALUE_MARKER = re.compile(r"<!-- value: (\w+) (\S+) -->")


def substitute(text: str) -> str:
    """``text`` with every table and value marker replaced; an unknown name raises KeyError."""
    text = TABLE_MARKER.sub(lambda m: TABLES[m.group(1)](), text)
    numbers = load("plan_validation_notes.json")["numbers"] if VALUE_MARKER.search(text) else {}
    return VALUE_MARKER.sub(lambda m: format(numbers[m.group(1)], m.group(2)), text)


if __name__ == "__main__":
    names = sys.argv[1:]
    print("\n\n".join(TABLES[n]() for n in names) if names else "\n".join(TABLES))
