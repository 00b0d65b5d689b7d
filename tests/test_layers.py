"""Layers against independent numpy references (single device, float32)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.layers import Attention, AttentionConfig, RMSNorm, RopeScaling, apply_rope, rope_frequencies
from jaxpar.models import ExecutionConfig, Remat, build_model, get_model_preset


def test_llama31_rope_scaling_matches_piecewise_definition():
    s = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)
    got = rope_frequencies(128, theta=500_000.0, scaling=s)
    for i, f in enumerate(1.0 / 500_000.0 ** (np.arange(0, 128, 2) / 128)):
        wavelength = 2 * math.pi / f
        if wavelength < 8192 / 4:
            want = f
        elif wavelength > 8192 / 1:
            want = f / 8
        else:
            t = (8192 / wavelength - 1) / (4 - 1)
            want = (1 - t) * f / 8 + t * f
        assert got[i] == pytest.approx(want, rel=1e-12), i
    assert got[0] == pytest.approx(1.0) and got[-1] < 1.0 / 500_000.0 ** (126 / 128)


def test_rope_is_a_rotation_that_depends_on_relative_position():
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(2, 1, 1, 1, 16)).astype(np.float32)
    inv = rope_frequencies(16, theta=10_000.0)
    dot = lambda a, b: float(jnp.sum(apply_rope(q, jnp.full((1, 1), a), inv) * apply_rope(k, jnp.full((1, 1), b), inv)))
    assert dot(3, 1) == pytest.approx(dot(12, 10), rel=1e-5)
    assert float(jnp.linalg.norm(apply_rope(q, jnp.full((1, 1), 7), inv))) == pytest.approx(np.linalg.norm(q), rel=1e-6)


def reference_attention(q, k, v, window=None):
    """Plain softmax attention with K/V heads repeated explicitly; q [B,T,N,H], k/v [B,T,K,H]."""
    groups = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    scores = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    t, s = np.arange(q.shape[1])[:, None], np.arange(q.shape[1])[None, :]
    allowed = (s <= t) & ((t - s < window) if window else True)
    scores = np.where(allowed, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bnts,bsnh->btnh", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize(
    "kv_heads, window, bias, qk_norm",
    [(4, None, False, False), (2, None, True, False), (1, None, False, True), (2, 3, False, False)],
)
def test_attention_matches_reference(kv_heads, window, bias, qk_norm):
    cfg = AttentionConfig(
        embed_dim=16,
        num_heads=4,
        num_kv_heads=kv_heads,
        head_dim=8,
        qkv_bias=bias,
        qk_norm=qk_norm,
        sliding_window=window,
    )
    attn = Attention(cfg, dtype="float32", param_dtype="float32", rngs=nnx.Rngs(0))
    if bias:
        attn.q_bias[...] = jax.random.normal(jax.random.key(1), attn.q_bias.shape)
    x = np.random.default_rng(1).normal(size=(2, 7, 16)).astype(np.float32)
    pos = np.broadcast_to(np.arange(7), (2, 7))
    project = lambda name: np.asarray(attn._project(jnp.asarray(x), name, None))
    q = np.asarray(apply_rope(project("q"), pos, attn.inv_freq))
    k = np.asarray(apply_rope(project("k"), pos, attn.inv_freq))
    want = np.einsum("btnh,nhd->btd", reference_attention(q, k, project("v"), window), np.asarray(attn.o[...]))
    np.testing.assert_allclose(np.asarray(attn(jnp.asarray(x), pos)), want, rtol=1e-5, atol=1e-6)
    if window:  # the window really cuts: without it the output differs
        full = np.einsum("btnh,nhd->btd", reference_attention(q, k, project("v")), np.asarray(attn.o[...]))
        assert np.max(np.abs(full - want)) > 1e-4


def test_rmsnorm_matches_numpy():
    x = np.random.default_rng(2).normal(size=(3, 10)).astype(np.float32)
    norm = RMSNorm(10, eps=1e-6)
    norm.scale[...] = jnp.arange(10.0)
    want = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6) * np.arange(10.0)
    np.testing.assert_allclose(np.asarray(norm(jnp.asarray(x))), want, rtol=1e-5)


def _loss_and_grads(cfg, execution):
    model = build_model(cfg, execution=execution, rngs=nnx.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
    loss = lambda m: jnp.mean(jax.nn.logsumexp(m(ids[:, :-1]), -1))
    return jax.jit(nnx.value_and_grad(loss))(model)


def test_remat_policies_change_memory_not_math():
    (ref_loss, ref_grads) = _loss_and_grads(get_model_preset("tiny"), ExecutionConfig(remat="none"))
    for policy in (Remat.FULL, Remat.DOTS, Remat.ATTN):
        loss, grads = _loss_and_grads(get_model_preset("tiny"), ExecutionConfig(remat=policy))
        assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, ref_grads)


def test_bf16_compute_keeps_fp32_params_and_logits():
    cfg = get_model_preset("tiny")
    model = build_model(cfg, execution=ExecutionConfig(dtype="bfloat16"), rngs=nnx.Rngs(0))
    logits = model(jnp.zeros((1, 4), jnp.int32))
    assert logits.dtype == jnp.float32 and model.blocks.attn.q[...].dtype == jnp.float32
    fp32 = build_model(get_model_preset("tiny"), rngs=nnx.Rngs(0))(jnp.zeros((1, 4), jnp.int32))
    err = float(jnp.max(jnp.abs(logits - fp32)))
    assert 0 < err < 0.05  # bf16 rounding visible but small


def test_padded_vocab_columns_never_win():
    cfg = get_model_preset("tiny", vocab_size=250)
    model = build_model(cfg, rngs=nnx.Rngs(0))
    logits = model.forward(jnp.zeros((1, 4), jnp.int32)).logits  # what the loss sees
    assert logits.shape[-1] == 256 and float(jnp.max(logits[..., 250:])) < -1e8
    assert model(jnp.zeros((1, 4), jnp.int32)).shape == (1, 4, 250)  # what users see


def test_model_state_holds_only_parameters():
    """Constants (RoPE frequencies) stay out of the state: in it they would be a runtime input of the
    layer scan and block constant folding, and would be checkpointed for nothing."""
    from jaxpar.models import build_model, get_model_preset

    model = build_model(get_model_preset("tiny"), rngs=nnx.Rngs(0))
    others = nnx.state(model, nnx.Not(nnx.Param))
    assert not jax.tree.leaves(others), jax.tree_util.tree_structure(others)
