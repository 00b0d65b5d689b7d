"""Model code names logical axes only: no mesh axis name or PartitionSpec in models/ or jaxpar/layers/."""

import ast
import pathlib

from jaxpar.mesh import AXES

ROOT = pathlib.Path(__file__).resolve().parents[1]
FORBIDDEN_NAMES = {"PartitionSpec", "NamedSharding", "P", "Mesh", "with_sharding_constraint", "shard_map"}


def violations(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and node.value in AXES:
            found.append(f"line {node.lineno}: mesh axis name {node.value!r}")
        elif isinstance(node, (ast.Name, ast.Attribute)):
            name = node.id if isinstance(node, ast.Name) else node.attr
            if name in FORBIDDEN_NAMES:
                found.append(f"line {node.lineno}: {name}")
        elif isinstance(node, ast.alias) and node.name.split(".")[-1] in FORBIDDEN_NAMES:
            found.append(f"line {node.lineno}: import {node.name}")
    return found


def test_checker_catches_what_it_should():
    assert violations("x = constrain(x, ('batch', 'tensor'))")
    assert violations("from jax.sharding import PartitionSpec")
    assert violations("s = jax.sharding.PartitionSpec('fsdp')")
    assert not violations("x = constrain(x, ('batch', 'length', 'act_embed'))  # tensor in a comment")


def test_model_and_layer_code_is_mesh_free():
    files = sorted((ROOT / "models").rglob("*.py")) + sorted((ROOT / "jaxpar" / "layers").rglob("*.py"))
    assert len(files) >= 5
    bad = {str(f.relative_to(ROOT)): v for f in files if (v := violations(f.read_text()))}
    assert not bad, bad
