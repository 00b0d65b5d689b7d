"""DeepSeek-V3 Multi-head Latent Attention (MLA), with Hugging Face's ``DeepseekV3Attention`` weight layout.

Legend: B batch, T positions, D width, N heads, Rq q_lora_rank, Rkv kv_lora_rank, Hn qk_nope_head_dim,
Hr qk_rope_head_dim, Hq = Hn + Hr (query/key width per head), Hv v_head_dim.

Weights (HF ``nn.Linear`` weights are [out, in]; ours are their transposes with the out side split per head):
    q_a [D, Rq]  q_a_norm [Rq]  q_b [Rq, N, Hq]   = q_a_proj.T, q_a_layernorm, q_b_proj.T.reshape(Rq, N, Hq)
    q   [D, N, Hq]                                = q_proj.T.reshape(D, N, Hq)        (q_lora_rank None)
    kv_a [D, Rkv + Hr]  kv_a_norm [Rkv]           = kv_a_proj_with_mqa.T, kv_a_layernorm
    kv_b [Rkv, N, Hn + Hv]                        = kv_b_proj.T.reshape(Rkv, N, Hn + Hv)
    o   [N, Hv, D]                                = o_proj.T.reshape(N, Hv, D)
Per head, q's last Hr columns are its rope part; kv_a's last Hr columns are one rope key per token, shared
by all heads (never broadcast in memory on the plain path). kv_b gives [k_nope | v] per head.
For generation (``absorb``, at the inference boundary) kv_b's halves are also held as the two arrays the
absorbed decode reads as they lie: kv_k [N, Hn, Rkv] and kv_v [N, Rkv, Hv] (slicing and transposing kv_b
inside the step copied it in every step). Prefill keeps reading kv_b, as training does (read through
kv_k and kv_v, XLA:CPU copied them); the two layouts cost kv_b's bytes once more per layer.

RoPE (decoupled: only the Hr parts rotate), HF ``rope_interleave=True`` (DeepSeek-V3's default and the layout
of DeepSeek's own checkpoints): the Hr columns hold rotation pairs (2i, 2i+1) turned by angle p·inv_freq[i].
Exactly as HF's ``apply_rotary_pos_emb_interleave``, we reorder them to [even | odd] and rotate half-split
(``jaxpar.layers.rope.apply_rope``); the rotated q/k stay in that order (only q·k is used, so the order is
free as long as q and k agree). ``rope_interleave=False`` rotates the stored halves (HF ``apply_rotary_pos_emb``).

Scale: scores = Hq^-0.5 · (q_nope·k_nope + q_rope·k_rope). With ``YarnScaling`` (HF rope type "yarn"):
inv_freq blends interpolated/extrapolated frequencies over the [beta_fast, beta_slow] correction range of the
*original* context; cos/sin are multiplied by ``attention_factor`` (mscale(f, mscale) / mscale(f, mscale_all_dim),
1.0 for DeepSeek-V3), and the softmax scale by mscale(f, mscale_all_dim)² (as HF's ``self.scaling``).
Not supported: HF's "dynamic"/"linear"/"longrope" types (``RopeScaling`` is Llama 3.1's), and HF's override of
``factor`` by max_position_embeddings / original_max_position_embeddings (pass the ratio as ``factor``).

Attention core: with ``context_parallel == "none"`` and ``implementation`` None, an explicit causal softmax in
float32 (O(T²) scores; masks by ``index``). Otherwise ``jaxpar.parallel.attention.context_attention``, whose
kernels need one head width for q, k and v: q/k and v are zero-padded to H = max(Hq, Hv) (for DeepSeek-V3
192: V, its ring traffic and the P·V matmul grow by Hq/Hv = 1.5×), q is pre-multiplied by scale·√H (the
kernels scale by H^-0.5; one extra rounding of q in bf16), and the output is sliced back to Hv. K/V there have N
heads: the rules should map
``act_kv_heads`` like ``act_heads``.

LoRA (``jaxpar.layers.lora``, targets ``mla_targets``): an adapter beside q_a, q_b (or q), kv_a, kv_b and o.
The absorbed decode never folds kv_b's adapter into kv_k and kv_v: with A [Rkv, r] and B [r, N, Hn + Hv]
(its first Hn columns B_k, the rest B_v), the keys' part of the scores is q_nope · B_kᵀ · Aᵀ · latent,
so the query's latent gains scale · (q_nope B_kᵀ) Aᵀ, and the output gains scale · (mixed A) B_v:
products of the rank, which a bank of adapters (one per row) computes as well. QLoRA, or a model
quantized for serving, stores those five weights quantized (``jaxpar.layers.quant``); ``absorb`` gives
kv_k and kv_v kv_b's dequantized values.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.errors import ConfigError
from jaxpar.layers.attention import AttentionConfig, output_projection
from jaxpar.layers.common import param
from jaxpar.layers.kvcache import DECODE, LatentCache, Step, filled, map_arrays, mla_decode, slot_axis
from jaxpar.layers.lora import SPECS, add_adapter, delta, factors, project
from jaxpar.layers.norms import RMSNorm
from jaxpar.layers.quant import dequantize, quantize_weights, weight
from jaxpar.layers.rope import YarnScaling, apply_rope, rope_frequencies, yarn_frequencies
from jaxpar.parallel.attention import context_attention
from jaxpar.rules import constrain

HEADS = ("batch", "inner_length", "act_heads", None)
TOKENS = ("batch", "inner_length", None)


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """What MLA adds to the model's attention settings (width, heads, RoPE theta and scaling, kernel and
    context-parallel strategy come from the model config, through ``AttentionConfig``)."""

    q_lora_rank: int | None  # None: a plain q [D, N, Hq] (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    latent_norm_eps: float = 1e-6  # HF builds both latent norms with its default eps 1e-6
    rope_interleave: bool = True  # HF config field of the same name

    def __post_init__(self):
        sizes = dict(
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
        )
        if self.q_lora_rank is not None:
            sizes["q_lora_rank"] = self.q_lora_rank
        for name, size in sizes.items():
            if size < 1:
                raise ConfigError(f"model.mla.{name}={size} must be ≥ 1")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"model.mla.qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        if not self.latent_norm_eps > 0:
            raise ConfigError(f"model.mla.latent_norm_eps={self.latent_norm_eps} must be > 0")


def _mscale(factor: float, m: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def mla_scales(mla: MLAConfig, rope_scaling) -> tuple[float, float]:
    """``(rope_gain, softmax_scale)``: the factor on the rotated q/k rope parts (HF multiplies cos and sin)
    and the factor on the scores."""
    scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
    s = rope_scaling
    if not isinstance(s, YarnScaling):
        return 1.0, scale
    gain = s.attention_factor
    if gain is None:
        gain = (
            _mscale(s.factor, s.mscale) / _mscale(s.factor, s.mscale_all_dim)
            if s.mscale and s.mscale_all_dim
            else _mscale(s.factor, 1.0)
        )
    if s.mscale_all_dim:
        scale *= _mscale(s.factor, s.mscale_all_dim) ** 2
    return float(gain), float(scale)


def mla_param_count(cfg: MLAConfig, *, embed_dim: int, num_heads: int) -> int:
    """Exact number of parameters of one ``MLA`` layer, norm scales included."""
    d, n, hq = embed_dim, num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    rq, rkv = cfg.q_lora_rank, cfg.kv_lora_rank
    q = d * n * hq if rq is None else d * rq + rq + rq * n * hq
    kv = d * (rkv + cfg.qk_rope_head_dim) + rkv + rkv * n * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return q + kv + n * cfg.v_head_dim * d


def mla_targets(cfg: MLAConfig) -> tuple[str, ...]:
    """The projections of an MLA layer that LoRA can adapt (``model.lora.targets``)."""
    return (("q",) if cfg.q_lora_rank is None else ("q_a", "q_b")) + ("kv_a", "kv_b", "o")


class MLA(nnx.Module):
    """``attn`` gives width, heads, RoPE theta and scaling, kernel and context-parallel strategy (its
    kv-head and head-width fields are not used); ``cfg`` the latent ranks and head widths."""

    def __init__(self, attn: AttentionConfig, cfg: MLAConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        d, n, rq, rkv = attn.embed_dim, attn.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
        hn, hr, hv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.attn, self.cfg, self.dtype = attn, cfg, dtype
        if rq is None:
            self.q = param(rngs, (d, n, hn + hr), ("embed", "heads", "head_dim"), dtype=param_dtype)
        else:
            self.q_a = param(rngs, (d, rq), ("embed", "q_lora"), dtype=param_dtype)
            self.q_a_norm = RMSNorm(rq, eps=cfg.latent_norm_eps, name="q_lora", param_dtype=param_dtype)
            self.q_b = param(rngs, (rq, n, hn + hr), ("q_lora", "heads", "head_dim"), dtype=param_dtype)
        self.kv_a = param(rngs, (d, rkv + hr), ("embed", None), dtype=param_dtype)
        self.kv_a_norm = RMSNorm(rkv, eps=cfg.latent_norm_eps, name="kv_lora", param_dtype=param_dtype)
        self.kv_b = param(rngs, (rkv, n, hn + hv), ("kv_lora", "heads", "head_dim"), dtype=param_dtype)
        self.o = param(rngs, (n, hv, d), ("heads", "head_dim", "embed"), dtype=param_dtype)
        for name in mla_targets(cfg):
            add_adapter(self, name, SPECS[name], attn.lora, rngs)
        quantize_weights(self, {name: SPECS[name] for name in mla_targets(cfg)}, attn.quantize)

    @property
    def inv_freq(self) -> np.ndarray:
        """RoPE frequencies [Hr/2], from the config at trace time (never module state; see attention.py)."""
        attn, dim = self.attn, self.cfg.qk_rope_head_dim
        if isinstance(attn.rope_scaling, YarnScaling):
            return yarn_frequencies(dim, theta=attn.rope_theta, scaling=attn.rope_scaling)
        return rope_frequencies(dim, theta=attn.rope_theta, scaling=attn.rope_scaling)

    def _w(self, name: str) -> jax.Array:
        """Weight ``name`` in the compute dtype (dequantized when QLoRA stores it quantized)."""
        return weight(self, name, SPECS.get(name, ""), self.dtype)

    def _rope(self, x: jax.Array, positions: jax.Array, gain: float) -> jax.Array:
        """x [B, T, N or 1, Hr] in the weights' column order -> rotated, in [even | odd] order if interleaved."""
        if self.cfg.rope_interleave:
            x = x.reshape(*x.shape[:-1], -1, 2).swapaxes(-1, -2).reshape(x.shape)
        y = apply_rope(x, positions, self.inv_freq)
        return y if gain == 1.0 else y * jnp.asarray(gain, y.dtype)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        index: jax.Array | None = None,
        *,
        cache: LatentCache | None = None,
        step: Step | None = None,
        segments: jax.Array | None = None,
    ):
        """x [B, T, D]; positions [B, T] for RoPE; index [B, T]: each stored token's place in the original
        sequence (the causal mask; differs from storage order under zig-zag context parallelism). With a
        ``cache`` (generation, see ``jaxpar.layers.kvcache``) returns (y, the updated cache); ``segments``:
        each token's document in a packed row, or None."""
        cfg = self.cfg
        hn, rkv = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        x = constrain(x, ("batch", "inner_length", "act_embed"))  # [B, T, D]
        if cfg.q_lora_rank is None:
            q = self._project("q", x)
        else:
            cq = self.q_a_norm(constrain(self._project("q_a", x), TOKENS))  # [B, T, Rq]
            q = self._project("q_b", cq)
        q = constrain(q, HEADS)  # [B, T, N, Hq]
        ckv = constrain(self._project("kv_a", x), TOKENS)  # [B, T, Rkv + Hr]
        latent = self.kv_a_norm(ckv[..., :rkv])  # [B, T, Rkv]
        gain, scale = mla_scales(cfg, self.attn.rope_scaling)
        q_nope, q_rope = q[..., :hn], self._rope(q[..., hn:], positions, gain)
        k_rope = self._rope(ckv[..., None, rkv:], positions, gain)  # [B, T, 1, Hr]
        if cache is not None and step.mode == DECODE:
            out, cache = self._decode(q_nope, q_rope, latent, k_rope[:, :, 0], cache, positions, scale)
        else:
            index = positions if index is None else index
            out = self._attention(q_nope, q_rope, latent, k_rope, index, scale, segments)
            if cache is not None:  # prefill
                slots = cache.latent.shape[slot_axis(LatentCache.NAMES[0])]
                cache = map_arrays(
                    LatentCache(*(filled(a, step.lengths, slots) for a in (latent, k_rope[:, :, 0]))), constrain
                )
        out = checkpoint_name(constrain(out, HEADS), "attn_ctx")  # [B, T, N, Hv]
        y = output_projection(out, self._w("o"), flat=cache is not None)
        extra = delta(self, "o", SPECS["o"], out)
        y = constrain(y if extra is None else y + extra, ("batch", "length", "act_embed"))
        return y if cache is None else (y, cache)

    def _project(self, name: str, x: jax.Array) -> jax.Array:
        """x through weight ``name`` (and its adapter, if any)."""
        return project(self, name, SPECS[name], x, self._w(name))

    def _attention(self, q_nope, q_rope, latent, k_rope, index, scale: float, segments=None) -> jax.Array:
        """Training and prefill: per-head keys and values from the latent, then causal attention."""
        hn = self.cfg.qk_nope_head_dim
        kv = constrain(self._project("kv_b", latent), HEADS)  # [B, T, N, Hn + Hv]
        k_nope, v = kv[..., :hn], kv[..., hn:]
        if self.attn.context_parallel == "none" and self.attn.implementation is None:
            return _causal_attention(q_nope, q_rope, k_nope, k_rope[:, :, 0], v, index, scale, segments)
        k_rope = jnp.broadcast_to(k_rope, (*k_nope.shape[:-1], k_rope.shape[-1]))
        q = constrain(jnp.concatenate([q_nope, q_rope], axis=-1), HEADS)
        k = constrain(jnp.concatenate([k_nope, k_rope], axis=-1), HEADS)
        return self._padded_attention(q, k, v, index, scale, segments)

    def _decode(self, q_nope, q_rope, latent, rope_key, cache: LatentCache, positions, scale: float):
        """Decoding over the latent cache with kv_b absorbed: keys through the query (q_nope · W_k),
        values through the output (weights · latents) · W_v."""
        if hasattr(self, "kv_k"):  # absorbed: kv_k [N, Hn, Rkv], kv_v [N, Rkv, Hv]
            w_k, w_v = self._w("kv_k"), self._w("kv_v")
        else:  # a layer sliced out of a stack: kv_b's halves, laid out here
            w, hn = self._w("kv_b"), self.cfg.qk_nope_head_dim
            w_k, w_v = jnp.einsum("rnh->nhr", w[..., :hn]), jnp.einsum("rnh->nrh", w[..., hn:])
        q_latent = jnp.einsum("btnh,nhr->btnr", q_nope, w_k)  # [B, T, N, Rkv]
        adapter = factors(self, "kv_b")
        if adapter is not None:  # kv_b's adapter, through its factors (module doc)
            row, a, b, gain = adapter
            a, b, gain = a.astype(q_nope.dtype), b.astype(q_nope.dtype), jnp.asarray(gain, q_nope.dtype)
            hn = self.cfg.qk_nope_head_dim
            q_b = jnp.einsum(f"btnh,{row}znh->btnz", q_nope, b[..., :hn])
            q_latent = q_latent + jnp.einsum(f"btnz,{row}rz->btnr", q_b, a) * gain
        mixed, cache = mla_decode(q_latent, q_rope, latent, rope_key, cache, positions, scale=scale)
        out = jnp.einsum("btnr,nrh->btnh", mixed, w_v)
        if adapter is not None:
            low = jnp.einsum(f"btnr,{row}rz->btnz", mixed.astype(a.dtype), a)
            out = out + jnp.einsum(f"btnz,{row}znh->btnh", low, b[..., hn:]).astype(out.dtype) * gain
        return out, cache

    def _padded_attention(self, q, k, v, index, scale: float, segments=None) -> jax.Array:
        """``context_attention`` with q/k [B, T, N, Hq] and v [B, T, N, Hv] zero-padded to one width H."""
        h = max(q.shape[-1], v.shape[-1])
        pad = lambda a: a if a.shape[-1] == h else jnp.pad(a, [(0, 0)] * 3 + [(0, h - a.shape[-1])])
        q = q * jnp.asarray(scale * math.sqrt(h), q.dtype)
        out = context_attention(
            pad(q),
            pad(k),
            pad(v),
            index,
            strategy=self.attn.context_parallel,
            window=None,
            implementation=self.attn.implementation,
            segments=segments,
        )
        return out[..., : v.shape[-1]]


