"""The tutorial set in colab/ is complete: every source built, tested and indexed; the install cell."""

import importlib.util
import os
import pathlib

import pytest
from notebooks import COLAB, build

TESTS = pathlib.Path(__file__).resolve().parent


def test_every_source_is_built_tested_and_indexed():
    names = build.names()
    assert names and names[0] == "00_start"
    index = (COLAB / "README.md").read_text()
    for name in names:
        assert (COLAB / f"{name}.ipynb").exists(), f"run python colab/build.py {name}"
        assert (TESTS / f"test_tutorial_{name}.py").exists(), name
        assert f"{name}.ipynb" in index, f"colab/README.md does not list {name}"
    assert sorted(p.stem for p in COLAB.glob("*.ipynb")) == names, "a notebook without a source"


@pytest.mark.parametrize("checkout", [True, False], ids=["checkout", "colab"])
def test_install_cell(checkout, tmp_path, monkeypatch):
    """With jaxpar missing, the cell pip-installs the checkout (from colab/) or JAXPAR_SOURCE (elsewhere)."""
    calls = []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr("subprocess.check_call", lambda args: calls.append(args))
    monkeypatch.chdir(COLAB if checkout else tmp_path)
    namespace: dict = {}
    exec(build.INSTALL_CELL, namespace)
    (args,) = calls
    assert args[1:5] == ["-m", "pip", "install", "-q"]
    if checkout:
        assert args[5:] == ["-e", "..[plot]"] and (COLAB / ".." / "pyproject.toml").exists()
    else:
        assert args[5:] == [f"jaxpar[plot] @ {namespace['JAXPAR_SOURCE']}"]
    assert os.path.isabs(args[0])


def test_index_run_times_are_the_recorded_ones():
    """The index table of colab/README.md (and of docs/tutorials.md) is rendered from the notebooks' recorded
    run times (``metadata.jaxpar.seconds``), and colab/README.md holds the current rendering."""
    import nbformat
    from rendered import render, table_rows

    rows = build.index_rows()
    assert [name for name, _, _ in rows] == build.names()
    for name, shows, seconds in rows:
        assert shows, name
        assert seconds == nbformat.read(COLAB / f"{name}.ipynb", as_version=4).metadata["jaxpar"]["seconds"], name
    assert build.index_table() in (COLAB / "README.md").read_text(), "run python colab/build.py --index"
    docs = table_rows(render.tutorials())
    assert [(row[0].split("`")[1], row[2]) for row in docs] == [(name, f"{seconds} s") for name, _, seconds in rows]
