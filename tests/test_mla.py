"""Multi-head Latent Attention against a reference written from Hugging Face's DeepseekV3Attention math
(eager path): HF-shaped Linear weights [out, in], head-major [B, N, T, H] tensors, interleaved RoPE via the
[even | odd] reordering + rotate_half, YaRN frequencies, cos/sin gain and softmax mscale², causal softmax."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from noise import array_ratios, check_arrays

from jaxpar.layers import AttentionConfig, YarnScaling
from jaxpar.layers.mla import MLA, MLAConfig, mla_param_count
from jaxpar.mesh import build_mesh
from jaxpar.meshes import get_mesh_preset
from jaxpar.rules import use_layout

B, T = 2, 8


@dataclasses.dataclass(frozen=True)
class Case:
    """One MLA under test: the model's attention settings (width, heads, RoPE theta and scaling, kernel,
    context-parallel strategy) and the MLA config; the reference reads the fields of both by name."""

    attn: AttentionConfig
    mla: MLAConfig

    def __getattr__(self, name):
        for part in (self.mla, self.attn):
            if name in {f.name for f in dataclasses.fields(part)}:
                return getattr(part, name)
        raise AttributeError(name)

    def replace(self, **changes):
        mla = {k: v for k, v in changes.items() if k in {f.name for f in dataclasses.fields(MLAConfig)}}
        attn = {k: v for k, v in changes.items() if k not in mla}
        return Case(dataclasses.replace(self.attn, **attn), dataclasses.replace(self.mla, **mla))


SMALL = Case(
    AttentionConfig(embed_dim=32, num_heads=4, num_kv_heads=4, head_dim=6, rope_theta=100.0),
    MLAConfig(q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6),
)
YARN = YarnScaling(factor=8.0, original_max_position=4, beta_fast=4.0, beta_slow=1.0, mscale=0.7, mscale_all_dim=1.0)
CONFIGS = {
    "q_lora": SMALL,
    "plain_q": SMALL.replace(q_lora_rank=None),
    "yarn": SMALL.replace(rope_scaling=YARN, rope_theta=50.0),
    "half_split": SMALL.replace(rope_interleave=False),
}


def make(cfg: Case, seed=0):
    """An MLA with O(1) activations: weights ~ N(0, 1/fan_in), norm scales around 1. Built abstract and
    filled from numpy: eager random init compiles one program per op and shape (~8 s here)."""
    m = nnx.eval_shape(lambda: MLA(cfg.attn, cfg.mla, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(seed)
    for path, p in nnx.to_flat_state(nnx.state(m, nnx.Param)):
        shape = p.shape
        if path[-1] == "scale":
            value = 1 + 0.2 * rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) / math.sqrt(shape[0] * (shape[1] if path[0] == "o" else 1))
        p.set_value(jnp.asarray(value, jnp.float32))
    return m


def hf_weights(m: MLA) -> dict:
    """Our weights in HF's nn.Linear layout ([out, in]); the converter's mapping, inverted."""
    w = {
        k: np.asarray(v)
        for k, v in ((".".join(map(str, path)), p[...]) for path, p in nnx.to_flat_state(nnx.state(m, nnx.Param)))
    }
    out = {
        "kv_a_proj_with_mqa": w["kv_a"].T,
        "kv_a_layernorm": w["kv_a_norm.scale"],
        "kv_b_proj": w["kv_b"].reshape(w["kv_b"].shape[0], -1).T,
        "o_proj": w["o"].reshape(-1, w["o"].shape[-1]).T,
    }
    if "q" in w:
        out["q_proj"] = w["q"].reshape(w["q"].shape[0], -1).T
    else:
        out.update(
            q_a_proj=w["q_a"].T, q_a_layernorm=w["q_a_norm.scale"], q_b_proj=w["q_b"].reshape(w["q_b"].shape[0], -1).T
        )
    return out


def hf_rope_params(cfg):
    """(inv_freq, attention_scaling, softmax scaling) as HF computes them for this config."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    inv = 1.0 / base ** (np.arange(0, dim, 2) / dim)
    scaling = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    s = cfg.rope_scaling
    if s is None:
        return inv, 1.0, scaling
    get_mscale = lambda f, m=1.0: 1.0 if f <= 1 else 0.1 * m * math.log(f) + 1.0
    corr = lambda rot: dim * math.log(s.original_max_position / (rot * 2 * math.pi)) / (2 * math.log(base))
    low, high = max(math.floor(corr(s.beta_fast)), 0), min(math.ceil(corr(s.beta_slow)), dim - 1)
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low + (0.001 if low == high else 0)), 0, 1)
    extrapolation_factor = 1 - ramp
    inv = inv / s.factor * (1 - extrapolation_factor) + inv * extrapolation_factor
    attention_factor = get_mscale(s.factor, s.mscale) / get_mscale(s.factor, s.mscale_all_dim)
    return inv, attention_factor, scaling * get_mscale(s.factor, s.mscale_all_dim) ** 2