def _causal_attention(q_nope, q_rope, k_nope, k_rope, v, index, scale: float, segments=None) -> jax.Array:
    """q_nope/k_nope [B, T, N, Hn], q_rope [B, T, N, Hr], k_rope [B, T, Hr] (shared by the heads),
    v [B, T, N, Hv], index [B, T], segments [B, T] or None. Scores and softmax in float32; returns
    [B, T, N, Hv] in v's dtype."""
    f32 = jnp.float32
    s = jnp.einsum("btnh,bsnh->bnts", q_nope, k_nope, preferred_element_type=f32)
    s = s + jnp.einsum("btnh,bsh->bnts", q_rope, k_rope, preferred_element_type=f32)
    visible = index[:, None, :, None] >= index[:, None, None, :]  # [B, 1, T, S]
    if segments is not None:
        visible &= segments[:, None, :, None] == segments[:, None, None, :]
    p = jax.nn.softmax(jnp.where(visible, s * scale, jnp.finfo(f32).min), axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", p.astype(v.dtype), v)


def _eager_or_abstract(fn, *xs):
    """fn(*xs), or its shapes when xs are abstract (``jax.ShapeDtypeStruct``)."""
    return jax.eval_shape(fn, *xs) if isinstance(xs[0], jax.ShapeDtypeStruct) else fn(*xs)


def absorb(attn: MLA) -> None:
    """In place: ``attn`` given kv_k [N, Hn, Rkv] and kv_v [N, Rkv, Hv], kv_b's halves in the absorbed
    decode's layouts (module doc), with the logical names of the dimensions they came from. Abstract
    stays abstract. A quantized kv_b (QLoRA) gives them its dequantized values in the compute dtype,
    the values prefill reads."""
    hn = attn.cfg.qk_nope_head_dim
    if hasattr(attn, "kv_b_data"):
        fn = functools.partial(dequantize, spec=SPECS["kv_b"], kind=attn.quant, dtype=attn.dtype)
        w = _eager_or_abstract(fn, attn.kv_b_data.get_value(), attn.kv_b_scale.get_value())
        names = dict(zip(("r", "n", "h"), attn.kv_b_data.out_sharding))
    else:
        w, names = attn.kv_b.get_value(), dict(zip(("r", "n", "h"), attn.kv_b.out_sharding))
    for field, spec, part in (("kv_k", "nhr", slice(None, hn)), ("kv_v", "nrh", slice(hn, None))):
        value = _eager_or_abstract(lambda x, spec=spec, part=part: jnp.einsum(f"rnh->{spec}", x[..., part]), w)
        setattr(attn, field, nnx.Param(value, out_sharding=tuple(names[c] for c in spec), eager_sharding=False))


ABSORBED = ("kv_k", "kv_v")  # what ``absorb`` adds (``jaxpar.inference.unstack.restack`` drops them)
