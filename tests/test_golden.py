"""Golden files: shardings ``{param path: [shape, spec]}`` per (model, layout) on 8 devices, and the rules
table of every mesh preset.

* ``tests/golden/shardings/{model}__{layout}.json``: the dense models under every preset; the MoE and MLA
  models under expert, FSDP and tensor layouts. Each is built abstractly and compared; a mismatch lists
  the parameters whose shape or spec changed (old -> new), appeared or disappeared.
* ``tests/golden/rules/{layout}.json``: each preset's table (and two axis specs with ``expert``), as
  ``jaxpar shardings --rules`` resolves it; a mismatch lists the logical axes whose mesh axes changed.

A layout that is an axis spec is named by its spec without ``=`` and ``,`` (``data=2,expert=4`` ->
``data2_expert4``). After an intended change of a model or a rules table, regenerate the files in one
local process (never under CI or pytest-xdist: ``golden_update_mode`` refuses) and review the git diff:

    JAXPAR_UPDATE_GOLDEN=1 pytest -p no:xdist tests/test_golden.py
"""

import json
import os
import pathlib
import re

import jax
import pytest

from jaxpar.meshes import PRESETS as MESH_PRESETS
from jaxpar.meshes import resolve_mesh_arg
from jaxpar.models import get_model_preset
from jaxpar.rules import ACTIVATION_AXES, CACHE_AXES, LOGICAL_AXES, PARAM_AXES
from jaxpar.rules_report import preset_golden, readable_json
from jaxpar.shardings import default_layout, param_shardings

GOLDEN = pathlib.Path(__file__).parent / "golden"
REGENERATE = "if intended: JAXPAR_UPDATE_GOLDEN=1 pytest -p no:xdist tests/test_golden.py"
EXPERT_SPECS = ("data=2,expert=4", "data=2,fsdp=2,tensor=2,expert=2,sequence=2")
MOE_LAYOUTS = ("data=2,expert=4", "fsdp=2,expert=2,tensor=2", "fsdp", "tp")
CASES = (
    [(m, p) for m in ("tiny", "llama3-8b") for p in MESH_PRESETS if (m, p) != ("tiny", "pp")]  # 2 layers, 8 stages
    + [(m, p) for m in ("tiny-moe", "tiny-deepseek") for p in MOE_LAYOUTS]  # MoE; MLA + shared expert
    + [("mixtral-8x7b", "fsdp=2,expert=4"), ("deepseek-v3", "expert=4,tensor=2")]
)
RULES_CASES = (*MESH_PRESETS, *EXPERT_SPECS)


class GoldenUpdateRefused(RuntimeError):
    """The golden-update switch was set where rewriting the files would be wrong."""


def golden_update_mode(env) -> bool:
    """Whether ``JAXPAR_UPDATE_GOLDEN=1`` asks to rewrite the golden files instead of comparing them.

    Refuses (raises, so nothing is written) under CI (``CI`` set to anything but "", "0" or "false"):
    a fresh clone would bless whatever it computes; and in a pytest-xdist worker (``PYTEST_XDIST_WORKER``),
    where workers would write the same directory at once. Any value but "", "0" or "1" is a typo: refused.
    """
    value = env.get("JAXPAR_UPDATE_GOLDEN", "")
    if value in ("", "0"):
        return False
    if value != "1":
        raise GoldenUpdateRefused(f"JAXPAR_UPDATE_GOLDEN={value!r}: set it to 1 to rewrite the golden files")
    if env.get("CI", "").strip().lower() not in ("", "0", "false"):
        raise GoldenUpdateRefused(
            f"JAXPAR_UPDATE_GOLDEN=1 under CI (CI={env['CI']!r}): golden files are "
            "rewritten only locally, then reviewed; nothing was written"
        )
    if "PYTEST_XDIST_WORKER" in env:
        raise GoldenUpdateRefused(
            "JAXPAR_UPDATE_GOLDEN=1 in a pytest-xdist worker: regenerate in one process "
            "(pytest -p no:xdist tests/test_golden.py); nothing was written"
        )
    return True


UPDATE = golden_update_mode(os.environ)  # at collection: a refusal stops the run before any test
_REPORTS = {}


def file_stem(layout: str) -> str:
    return layout.replace("=", "").replace(",", "_")


def report(model: str, mesh: str):
    if (model, mesh) not in _REPORTS:
        cfg = get_model_preset(model)
        _REPORTS[model, mesh] = param_shardings(cfg, default_layout(cfg, mesh))
    return _REPORTS[model, mesh]


