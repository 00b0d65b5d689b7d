"""Tables of the code's architecture, read from the code itself: the import layers and contracts that
``[tool.importlinter]`` in pyproject.toml declares (and ``.ci/lint-imports`` enforces), and the hooks of
the ``LanguageModel`` Protocol (``jaxpar/model_api.py``)."""

from __future__ import annotations

import ast
import tomllib

from render_kit import ROOT, markdown, table


def _importlinter() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]


def _names(modules) -> str:
    return ", ".join(f"`{m.removeprefix('jaxpar.')}`" for m in modules)


@table("import-layers")
def import_layers() -> str:
    """The layers contract, top to bottom: a module imports only from the rows below its own."""
    layers = next(c for c in _importlinter()["contracts"] if c["type"] == "layers")["layers"]
    rows = [[len(layers) - i, _names(m.strip() for m in layer.split("|"))] for i, layer in enumerate(layers)]
    return markdown(["layer", "modules of `jaxpar` (siblings in one row never import each other)"], rows, "rl")


@table("import-contracts")
def import_contracts() -> str:
    rows = []
    for c in _importlinter()["contracts"]:
        if c["type"] == "forbidden":
            rule = f"{_names(c['source_modules'])} never import {_names(c['forbidden_modules'])}"
        elif c["type"] == "layers":
            rule = "every module imports only from the layers below its own (the table above)"
        else:
            rule = f"no import cycle among the modules of any package under `{c['ancestors'][0]}`"
        rows.append([c["name"], c["type"], rule])
    return markdown(["contract", "kind", "what it forbids"], rows)


@table("model-hooks")
def model_hooks() -> str:
    """The Protocol's methods with the first line of their docstrings, in the order the file gives them."""
    source = (ROOT / "jaxpar" / "model_api.py").read_text()
    tree, lines = ast.parse(source), source.splitlines()
    protocol = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LanguageModel")
    rows = []
    for node in protocol.body:
        if isinstance(node, ast.FunctionDef):
            args = ", ".join(a.arg for a in node.args.args[1:] + node.args.kwonlyargs)
            doc = (ast.get_docstring(node) or "").splitlines()[0]
            rows.append([f"`{node.name}({args})`", doc])
        elif isinstance(node, ast.AnnAssign):
            comment = lines[node.lineno - 1].partition("#")[2].strip()
            rows.append([f"`{node.target.id}: {ast.unparse(node.annotation)}`", f"attribute: {comment}"])
    return markdown(["hook", "what it does"], [[c.replace("|", "\\|") for c in row] for row in rows])
