"""Build the tutorial notebooks: colab/src/NAME.py (jupytext "percent" cells) -> colab/NAME.ipynb, run.

    python colab/build.py                 # every notebook
    python colab/build.py 03_pipeline     # some of them

Each notebook is its source with one install cell put first (the same for all, kept here once), executed
top to bottom in a fresh kernel from colab/ (nbclient), and written with its outputs and figures, so a
reader on a code host sees them without running anything. The wall time of the run is kept in the
notebook's metadata (``jaxpar.seconds``) and listed in colab/README.md.

tests/test_tutorial_*.py execute the committed notebooks again (the same way) and assert their key
numbers: every notebook leaves a dict ``key_numbers`` in its namespace.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
SOURCES = HERE / "src"

# The one place that says where a Colab runtime installs jaxpar from. Change it to your fork.
INSTALL_CELL = """\
# Install jaxpar. On Colab it comes from JAXPAR_SOURCE; from a checkout (this notebook in colab/), the
# checkout itself is installed. Skipped when jaxpar is already importable.
JAXPAR_SOURCE = "git+https://github.com/jaxpar/jaxpar.git"
import importlib.util, pathlib, subprocess, sys
if importlib.util.find_spec("jaxpar") is None:
    checkout = pathlib.Path("..", "pyproject.toml").exists()
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q",
                           *(["-e", "..[plot]"] if checkout else [f"jaxpar[plot] @ {JAXPAR_SOURCE}"])])"""

# What the test appends to read the notebook's key numbers back.
READ_KEY_NUMBERS = "import json as _json; print(_json.dumps(key_numbers, sort_keys=True))"


def names() -> list[str]:
    return sorted(p.stem for p in SOURCES.glob("[0-9][0-9]_*.py"))


def source_notebook(name: str):
    """The notebook as built from its source: the install cell, then the source's cells (no outputs)."""
    import jupytext
    import nbformat

    nb = jupytext.read(SOURCES / f"{name}.py", fmt="py:percent")
    nb.cells.insert(0, nbformat.v4.new_code_cell(INSTALL_CELL))
    nb.metadata = {
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"},
    }
    for i, cell in enumerate(nb.cells):
        cell.metadata, cell.id = {}, f"cell-{i:02d}"  # stable ids: a rebuild diffs only in outputs
    return nb


def cell_sources(nb) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source) for c in nb.cells]


def execute(nb, *, timeout: int = 900):
    """Run every cell in a fresh kernel with colab/ as the working directory; raises on the first error."""
    from nbclient import NotebookClient

    NotebookClient(
        nb, timeout=timeout, kernel_name="python3", record_timing=False, resources={"metadata": {"path": str(HERE)}}
    ).execute()
    return nb


def key_numbers(nb) -> dict:
    """Execute ``nb`` with one more cell that prints ``key_numbers`` as JSON, and return that dict."""
    import nbformat

    nb.cells.append(nbformat.v4.new_code_cell(READ_KEY_NUMBERS))
    execute(nb)
    out = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream")
    return json.loads(out.strip().splitlines()[-1])


def build(name: str) -> float:
    import nbformat

    nb = source_notebook(name)
    start = time.perf_counter()
    execute(nb)
    seconds = round(time.perf_counter() - start, 1)
    nb.metadata["jaxpar"] = {"seconds": seconds}
    nbformat.write(nb, HERE / f"{name}.ipynb")
    return seconds


def main(argv: list[str]) -> int:
    wanted = argv or names()
    unknown = sorted(set(wanted) - set(names()))
    if unknown:
        print(f"no source for {unknown} in {SOURCES}; have {names()}", file=sys.stderr)
        return 2
    for name in wanted:
        print(f"{name}: {build(name)} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
