"""Every command's ``--help`` names every mesh preset it takes and, where it takes ``--model``, every
model preset: the lists are generated from the registries, so a preset added there appears here."""

import re

import pytest

from jaxpar.cli import main
from jaxpar.inference.layouts import PRESETS as DECODE
from jaxpar.meshes import PRESETS as MESHES
from jaxpar.models import PRESETS as MODELS

TAKES = {  # command: (mesh presets it names, whether it takes --model)
    "train": (list(MESHES), True),
    "plan": (list(MESHES) + list(DECODE), True),
    "shardings": (list(MESHES), True),
    "convert": (list(MESHES), False),
    "generate": (list(DECODE) + list(MESHES), False),
    "serve": (list(DECODE) + list(MESHES), False),
}


@pytest.mark.parametrize("command", list(TAKES))
def test_help_names_every_preset(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100000")  # argparse wraps at the terminal's width, breaking at hyphens
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    meshes, takes_model = TAKES[command]
    words = set(re.findall(r"[\w.\-]+", capsys.readouterr().out))
    assert not [m for m in meshes if m not in words], command
    if takes_model:
        assert not [m for m in MODELS if m not in words], command
