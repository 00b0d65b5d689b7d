"""The pipeline invariance cases (``tests/test_pipeline.py``, ``tests/test_pipeline_moe.py``): a model,
a schedule table and a mesh train 3 AdamW steps and must give the losses, per-parameter gradients and
MoE statistics of one device accumulating over the same m microbatches (``grad_accum=m``, rows i, i+m,
... as the pipeline splits them). Tolerances: a multiple of that reference's own noise, measured by
running it again with its rows in another order, each row kept in its microbatch (tests/noise.py).
``test_a_dropped_microbatch_is_caught`` shows the bound still catches a microbatch the schedule loses.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from invariance import reference as noisy_reference
from invariance import replace_rows, train_steps
from noise import check_mutation_caught, check_run
from test_invariance import BF16_MULTIPLE

from jaxpar.meshes import resolve_mesh_arg
from jaxpar.models import get_execution_preset, get_model_preset
from jaxpar.pipeline import build

STEPS, BATCH, SEQ = 3, 16, 16
MODELS = {  # name: (preset, model fields, execution fields)
    "tiny": ("tiny", dict(num_layers=8), {}),
    "tiny-ring": ("tiny", dict(num_layers=8), dict(context_parallel="ring")),  # zig-zag token order
    "tiny-ulysses": ("tiny", dict(num_layers=8), dict(context_parallel="ulysses")),
    "tiny-6": ("tiny", dict(num_layers=6), {}),  # an uneven split over 4 stages (first 1, last 1)
    "tiny-deepseek-uneven": ("tiny-deepseek", dict(num_layers=7, first_dense_layers=1), {}),  # 1 dense + 6 MoE
    "tiny-bf16-keep": ("tiny", dict(num_layers=8), dict(dtype="bfloat16", remat="none")),
    "tiny-moe": ("tiny-moe", dict(num_layers=4), {}),
    "tiny-moe-dropless": ("tiny-moe", dict(num_layers=4), dict(capacity_factor=None)),
    "tiny-deepseek": ("tiny-deepseek", dict(num_layers=5, first_dense_layers=1), {}),  # 1 dense + 4 MoE
}
_REFERENCES: dict = {}


def case_id(case) -> str:
    return f"{case[0]}-{case[1]}-p{case[2]}-m{case[3]}-{case[5]}"


def model(name: str):
    preset, fields, _ = MODELS[name]
    return dataclasses.replace(get_model_preset(preset), **fields)


def execution(name: str):
    """The execution of case ``name``: its preset's, with the case's changes."""
    preset, _, changes = MODELS[name]
    return get_execution_preset(preset, **changes)


def tokens(name: str) -> np.ndarray:
    return np.random.default_rng(7).integers(0, model(name).vocab_size, (STEPS, BATCH, SEQ + 1), dtype=np.int32)


def reference(name: str, m: int):
    """One device, gradient accumulated over the same m microbatches, and its noise bound (built once
    per model and m). A bfloat16 case's noise is its distance from the same run in float32, at the bf16
    family's multiple (``tests/test_invariance.py``: rows in another order measure almost nothing there)."""
    if (name, m) not in _REFERENCES:
        run = execution(name)
        bf16 = str(run.dtype) == "bfloat16"
        extra = dict(multiple=BF16_MULTIPLE, exact=dataclasses.replace(run, dtype="float32")) if bf16 else {}
        _REFERENCES[name, m] = noisy_reference(
            model(name), tokens(name), "bf16" if bf16 else "pipeline", grad_accum=m, execution=run, **extra
        )
    return _REFERENCES[name, m]


def invariance_test(cases):
    """The parametrized test of ``cases`` [(model, schedule, p, m, v, mesh)], for a test module to bind
    as ``test_pipeline_equals_one_device``."""

    @pytest.mark.parametrize("name,schedule,p,m,v,mesh", cases, ids=[case_id(c) for c in cases])
    def test(name, schedule, p, m, v, mesh):
        check_case(name, schedule, p, m, v, mesh)

    return test


def _devices(mesh: str):
    preset = resolve_mesh_arg(mesh)
    return preset, jax.devices()[: int(np.prod([n for n in dataclasses.astuple(preset.mesh)[:6]]))]


def run_case(
    name: str,
    schedule: str,
    p: int,
    m: int,
    v: int,
    mesh: str,
    fsdp_gather: str = "section",
    grad_reduce="slice",
    ends=(None, None),
):
    """The recorded run (``invariance.Run``) of case ``name`` by ``schedule`` on ``mesh``; ``ends``: the
    first and last stage's layers (an uneven split)."""
    preset, devices = _devices(mesh)
    table = build(schedule, p, m, v)
    run = dict(devices=devices, pipeline=table, execution=execution(name), fsdp_gather=fsdp_gather)
    run |= dict(grad_reduce=grad_reduce, ends=ends)
    return train_steps(model(name), preset, tokens(name), **run)


def check_case(name: str, schedule: str, p: int, m: int, v: int, mesh: str, **run) -> None:
    """``run_case`` (``run``: its fsdp_gather, grad_reduce and ends) against one device."""
    got = run_case(name, schedule, p, m, v, mesh, **run)
    fsdp_gather, grad_reduce = run.get("fsdp_gather", "section"), run.get("grad_reduce", "slice")
    ends = run.get("ends", (None, None))
    want, bound = reference(name, m)
    label = f"{name} {schedule} p={p} m={m} v={v} on {mesh}, fsdp gathered per {fsdp_gather}, reduced per {grad_reduce}"
    label += "" if ends == (None, None) else f", first/last stage layers {ends}"
    check_run(got, want, bound, label)
    for g, w in zip(got.moe, want.moe):  # routing statistics pass through the pipeline
        np.testing.assert_allclose(g.expert_load, w.expert_load, atol=1e-6, err_msg=label)
        np.testing.assert_allclose(g.aux_loss, w.aux_loss, rtol=bound.loss, atol=1e-7, err_msg=label)
    assert len(got.moe) == len(want.moe) == (STEPS if "moe" in name or "deepseek" in name else 0)


def check_dropped_microbatch(name: str, schedule: str, p: int, m: int, mesh: str, grad_reduce="slice") -> float:
    """The pipeline fed microbatch 1 in place of microbatch 0 (rows 0, m, 2m, ... replaced by rows 1,
    m+1, ...): what a schedule that loses one microbatch's gradient and counts another twice computes.
    Returns the factor by which it misses the bound."""
    preset, devices = _devices(mesh)
    rows = np.arange(0, BATCH, m)
    mutant = replace_rows(tokens(name), rows, rows + 1)
    table = build(schedule, p, m)
    got = train_steps(
        model(name), preset, mutant, devices=devices, pipeline=table, execution=execution(name), grad_reduce=grad_reduce
    )
    want, bound = reference(name, m)
    return check_mutation_caught(got, want, bound, f"{name} {schedule} p={p} m={m} on {mesh}: microbatch 0 lost")