def golden_path(model: str, mesh: str) -> pathlib.Path:
    return GOLDEN / "shardings" / f"{model}__{file_stem(mesh)}.json"


def rules_path(layout: str) -> pathlib.Path:
    return GOLDEN / "rules" / f"{file_stem(layout)}.json"


def describe_diff(old: dict, new: dict) -> str:
    """Readable differences between two golden shardings dicts, one line per parameter."""
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


def describe_rules_diff(old: dict, new: dict) -> str:
    """Readable differences between two golden rules tables, one line per logical axis (or field)."""

    def flat(table):
        out = {}
        for key, value in table.items():
            if isinstance(value, dict):
                out.update({f"{key}/{axis}": axes for axis, axes in value.items()})
            else:
                out[key] = value
        return out

    old, new, lines = flat(old), flat(new), []
    for key in sorted(old.keys() | new.keys()):
        if key not in new:
            lines.append(f"  removed  {key}: {old[key]}")
        elif key not in old:
            lines.append(f"  added    {key}: {new[key]}")
        elif old[key] != new[key]:
            lines.append(f"  changed  {key}: {old[key]} -> {new[key]}")
    return "\n".join(lines)


def compare_or_update(path: pathlib.Path, text: str, describe, what: str) -> None:
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"{path} is missing; {REGENERATE}"
    diff = describe(json.loads(path.read_text()), json.loads(text))
    assert not diff, f"{what} differ from {path.parent.name}/{path.name} (old -> new):\n{diff}\n{REGENERATE}"


@pytest.mark.parametrize("model,mesh", CASES, ids=[f"{m}__{p}" for m, p in CASES])
def test_golden_shardings(model, mesh):
    assert jax.device_count() == 8
    compare_or_update(
        golden_path(model, mesh), report(model, mesh).golden_json(), describe_diff, f"shardings of {model} under {mesh}"
    )


@pytest.mark.parametrize("layout", RULES_CASES)
def test_golden_rules(layout):
    golden = preset_golden(resolve_mesh_arg(layout))
    assert list(golden["params"]) == list(PARAM_AXES) and list(golden["activations"]) == list(ACTIVATION_AXES)
    compare_or_update(rules_path(layout), readable_json(golden) + "\n", describe_rules_diff, f"rules of {layout}")


def test_no_stale_golden_files():
    expected = {golden_path(m, p) for m, p in CASES} | {rules_path(layout) for layout in RULES_CASES}
    stale = sorted(str(p.relative_to(GOLDEN)) for p in GOLDEN.glob("*/*.json") if p not in expected)
    assert not stale, f"golden files for no current case: {stale}"


def test_describe_diff_names_params():
    old = {"a/q": [[2, 4], [None, "fsdp"]], "gone": [[1], [None]]}
    new = {"a/q": [[2, 4], ["tensor", None]], "fresh": [[3], [None]]}
    text = describe_diff(old, new)
    assert "changed  a/q: spec [None, 'fsdp'] -> ['tensor', None]" in text
    assert "removed  gone" in text and "added    fresh" in text


def test_describe_rules_diff_names_axes():
    old = {"mesh": "fsdp=-1", "params": {"embed": ["fsdp"], "gone": []}, "activations": {"batch": ["fsdp"]}}
    new = {"mesh": "fsdp=-1", "params": {"embed": [], "fresh": ["tensor"]}, "activations": {"batch": ["fsdp"]}}
    assert describe_rules_diff(old, new).splitlines() == [
        "  changed  params/embed: ['fsdp'] -> []",
        "  added    params/fresh: ['tensor']",
        "  removed  params/gone: []",
    ]
    assert describe_rules_diff(old, old) == ""


@pytest.mark.parametrize(
    "env,refused",
    [
        ({}, None),
        ({"JAXPAR_UPDATE_GOLDEN": "0", "CI": "true"}, None),
        ({"CI": "true"}, None),
        ({"JAXPAR_UPDATE_GOLDEN": "1"}, None),
        ({"JAXPAR_UPDATE_GOLDEN": "1", "CI": "0"}, None),
        ({"JAXPAR_UPDATE_GOLDEN": "1", "CI": "false"}, None),
        ({"JAXPAR_UPDATE_GOLDEN": "1", "CI": ""}, None),
        ({"JAXPAR_UPDATE_GOLDEN": "1", "CI": "true"}, "under CI"),
        ({"JAXPAR_UPDATE_GOLDEN": "1", "CI": "1"}, "under CI"),
        ({"JAXPAR_UPDATE_GOLDEN": "1", "PYTEST_XDIST_WORKER": "gw0"}, "pytest-xdist worker"),
        ({"JAXPAR_UPDATE_GOLDEN": "yes"}, "set it to 1"),
    ],
)
def test_update_switch_refuses_under_ci_and_xdist(env, refused):
    if refused is None:
        assert golden_update_mode(env) is (env.get("JAXPAR_UPDATE_GOLDEN") == "1")
    else:
        with pytest.raises(GoldenUpdateRefused, match=refused):
            golden_update_mode(env)


