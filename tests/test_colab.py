"""The notebooks in colab/ run: their code cells are executed in order (install lines skipped)."""
import json
import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "colab").glob("train.ipynb"))
# What each notebook must print when it ran to the end and did what it says.
EXPECTED = {"train.ipynb": ["resumed from step 80", "steps 81-90 identical to the first run: True"]}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, capsys):
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    namespace: dict = {}
    for cell in cells:
        source = "".join(line for line in cell["source"] if not line.lstrip().startswith(("!", "%")))
        exec(compile(source, f"{path.name}", "exec"), namespace)
    out = capsys.readouterr().out
    for marker in EXPECTED[path.name]:
        assert marker in out


def test_there_is_a_notebook():
    assert NOTEBOOKS
