"""A hand-written, plain-JAX train step for the dense decoder (the reference of ``benchmarks/overhead.py``).

No Flax, no NNX, no logical axes: parameters are a nested dict of arrays, the forward pass is a function,
activations are pinned with ``jax.lax.with_sharding_constraint`` and PartitionSpecs written once
(``ActivationSpecs``), the optimizer is optax's AdamW after global-norm clipping. It computes the same
math as ``jaxpar.models.dense.DenseLM`` + ``jaxpar.train.step`` (untied embeddings, no QKV bias, no QK
norm, no sliding window, no RoPE scaling: the ``tiny`` and ``llama-100m`` presets), which is what the
overhead benchmark and ``tests/test_overhead_reference.py`` rely on.

Legend: B batch, T positions, D width, N query heads, K kv heads, H head dim, F mlp width, L layers,
V vocab (padded to the table's rows).

Parameter tree (the same keys as ``nnx.to_pure_dict(nnx.state(model, nnx.Param))``):
    embed.embedding [V, D]              lm_head [D, V]              final_norm.scale [D]
    blocks.attn_norm.scale [L, D]       blocks.attn.{q [L,D,N,H], k [L,D,K,H], v [L,D,K,H], o [L,N,H,D]}
    blocks.mlp_norm.scale [L, D]        blocks.mlp.{gate_up [L,D,2,F], down [L,F,D]}
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec

_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "attn": jax.checkpoint_policies.save_only_these_names("attn_out"),
}


class Hyper:
    """A model config and the execution it runs under (``jaxpar.execution``: the compute dtype, remat, the
    attention kernel), read by name as one set of hyper-parameters: what this reference calls ``cfg``."""

    def __init__(self, cfg, execution):
        self._parts = (execution, cfg)

    def __getattr__(self, name):
        for part in self._parts:
            if hasattr(part, name):
                return getattr(part, name)
        raise AttributeError(name)


def check_supported(cfg) -> None:
    """The reference reads a ``jaxpar.models.DenseConfig`` as plain hyper-parameters; refuses the
    features it leaves out."""
    unsupported = [
        name
        for name, on in (
            ("qkv_bias", cfg.qkv_bias),
            ("qk_norm", cfg.qk_norm),
            ("sliding_window", cfg.sliding_window is not None),
            ("rope_scaling", cfg.rope_scaling is not None),
            ("tie_embeddings", cfg.tie_embeddings),
        )
        if on
    ]
    if unsupported:
        raise ValueError(f"plain reference: {', '.join(unsupported)} not implemented")


class ActivationSpecs(NamedTuple):
    """Where each activation lives. ``None`` everywhere (the default) places no constraint at all."""

    mesh: Any = None
    tokens: PartitionSpec | None = None  # [B, T] ids and targets
    resid: PartitionSpec | None = None  # [B, T, D] residual stream between blocks
    inner: PartitionSpec | None = None  # [B, T, D] normed input of attention / MLP
    q: PartitionSpec | None = None  # [B, T, N, H]
    kv: PartitionSpec | None = None  # [B, T, K, H]
    gate_up: PartitionSpec | None = None  # [B, T, 2, F]
    hidden: PartitionSpec | None = None  # [B, T, F]
    logits: PartitionSpec | None = None  # [B, T, V]

    def pin(self, x: jax.Array, which: str) -> jax.Array:
        spec = getattr(self, which)
        if spec is None or self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))


# ------------------------------------------------------------------------------------------ forward
def rms_norm(x, scale, eps):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rope(x, positions, inv_freq):
    """Half-split rotary embedding of x [B, T, heads, H] at positions [B, T], in float32."""
    angles = positions.astype(jnp.float32)[:, :, None, None] * jnp.asarray(inv_freq, jnp.float32)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attention(x, p, positions, cfg, sp: ActivationSpecs):
    dt = jnp.dtype(cfg.dtype)
    inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim)
    x = sp.pin(x, "inner")
    q = sp.pin(jnp.einsum("btd,dnh->btnh", x, p["q"].astype(dt)), "q")
    k = sp.pin(jnp.einsum("btd,dnh->btnh", x, p["k"].astype(dt)), "kv")
    v = sp.pin(jnp.einsum("btd,dnh->btnh", x, p["v"].astype(dt)), "kv")
    q, k = rope(q, positions, inv_freq), rope(k, positions, inv_freq)
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=cfg.attention_impl)
    out = sp.pin(out, "q")
    return sp.pin(jnp.einsum("btnh,nhd->btd", out, p["o"].astype(dt)), "resid")


def swiglu(x, p, cfg, sp: ActivationSpecs):
    dt = jnp.dtype(cfg.dtype)
    x = sp.pin(x, "inner")
    h = sp.pin(jnp.einsum("btd,dgf->btgf", x, p["gate_up"].astype(dt)), "gate_up")
    h = sp.pin(jax.nn.silu(h[:, :, 0]) * h[:, :, 1], "hidden")
    return sp.pin(jnp.einsum("btf,fd->btd", h, p["down"].astype(dt)), "resid")


NO_SPECS = ActivationSpecs()


def forward(params, ids, cfg, sp: ActivationSpecs = NO_SPECS):
    """ids [B, T] int32 -> logits [B, T, V] float32, padded vocab columns at -1e9."""
    dt = jnp.dtype(cfg.dtype)
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    x = sp.pin(jnp.take(params["embed"]["embedding"], ids, axis=0).astype(dt), "resid")

    def layer(x, p, positions):
        h = attention(rms_norm(x, p["attn_norm"]["scale"], cfg.norm_eps), p["attn"], positions, cfg, sp)
        x = x + checkpoint_name(h, "attn_out")
        x = x + swiglu(rms_norm(x, p["mlp_norm"]["scale"], cfg.norm_eps), p["mlp"], cfg, sp)
        return sp.pin(x, "resid")

    if str(getattr(cfg.remat, "value", cfg.remat)) != "none":
        layer = jax.checkpoint(layer, policy=_POLICIES[str(getattr(cfg.remat, "value", cfg.remat))], prevent_cse=False)
    x, _ = jax.lax.scan(lambda x, p: (layer(x, p, positions), None), x, params["blocks"])
    x = rms_norm(x, params["final_norm"]["scale"], cfg.norm_eps)
    logits = jnp.einsum("btd,dv->btv", x, params["lm_head"].astype(dt))
    logits = sp.pin(logits.astype(jnp.float32), "logits")
    if cfg.padded_vocab != cfg.vocab_size:
        logits = jnp.where(jnp.arange(cfg.padded_vocab) < cfg.vocab_size, logits, -1e9)
    return logits


def loss_fn(params, batch, cfg, sp: ActivationSpecs = NO_SPECS):
    """Mean next-token cross-entropy in float32."""
    logits = forward(params, batch["inputs"], cfg, sp)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, batch["targets"][..., None], axis=-1)[..., 0]
    return jnp.mean(log_z - picked)


# ---------------------------------------------------------------------------------------- optimizer
def decay_mask(params):
    """Weight decay on matrices and embeddings; none on norm scales (every ``*norm`` subtree)."""

    def decays(path, _):
        return not any(str(getattr(k, "key", k)).endswith("norm") for k in path)

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(
    *, learning_rate=3e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip_norm: float | None = 1.0
) -> optax.GradientTransformation:
    adamw = optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decay_mask)
    return adamw if clip_norm is None else optax.chain(optax.clip_by_global_norm(clip_norm), adamw)


# ------------------------------------------------------------------------------------------- step
def state_shardings(tx: optax.GradientTransformation, params):
    """Shardings of ``(params, opt_state)``: moments follow their parameters, counters replicated."""
    param_sh = jax.tree.map(lambda a: a.sharding, params)
    mesh = jax.tree.leaves(param_sh)[0].mesh
    replicated = NamedSharding(mesh, PartitionSpec())
    abstract = jax.eval_shape(tx.init, params)
    opt_sh = optax.tree_map_params(tx, lambda _, s: s, abstract, param_sh, transform_non_params=lambda _: replicated)
    return param_sh, opt_sh, replicated


def init_state(tx, params):
    """``(params, opt_state)`` with the optimizer state created in its shards."""
    _, opt_sh, _ = state_shardings(tx, params)
    return params, jax.jit(tx.init, out_shardings=opt_sh)(params)


def make_train_step(cfg, tx: optax.GradientTransformation, params, batch_sharding, sp: ActivationSpecs = NO_SPECS):
    """``step((params, opt_state), batch) -> ((params, opt_state), (loss, grad_norm))``, jitted with
    explicit shardings, the state donated."""
    check_supported(cfg)
    param_sh, opt_sh, replicated = state_shardings(tx, params)

    def step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, cfg, sp)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), (loss, optax.tree.norm(grads))

    return jax.jit(
        step,
        in_shardings=((param_sh, opt_sh), batch_sharding),
        out_shardings=((param_sh, opt_sh), (replicated, replicated)),
        donate_argnums=0,
    )
