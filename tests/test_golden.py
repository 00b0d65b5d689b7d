"""Golden shardings: ``{param path: [shape, spec]}`` per (model, mesh preset) on 8 devices.

Each (model, preset) is built abstractly and its report compared with
``tests/golden/shardings/{model}__{preset}.json``; a mismatch lists the parameters whose shape or spec
changed (old -> new), appeared or disappeared.

After an intended change of a model or a rules table, regenerate the files and review the git diff:

    JAXPAR_UPDATE_GOLDEN=1 /work/venv/bin/pytest tests/test_golden.py
"""
import json
import os
import pathlib

import jax
import pytest

from jaxpar.meshes import PRESETS as MESH_PRESETS
from jaxpar.models import get_model_preset
from jaxpar.shardings import default_layout, param_shardings

GOLDEN_DIR = pathlib.Path(__file__).parent / "golden" / "shardings"
MODELS = ("tiny", "llama3-8b")
CASES = [(m, p) for m in MODELS for p in MESH_PRESETS]
UPDATE = os.environ.get("JAXPAR_UPDATE_GOLDEN") == "1"

_REPORTS = {}


def report(model: str, mesh: str):
    if (model, mesh) not in _REPORTS:
        cfg = get_model_preset(model)
        _REPORTS[model, mesh] = param_shardings(cfg, default_layout(cfg, mesh))
    return _REPORTS[model, mesh]


def golden_path(model: str, mesh: str) -> pathlib.Path:
    return GOLDEN_DIR / f"{model}__{mesh}.json"


def describe_diff(old: dict, new: dict) -> str:
    """Readable differences between two golden dicts, one line per parameter."""
    lines = []
    for path in sorted(old.keys() | new.keys()):
        if path not in new:
            lines.append(f"  removed  {path}: shape {old[path][0]} spec {old[path][1]}")
        elif path not in old:
            lines.append(f"  added    {path}: shape {new[path][0]} spec {new[path][1]}")
        else:
            for i, what in enumerate(("shape", "spec")):
                if old[path][i] != new[path][i]:
                    lines.append(f"  changed  {path}: {what} {old[path][i]} -> {new[path][i]}")
    return "\n".join(lines)


@pytest.mark.parametrize("model,mesh", CASES, ids=[f"{m}__{p}" for m, p in CASES])
def test_golden_shardings(model, mesh):
    assert jax.device_count() == 8
    rep, path = report(model, mesh), golden_path(model, mesh)
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(rep.golden_json())
        return
    assert path.exists(), f"{path} is missing; regenerate: JAXPAR_UPDATE_GOLDEN=1 pytest tests/test_golden.py"
    old, new = json.loads(path.read_text()), json.loads(rep.golden_json())
    diff = describe_diff(old, new)
    assert not diff, (f"shardings of {model} under {mesh} differ from {path.name} (old -> new):\n{diff}\n"
                      "if intended: JAXPAR_UPDATE_GOLDEN=1 pytest tests/test_golden.py")


def test_no_stale_golden_files():
    expected = {golden_path(m, p).name for m, p in CASES}
    stale = sorted(p.name for p in GOLDEN_DIR.glob("*.json") if p.name not in expected)
    assert not stale, f"golden files for no current (model, preset): {stale}"


def test_describe_diff_names_params():
    old = {"a/q": [[2, 4], [None, "fsdp"]], "gone": [[1], [None]]}
    new = {"a/q": [[2, 4], ["tensor", None]], "fresh": [[3], [None]]}
    text = describe_diff(old, new)
    assert "changed  a/q: spec [None, 'fsdp'] -> ['tensor', None]" in text
    assert "removed  gone" in text and "added    fresh" in text


# Spot checks against the rules tables, independent of the stored files.
@pytest.mark.parametrize("mesh,q_spec,k_spec", [
    ("tp", [None, None, "tensor", None], [None, None, None, None]),      # kv_heads=2 < tensor=8: replicated
    ("fsdp", [None, "fsdp", None, None], [None, "fsdp", None, None]),
    ("3d", [None, "fsdp", "tensor", None], [None, "fsdp", "tensor", None]),
    ("dp", [None] * 4, [None] * 4),
])
def test_tiny_attention_specs(mesh, q_spec, k_spec):
    golden = report("tiny", mesh).golden()
    assert golden["blocks/attn/q"] == [[2, 64, 8, 8], q_spec]
    assert golden["blocks/attn/k"] == [[2, 64, 2, 8], k_spec]


def test_llama3_8b_fsdp_totals():
    rep, cfg = report("llama3-8b", "fsdp"), get_model_preset("llama3-8b")
    assert rep.num_params == cfg.num_params(padded=True) == 8_030_261_248
    assert rep.total_bytes == 4 * rep.num_params
    # everything but the norm scales (replicated) is split 8 ways over fsdp
    norms = sum(p.nbytes for p in rep.params if p.path.endswith("/scale"))
    assert rep.per_device_bytes == (rep.total_bytes - norms) // 8 + norms
    assert rep.per_device_adamw_bytes == 3 * rep.per_device_bytes          # fp32 params + 2 fp32 moments
    q = next(p for p in rep.params if p.path == "blocks/attn/q")
    assert q.shard_shape == (32, 512, 32, 128) and q.bytes_per_device == 32 * 512 * 32 * 128 * 4
    assert q.names == ("layers", "embed", "heads", "head_dim")
    assert json.loads(rep.to_json())["totals"]["per_device_bytes"] == rep.per_device_bytes
