"""Run a committed tutorial notebook (colab/NAME.ipynb) the way CI does and return its key numbers."""

import importlib.util
import pathlib

COLAB = pathlib.Path(__file__).resolve().parents[1] / "colab"
_spec = importlib.util.spec_from_file_location("colab_build", COLAB / "build.py")
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)

LIMIT_S = 180  # the most a notebook may take on a 2-core CPU runtime, as recorded by build.py


def run_tutorial(name: str) -> dict:
    """Check the committed notebook is its source, built and saved with outputs; execute it; key numbers."""
    import nbformat

    committed = nbformat.read(COLAB / f"{name}.ipynb", as_version=4)
    assert build.cell_sources(committed) == build.cell_sources(build.source_notebook(name)), (
        f"colab/{name}.ipynb differs from colab/src/{name}.py: run python colab/build.py {name}"
    )
    outputs = [o for c in committed.cells if c.cell_type == "code" for o in c.outputs]
    assert outputs and not [o for o in outputs if o.output_type == "error"], f"{name}: saved without outputs"
    assert 0 < committed.metadata["jaxpar"]["seconds"] <= LIMIT_S, committed.metadata["jaxpar"]
    return build.key_numbers(committed)


def figures(name: str) -> int:
    """How many matplotlib figures the committed notebook shows."""
    import nbformat

    nb = nbformat.read(COLAB / f"{name}.ipynb", as_version=4)
    return sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
