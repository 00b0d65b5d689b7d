"""MoE models: the tiny Mixtral-like and DeepSeek-like models train with the same losses on 1 device and
under expert parallelism; their statistics reach the step metrics; the router bias moves only by the
auxiliary-loss-free rule; the compiled step's all-to-all bytes follow the formula."""
import dataclasses
import functools

import jax
import numpy as np
import pytest

from jaxpar.analysis import analyze_compiled
from jaxpar.layout import make_layout
from jaxpar.mesh import MeshConfig
from jaxpar.meshes import get_mesh_preset, resolve_mesh_arg
from jaxpar.models import build_model, get_model_preset
from jaxpar.parallel.moe import a2a_bytes_formula
from jaxpar.rules import LayoutError
from jaxpar.train.optim import OptimizerConfig, make_optimizer
from jaxpar.train.step import batch_sharding, init_train_state, make_train_step

B, T, STEPS = 8, 16, 3
TOKENS = np.random.default_rng(0).integers(0, 256, (STEPS, B, T + 1), dtype=np.int32)
ONE_DEVICE = dataclasses.replace(get_mesh_preset("dp"), mesh=MeshConfig())


def _run(cfg, preset, devices=None):
    layout = make_layout(cfg, preset, batch=B, seq=T, devices=devices)
    tx = functools.partial(make_optimizer, OptimizerConfig(learning_rate=1e-2, eps=1e-3))
    ts = init_train_state(lambda r: build_model(cfg, rngs=r), tx, layout)
    step, state, losses, stats = make_train_step(ts, layout), ts.state, [], []
    for i in range(STEPS):
        state, metrics = step(state, {"inputs": TOKENS[i, :, :-1], "targets": TOKENS[i, :, 1:]})
        losses.append(float(metrics.loss))
        stats.append(jax.tree.map(np.asarray, metrics.moe))
    return losses, stats, state


@pytest.fixture(scope="module", params=["tiny-moe", "tiny-deepseek"])
def reference(request):
    cfg = get_model_preset(request.param)
    return request.param, _run(cfg, ONE_DEVICE, devices=jax.devices()[:1])


@pytest.mark.parametrize("mesh", ["data=2,expert=4", "data=2,fsdp=2,expert=2"])
def test_same_losses_and_routing_as_one_device(reference, mesh):
    name, (ref_losses, ref_stats, _) = reference
    losses, stats, _ = _run(get_model_preset(name), resolve_mesh_arg(mesh))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for got, want in zip(stats, ref_stats):
        np.testing.assert_array_equal(got.expert_load, want.expert_load)
        np.testing.assert_allclose(got.dropped_fraction, want.dropped_fraction, atol=1e-7)
    assert abs(ref_losses[0] - ref_losses[-1]) > 1e-3


def test_statistics_and_router_bias(reference):
    name, (_, stats, state) = reference
    cfg = get_model_preset(name)
    layers = cfg.num_moe_layers
    assert stats[0].expert_load.shape == (layers, cfg.moe.num_experts)
    np.testing.assert_allclose(stats[0].expert_load.sum(-1), B * T * cfg.moe.top_k)   # every assignment counted
    assert np.all(stats[0].aux_loss > 0) and np.all(stats[0].router_z_loss > 0)
    bias = np.asarray(jax.tree.leaves(state[0]["moe_blocks"]["moe"]["router_bias"])[0])
    if cfg.moe.bias_update_rate:
        # after 3 steps each entry moved by ±rate per step (or 0 at exactly mean load)
        assert np.any(bias != 0) and np.all(np.abs(bias) <= STEPS * cfg.moe.bias_update_rate + 1e-9)
    else:
        assert np.all(bias == 0)


def test_all_to_all_bytes_of_a_train_step():
    """tiny-moe under data=2 × expert=4, no remat: per MoE layer 4 all-to-alls (dispatch and combine,
    forward and backward) of the capacity buffer, (ep−1)/ep · T·k·cf·D·b sent each (T: tokens per
    device). (Full remat recomputes the forward's two in the backward pass: 6 per layer.)"""
    cfg = get_model_preset("tiny-moe", remat="none")
    layout = make_layout(cfg, resolve_mesh_arg("data=2,expert=4"), batch=B, seq=T)
    tx = functools.partial(make_optimizer, OptimizerConfig())
    ts = init_train_state(lambda r: build_model(cfg, rngs=r), tx, layout)
    batch = {k: jax.ShapeDtypeStruct((B, T), np.int32, sharding=s) for k, s in batch_sharding(layout).items()}
    report = analyze_compiled(make_train_step(ts, layout).lower(ts.state, batch).compile(), mesh=layout.mesh)
    a2a = [c for c in report.ops if c.kind == "all-to-all"]
    sent = sum(c.sent_bytes * c.executions for c in a2a)
    # capacity per sequence C = ceil(cf·T·k/E); a buffer row holds E·C slots, so cf_eff = E·C / (T·k)
    m = cfg.moe
    slots = m.num_experts * -(-int(m.capacity_factor * T * m.top_k) // m.num_experts)
    want = cfg.num_moe_layers * a2a_bytes_formula(tokens_per_device=B * T // 8, top_k=m.top_k,
                                                  capacity_factor=slots / (T * m.top_k), embed_dim=cfg.embed_dim,
                                                  ep=4, bytes_per_element=4)
    assert sum(c.executions for c in a2a) == 4 * cfg.num_moe_layers
    assert 0.9 * want <= sent <= 1.1 * want, (sent, want)


@pytest.mark.parametrize("overrides, message", [
    (dict(num_experts=6), "model.moe.num_experts=6 .* not divisible by mesh axes expert=4"),
    (dict(top_k=5), r"moe.top_k=5 exceeds moe.num_experts=4"),
    (dict(capacity_factor=0.0), r"moe.capacity_factor=0.0 must be > 0"),
])
def test_bad_moe_configs_are_refused(overrides, message):
    with pytest.raises(LayoutError, match=message):
        cfg = get_model_preset("tiny-moe")
        cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **overrides))
        make_layout(cfg, resolve_mesh_arg("data=2,expert=4"), batch=B, seq=T)