def test_docs_name_every_logical_axis_by_group():
    """The logical-axes table of docs/mesh-and-rules.md, rendered from the golden rules files, names every
    axis of jaxpar.rules once, in its group, and counts each group."""
    from rendered import render, table_rows

    table = table_rows(render.logical_axes())
    rows = {group: (int(count), re.findall(r"`([a-z_]+)`", names)) for group, count, names in table}
    assert rows["parameters"] == (len(PARAM_AXES), list(PARAM_AXES))
    assert rows["activations"] == (len(ACTIVATION_AXES), list(ACTIVATION_AXES))
    assert rows["KV cache"] == (len(CACHE_AXES), list(CACHE_AXES))
    assert rows["**all**"][0] == len(LOGICAL_AXES)
    # the preset matrix has a row for every axis and a column for every preset
    matrix = table_rows(render.rules_matrix())
    assert [r[0].strip("`") for r in matrix[1:]] == list(LOGICAL_AXES)
    assert all(len(r) == 1 + len(MESH_PRESETS) for r in matrix)


# Spot checks against the rules tables, independent of the stored files.
@pytest.mark.parametrize(
    "mesh,q_spec,k_spec",
    [
        ("tp", [None, None, "tensor", None], [None, None, None, None]),  # kv_heads=2 < tensor=8: replicated
        ("fsdp", [None, "fsdp", None, None], [None, "fsdp", None, None]),
        ("3d", [None, "fsdp", "tensor", None], [None, "fsdp", "tensor", None]),
        ("dp", [None] * 4, [None] * 4),
    ],
)
def test_tiny_attention_specs(mesh, q_spec, k_spec):
    golden = report("tiny", mesh).golden()
    assert golden["blocks/attn/q"] == [[2, 64, 8, 8], q_spec]
    assert golden["blocks/attn/k"] == [[2, 64, 2, 8], k_spec]


def test_tiny_deepseek_expert_and_mla_specs():
    """Experts over ``expert``, their widths over ``tensor`` and ``embed`` over ``fsdp``; the MLA latent
    widths (q_lora, kv_lora) and the router's expert dimension are never sharded."""
    golden = report("tiny-deepseek", "fsdp=2,expert=2,tensor=2").golden()
    assert golden["moe_blocks/moe/gate_up"] == [[2, 8, 64, 2, 32], [None, "expert", "fsdp", None, "tensor"]]
    assert golden["moe_blocks/moe/shared/down"] == [[2, 32, 64], [None, "tensor", "fsdp"]]
    assert golden["moe_blocks/moe/router"] == [[2, 64, 8], [None, "fsdp", None]]
    assert golden["moe_blocks/attn/q_b"] == [[2, 32, 8, 16], [None, None, "tensor", None]]
    assert golden["dense_blocks/attn/kv_a_norm/scale"] == [[1, 16], [None, None]]


def test_llama3_8b_fsdp_totals():
    rep, cfg = report("llama3-8b", "fsdp"), get_model_preset("llama3-8b")
    assert rep.num_params == cfg.num_params(padded=True) == 8_030_261_248
    assert rep.total_bytes == 4 * rep.num_params
    # everything but the norm scales (replicated) is split 8 ways over fsdp
    norms = sum(p.nbytes for p in rep.params if p.path.endswith("/scale"))
    assert rep.per_device_bytes == (rep.total_bytes - norms) // 8 + norms
    assert rep.per_device_adamw_bytes == 3 * rep.per_device_bytes  # fp32 params + 2 fp32 moments
    q = next(p for p in rep.params if p.path == "blocks/attn/q")
    assert q.shard_shape == (32, 512, 32, 128) and q.bytes_per_device == 32 * 512 * 32 * 128 * 4
    assert q.names == ("layers", "embed", "heads", "head_dim")
    assert json.loads(rep.to_json())["totals"]["per_device_bytes"] == rep.per_device_bytes
