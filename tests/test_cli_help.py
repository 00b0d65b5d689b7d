"""Every command's ``--help`` names every mesh preset it takes and, where it takes ``--model``, every
model preset: the lists are generated from the registries, so a preset added there appears here."""

import re
from pathlib import Path

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
    "grpo": (list(MESHES), True),
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


# What each command's --set takes (the modules' own tables), as docs/training.md's table states it.
SET_TAKES = {
    "train": ("",),
    "plan": ("model.", "execution."),
    "shardings": ("model.", "execution."),
    "convert": ("model.", "execution."),
    "generate": ("execution.",),
    "serve": ("execution.",),
    "pipeline": ("pipeline.schedule", "pipeline.microbatches", "pipeline.virtual_stages"),
}


def test_set_tables_are_the_commands_own():
    from jaxpar.convert.command import TAKES as CONVERT
    from jaxpar.inference.command import TAKES as INFERENCE
    from jaxpar.pipeline.command import TAKES as PIPELINE
    from jaxpar.shardings import MODEL_TAKES

    assert SET_TAKES == {"train": ("",), "plan": MODEL_TAKES, "shardings": MODEL_TAKES, "convert": CONVERT} | {
        "generate": INFERENCE,
        "serve": INFERENCE,
        "pipeline": PIPELINE,
    }
    docs = (Path(__file__).parents[1] / "docs" / "training.md").read_text()
    for command, takes in SET_TAKES.items():
        row = next(line for line in docs.splitlines() if re.match(rf"\| [^|]*`{command}[` ]", line))
        assert command == "train" or all(f"`{t}" in row for t in takes), row


@pytest.mark.parametrize("command", list(SET_TAKES))
def test_help_lists_every_set_path_and_each_is_accepted(command, capsys, monkeypatch):
    """The paths ``--help`` lists under "fields for --set" are exactly those the command takes, and
    each is accepted with its listed default (the one parser: ``jaxpar.settings``)."""
    from jaxpar.settings import apply_overrides, field_paths
    from jaxpar.train.config import default_config

    monkeypatch.setenv("COLUMNS", "100000")
    with pytest.raises(SystemExit):
        main([command, "--help"])
    listing = capsys.readouterr().out.split("fields for --set")[1]
    listed = dict(re.findall(r"^  ([\w.]+) = (.*)$", listing, re.M))
    expected = [p for p in field_paths(default_config("tiny")) if p.startswith(SET_TAKES[command])]
    assert sorted(listed) == sorted(expected)
    root = default_config("tiny")
    items = [f"{p}={'none' if v == 'None' else v.strip(chr(39))}" for p, v in listed.items() if _settable(root, p)]
    assert apply_overrides(root, items, command=command, takes=SET_TAKES[command]) == root


def _settable(root, path: str) -> bool:
    """Whether ``path``'s parents exist in ``root`` (``model.rope_scaling.factor`` does not while
    ``model.rope_scaling`` is None)."""
    for part in path.split(".")[:-1]:
        root = getattr(root, part)
        if root is None:
            return False
    return True
