"""The plain-JAX reference step of ``benchmarks/overhead.py`` computes what our train step computes.

Same parameters (our sharded init, converted with ``nnx.to_pure_dict``), same batch: the losses and
gradient norms of two consecutive steps agree to rtol 1e-5 and so do the parameters after each step
(max abs difference over max abs). Two steps, because AdamW's first update is about -lr·sign(g) and so
hides a wrong gradient scale; the second is not. Checked on one device and on the ``3d`` preset over the
8 simulated devices, where the two compiled programs must also move the same collectives.
"""
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import overhead  # noqa: E402
import plain_llama  # noqa: E402

from jaxpar.layout import make_layout  # noqa: E402
from jaxpar.meshes import get_mesh_preset  # noqa: E402
from jaxpar.models import get_model_preset  # noqa: E402
from jaxpar.train.optim import decay_mask  # noqa: E402

CFG = get_model_preset("tiny")
B, T = 8, 32
# Both programs compiled with the same cheaper LLVM settings (about 3x faster to compile on CPU; the
# optimized HLO and its partitioning are the same as with the defaults).
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _pair(mesh: str, devices, constraints: str):
    layout = make_layout(CFG, get_mesh_preset(mesh), batch=B, seq=T, devices=devices)
    return layout, overhead.build_pair(CFG, layout, batch=B, seq=T, ref_constraints=constraints,
                                       init_compiler_options=FAST)


def _check(layout, pair):
    model, _ = nnx.merge(pair["ts"].graphdef, pair["ts"].state)
    initial = overhead.copy_tree(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    ours = pair["ours"].lower(pair["ts"].state, pair["batch"]).compile(compiler_options=FAST)
    ref = pair["ref"].lower(pair["ref_state"], pair["batch"]).compile(compiler_options=FAST)
    rows, _, ref_state = overhead.compare_steps(ours, pair["ts"], ref, pair["ref_state"], pair["batch"], steps=2)
    for i, r in enumerate(rows):
        assert r["loss_ours"] == pytest.approx(r["loss_ref"], rel=1e-5), (i, r)
        assert r["grad_norm_ours"] == pytest.approx(r["grad_norm_ref"], rel=1e-5), (i, r)
        assert r["param_rel_diff"] <= 1e-5, (i, r)
    assert overhead.rows_match(rows)
    # the comparison is not vacuous: the steps trained (loss went down, parameters moved by far more
    # than the tolerance) and the reference's state stayed in the layout it was given
    assert rows[1]["loss_ref"] < rows[0]["loss_ref"]
    assert overhead.param_rel_diff(initial, ref_state[0]) > 10 * 1e-5     # ~2·lr = 6e-4
    for leaf, start in zip(jax.tree.leaves(ref_state[0]), jax.tree.leaves(initial)):
        assert leaf.sharding.is_equivalent_to(start.sharding, leaf.ndim)
    return ours, ref


@pytest.fixture(scope="module")
def one_device():
    return _pair("dp", jax.devices()[:1], "none")


def test_reference_decay_mask_is_ours(one_device):
    ts = one_device[1]["ts"]
    model, _ = nnx.merge(ts.graphdef, ts.state)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert plain_llama.decay_mask(params) == nnx.to_pure_dict(decay_mask(model))
    assert not plain_llama.decay_mask(params)["blocks"]["attn_norm"]["scale"]
    assert plain_llama.decay_mask(params)["blocks"]["mlp"]["gate_up"]


def test_reference_matches_on_one_device(one_device):
    layout, pair = one_device
    assert layout.mesh.size == 1
    _check(layout, pair)


def test_reference_matches_under_3d_on_8_devices():
    layout, pair = _pair("3d", None, "all")
    assert layout.mesh.size == 8 == len(jax.devices())
    ours, ref = _check(layout, pair)
    rep_ours = overhead.compiled_report(ours, layout.mesh)
    rep_ref = overhead.compiled_report(ref, layout.mesh)
    assert rep_ours["collective_bytes"] > 0
    assert rep_ours["collectives"] == rep_ref["collectives"]
    np.testing.assert_allclose(rep_ours["flops"], rep_ref["flops"], rtol=1e-3)


def test_reference_refuses_what_it_does_not_implement():
    with pytest.raises(ValueError, match="qk_norm"):
        plain_llama.check_supported(get_model_preset("qwen3-8b"))
