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


def test_readme_run_times_are_the_recorded_ones():
    import re

    import nbformat

    rows = re.findall(
        r"^\| \[`(\d\d_\w+)`\]\(\1\.ipynb\) \|.*\| ([\d.]+) s \|$", (COLAB / "README.md").read_text(), re.M
    )
    assert sorted(name for name, _ in rows) == build.names()
    for name, seconds in rows:
        recorded = nbformat.read(COLAB / f"{name}.ipynb", as_version=4).metadata["jaxpar"]["seconds"]
        assert float(seconds) == recorded, name
