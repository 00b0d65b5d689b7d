"""A griffe extension for the API reference: the packages pyproject.toml maps with ``package-dir``.

``jaxpar.models``, ``jaxpar.meshes`` and ``jaxpar.train`` live in the top-level folders ``models/``,
``meshes/`` and ``train/`` and install inside the ``jaxpar`` namespace ([tool.setuptools.package-dir]).
Griffe finds a package's submodules in the package's own folder only, so it would not see them. Once it
has loaded ``jaxpar``, this extension loads each mapped folder as the submodule it installs as, so the
reference names them (and resolves their imports) as ``jaxpar.models`` and so on.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import griffe

ROOT = Path(__file__).resolve().parents[1]


def package_dirs() -> dict[str, Path]:
    """``{"jaxpar.models": ROOT / "models", ...}``: the mapped subpackages, from pyproject.toml."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / folder for name, folder in mapping.items() if "." in name}


class PackageDir(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs) -> None:
        for dotted, folder in package_dirs().items():
            parent, _, name = dotted.rpartition(".")
            if parent == pkg.path:
                # griffe has no public call that loads a folder under another name; this is its own loader's
                module = loader._load_module(name, folder / "__init__.py", parent=pkg)
                pkg.set_member(name, module)