def hf_reference(x, w, positions, cfg, xp=np):
    """DeepseekV3Attention.forward (eager, causal, no cache) in numpy (xp=np) or jax.numpy (xp=jnp)."""
    b, t, _ = x.shape
    n, hn, hr, hv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    linear = lambda a, name: a @ w[name].T
    rms = lambda a, name: w[name] * (a / xp.sqrt(xp.mean(a * a, axis=-1, keepdims=True) + cfg.latent_norm_eps))
    if cfg.q_lora_rank is None:
        q = linear(x, "q_proj")
    else:
        q = linear(rms(linear(x, "q_a_proj"), "q_a_layernorm"), "q_b_proj")
    q = q.reshape(b, t, n, hn + hr).transpose(0, 2, 1, 3)  # [B, N, T, Hq]
    q_pass, q_rot = q[..., :hn], q[..., hn:]
    compressed = linear(x, "kv_a_proj_with_mqa")
    k_pass, k_rot = compressed[..., : cfg.kv_lora_rank], compressed[..., cfg.kv_lora_rank :]
    kv = linear(rms(k_pass, "kv_a_layernorm"), "kv_b_proj").reshape(b, t, n, hn + hv).transpose(0, 2, 1, 3)
    k_pass, value = kv[..., :hn], kv[..., hn:]
    k_rot = k_rot.reshape(b, 1, t, hr)
    inv_freq, attention_scaling, scaling = hf_rope_params(cfg)
    freqs = positions[:, :, None] * inv_freq[None, None, :]  # [B, T, Hr/2]
    emb = xp.concatenate([freqs, freqs], axis=-1)
    cos, sin = (xp.cos(emb) * attention_scaling)[:, None], (xp.sin(emb) * attention_scaling)[:, None]

    def rotate_half(a):
        return xp.concatenate([-a[..., hr // 2 :], a[..., : hr // 2]], axis=-1)

    def rope(a):
        if cfg.rope_interleave:  # view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
            a = a.reshape(*a.shape[:-1], hr // 2, 2).swapaxes(-1, -2).reshape(a.shape)
        return a * cos + rotate_half(a) * sin

    q_rot, k_rot = rope(q_rot), rope(k_rot)
    query = xp.concatenate([q_pass, q_rot], axis=-1)
    key = xp.concatenate([k_pass, xp.broadcast_to(k_rot, (b, n, t, hr))], axis=-1)
    scores = query @ key.swapaxes(-1, -2) * scaling + xp.where(np.tril(np.ones((t, t), bool)), 0.0, -1e30)
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = xp.exp(scores) / xp.exp(scores).sum(axis=-1, keepdims=True)
    out = (probs @ value).transpose(0, 2, 1, 3).reshape(b, t, n * hv)
    return linear(out, "o_proj")


def inputs(cfg, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, T, cfg.embed_dim)).astype(np.float32)
    positions = (np.arange(T)[None] + np.array([[0], [5]])).astype(np.int32)  # row 1 starts at 5
    return x, positions


@pytest.mark.parametrize("name", CONFIGS)
def test_matches_hf_reference_and_gradients(name):
    cfg = CONFIGS[name]
    m = make(cfg)
    x, pos = inputs(cfg)
    w = hf_weights(m)
    got = np.asarray(nnx.jit(lambda m, x, p: m(x, p))(m, x, pos))
    want = hf_reference(x.astype(np.float64), {k: v.astype(np.float64) for k, v in w.items()}, pos, cfg)
    assert np.abs(want).max() > 0.3  # activations are O(1), not tiny
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)

    ct = np.random.default_rng(2).standard_normal(got.shape).astype(np.float32)
    g = jax.jit(jax.grad(lambda x: jnp.sum(m(x, pos) * ct)))(x)
    wj = {k: jnp.asarray(v) for k, v in w.items()}
    g_ref = jax.jit(jax.grad(lambda x: jnp.sum(hf_reference(x, wj, jnp.asarray(pos, jnp.float32), cfg, jnp) * ct)))(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("hv", [6, 16])  # v narrower than q/k (pad v), wider (pad q and k)
def test_padded_kernel_path_equals_plain_path(hv):
    """``implementation`` set routes through context_attention with zero-padded heads; same result."""
    cfg = CONFIGS["yarn"].replace(v_head_dim=hv)
    x, pos = inputs(cfg)
    call = nnx.jit(lambda m, x, p: m(x, p))
    want = np.asarray(call(make(cfg), x, pos))
    got = np.asarray(call(make(cfg.replace(implementation="xla")), x, pos))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["q_lora", "plain_q"])
def test_param_count_small(name):
    m = make(CONFIGS[name])
    total = sum(p[...].size for _, p in nnx.to_flat_state(nnx.state(m, nnx.Param)))
    case = CONFIGS[name]
    assert mla_param_count(case.mla, embed_dim=case.embed_dim, num_heads=case.num_heads) == total


def test_param_count_deepseek_v3():
    """D=7168, N=128, Rq=1536, Rkv=512, Hn=128, Hr=64, Hv=128: counted from the abstract module's shapes."""
    attn = AttentionConfig(embed_dim=7168, num_heads=128, num_kv_heads=128, head_dim=128)
    cfg = MLAConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    m = nnx.eval_shape(lambda: MLA(attn, cfg, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0)))
    sizes = {".".join(map(str, k)): math.prod(p.shape) for k, p in nnx.to_flat_state(nnx.state(m, nnx.Param))}
    matrices = 7168 * 1536 + 1536 * 128 * 192 + 7168 * (512 + 64) + 512 * 128 * 256 + 128 * 128 * 7168
    assert matrices == 187_105_280
    assert sizes["q_a_norm.scale"] + sizes["kv_a_norm.scale"] == 1536 + 512
    assert (
        sum(sizes.values()) == mla_param_count(cfg, embed_dim=7168, num_heads=128) == 187_105_280 + 2048 == 187_107_328
    )


NAMES = ("out", "dx")


@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
def test_context_parallel_matches_one_device(strategy):
    """Under the ``cp`` preset (sequence=8), natural order (index = positions): output and dx equal the
    single-device plain path's (the zero padding and the q pre-scale go through the kernels' backward too),
    within a multiple of that path's own noise: the same path on the tokens in another order, positions
    carried along (tests/noise.py)."""
    cfg = CONFIGS["yarn"].replace(num_heads=8, num_kv_heads=8)
    x, pos = inputs(cfg)
    x, pos = np.concatenate([x, x[:, ::-1]], axis=1), np.concatenate([pos, pos + T], axis=1)  # T = 16
    ct = np.random.default_rng(3).standard_normal((B, 2 * T, cfg.embed_dim)).astype(np.float32)

    def run(m, order=None):
        def f(m, x, p, ct):
            y, vjp = jax.vjp(lambda x: m(x, p, p), x)
            return y, vjp(ct)[0]

        order = np.arange(2 * T) if order is None else order
        back = np.argsort(order)
        return [np.asarray(a)[:, back] for a in nnx.jit(f)(m, x[:, order], pos[:, order], ct[:, order])]

    want = run(make(cfg))
    noise = max(array_ratios(run(make(cfg), np.random.default_rng(1).permutation(2 * T)), want, NAMES).values())
    preset = get_mesh_preset("cp")
    mesh = build_mesh(preset.mesh)
    assert dict(mesh.shape)["sequence"] == 8
    with use_layout(mesh, preset.rules):
        m = make(cfg.replace(context_parallel=strategy))
        got = run(m)
        graphdef, state = nnx.split(m)
        hlo = jax.jit(lambda s, x, p: nnx.merge(graphdef, s)(x, p, p)).lower(state, x, pos).as_text()
    assert {"ring": "collective_permute", "ulysses": "all_to_all"}[strategy] in hlo  # the kernel ran
    check_arrays(got, want, noise, "context", f"MLA under {strategy} on cp", NAMES)
