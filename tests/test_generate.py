"""Generation: the KV-cache rollout against the training forward, decode layouts, buckets, stops, refusals.

The oracle is the training forward (``model(ids)``: no cache, no decode kernel) rolled out by argmax on a
fixed-size buffer, so one compiled program serves every step. Logits must agree within a multiple of the
reference's own noise (tests/noise.py), measured here: the oracle rolled out again on a wider buffer
(every attention sum over more, masked, slots), or the one-device decode again with a larger cache.
Tokens must agree wherever the reference's top-two logit margin exceeds that bound (the margin rule);
positions below it are reported. A stale cache entry (the reference fed one other prompt token) must
miss the bound by a wide margin.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from noise import FLOOR, MULTIPLE, MUTATION_GAP, record

from jaxpar.errors import ConfigError, LayoutError
from jaxpar.execution import ExecutionConfig
from jaxpar.inference import layouts
from jaxpar.inference.generate import Generator, bucket
from jaxpar.layers.kvcache import KVCache, gqa_decode, keys_layout, slot_axis, values_layout
from jaxpar.meshes import Phase, compose_rules
from jaxpar.models import build_model, get_model_preset

NEW = 8
BELOW_MARGIN: list = []  # (case, prompt, step, margin, error): reported, never hidden


def _cfg(name: str, **kw):
    return get_model_preset(name, **kw)


DROPLESS = ExecutionConfig(capacity_factor=None)  # the oracle must route like decode: dropless


VARIANTS = {
    "gqa": ("tiny", {}),
    "mqa": ("tiny", dict(num_kv_heads=1)),
    "bias_qknorm_tied": ("tiny", dict(qkv_bias=True, qk_norm=True, tie_embeddings=True)),
    "window_4": ("tiny", dict(sliding_window=4)),
    "tiny_moe": ("tiny-moe", {}),
    "tiny_deepseek_mla": ("tiny-deepseek", {}),
}
PROMPT_LENGTHS = (11, 5, 8)


def _prompts(vocab: int, lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def _model(cfg):
    model = build_model(cfg, execution=DROPLESS, rngs=nnx.Rngs(0))
    if cfg.qkv_bias:  # zero-initialised: make them matter
        for name in ("q_bias", "k_bias", "v_bias"):
            p = getattr(model.blocks.attn, name)
            p[...] = 0.3 * jax.random.normal(jax.random.key(len(name)), p.shape)
    return model


def _oracle_rollout(model, prompts, steps: int, pad: int = 0):
    """Argmax rollout of the training forward on a buffer ``pad`` slots wider than it needs: (tokens per
    prompt, logits [steps, V] per prompt)."""
    width = max(map(len, prompts)) + steps + pad
    graphdef, state = nnx.split(model)
    run = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))
    forward = lambda ids: run(state, ids)
    seqs = [list(p) for p in prompts]
    logits = [[] for _ in prompts]
    for _ in range(steps):
        buf = np.zeros((len(seqs), width), np.int32)
        for i, s in enumerate(seqs):
            buf[i, : len(s)] = s
        out = np.asarray(forward(jnp.asarray(buf)))
        for i, s in enumerate(seqs):
            logits[i].append(out[i, len(s) - 1])
            s.append(int(np.argmax(out[i, len(s) - 1])))
    return [s[len(p) :] for s, p in zip(seqs, prompts)], [np.stack(l) for l in logits]


def logit_error(tokens, logits, ref_tokens, ref_logits) -> float:
    """max |Δlogit| over each prompt's steps up to and including the first where the tokens differ."""
    err = 0.0
    for t, l, rt, rl in zip(tokens, logits, ref_tokens, ref_logits):
        for step in range(len(rt)):
            err = max(err, float(np.max(np.abs(l[step] - rl[step]))))
            if t[step] != rt[step]:
                break
    return err


def logit_bound(noise: float) -> float:
    return max(MULTIPLE * noise, FLOOR["logit"])


def margin_check(case, tokens, logits, ref_tokens, ref_logits, tol: float, noise: float | None = None) -> float:
    """Asserts the margin rule with logit tolerance ``tol``; returns the measured max logit error over
    the shared prefixes (recorded with ``noise``, the reference's own, when given)."""
    err = 0.0
    for i, (t, l, rt, rl) in enumerate(zip(tokens, logits, ref_tokens, ref_logits)):
        for step in range(len(rt)):
            e = float(np.max(np.abs(l[step] - rl[step])))
            err = max(err, e)
            if t[step] != rt[step]:
                top2 = np.sort(rl[step])[-2:]
                margin = float(top2[1] - top2[0])
                assert margin <= 2 * max(e, tol), (case, i, step, margin, e)
                BELOW_MARGIN.append((case, i, step, margin, e))
                print(f"{case}: prompt {i} step {step} differs below the margin ({margin:.2e} vs error {e:.2e})")
                break
    if noise is not None:
        record("generation", case, noise=dict(logit=noise), tolerance=dict(logit=tol), error=dict(logit=err))
    assert err <= tol, (case, err, tol)
    return err


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decode_rollout_equals_the_training_forward(variant):
    name, kw = VARIANTS[variant]
    model = _model(_cfg(name, **kw))
    prompts = _prompts(model.cfg.vocab_size)
    ref_tokens, ref_logits = _oracle_rollout(model, prompts, NEW)
    noise = logit_error(*_oracle_rollout(model, prompts, NEW, pad=16), ref_tokens, ref_logits)
    out = Generator(model).generate(prompts, max_new_tokens=NEW, return_logits=True)
    err = margin_check(variant, out.tokens, out.logits, ref_tokens, ref_logits, logit_bound(noise), noise)
    print(f"{variant}: max |logit error| {err:.2e}, the oracle's own noise {noise:.2e}")
    if kw.get("sliding_window"):  # a window cache keeps the window, no more
        cache = Generator(model).model.empty_cache(2, 64)["blocks"]
        assert all(c.v.shape[slot_axis(KVCache.NAMES[1])] == kw["sliding_window"] for c in cache)


def test_a_stale_cache_entry_is_caught():
    """The decode of ``gqa`` against an oracle whose first prompt has one other token at position 2:
    what decode computes when its cache holds a stale entry there."""
    model = _model(_cfg("tiny"))
    prompts = _prompts(model.cfg.vocab_size)
    ref_tokens, ref_logits = _oracle_rollout(model, prompts, NEW)
    noise = logit_error(*_oracle_rollout(model, prompts, NEW, pad=16), ref_tokens, ref_logits)
    stale = [list(p) for p in prompts]
    stale[0][2] = (stale[0][2] + 1) % model.cfg.vocab_size
    out = Generator(model).generate(stale, max_new_tokens=NEW, return_logits=True)
    err = logit_error(out.tokens, out.logits, ref_tokens, ref_logits)
    factor = err / logit_bound(noise)
    record(
        "generation",
        "mutation: gqa: a stale cache entry",
        noise=dict(logit=noise),
        tolerance=dict(logit=logit_bound(noise)),
        error=dict(logit=err),
        factor=factor,
    )
    assert factor >= MUTATION_GAP, (err, noise)


# ------------------------------------------------------------------------------------ decode layouts
LAYOUTS = [  # (model, mesh, devices): every one must give the one-device tokens, its cache unreplicated
    ("tiny", "tensor=2", 2),
    ("tiny", "tensor=4", 4),
    ("tiny", "decode_tp", 8),
    ("tiny", "data=2,tensor=4", 8),
    ("tiny", "prefill_cp", 8),
    ("tiny-moe", "decode_ep", 4),
    ("tiny-moe", "data=2,expert=4", 8),
    ("tiny-deepseek", "decode_tp", 8),
]
BATCH = 8


@pytest.fixture(scope="module")
def single_device_runs():
    """The one-device reference per model (model, prompts, output, its noise), computed once. The noise:
    the same decode with a cache of the next size (a longer max_new_tokens, compared on the first NEW)."""
    runs = {}
    for name in sorted({m for m, _, _ in LAYOUTS}):
        model = _model(_cfg(name))
        prompts = _prompts(model.cfg.vocab_size, lengths=(11, 5, 8, 3, 14, 7, 9, 2))
        gen = Generator(model)
        out = gen.generate(prompts, max_new_tokens=NEW, return_logits=True)
        longer = gen.generate(prompts, max_new_tokens=NEW + 16, return_logits=True)
        assert bucket(14 + NEW + 16) > bucket(14 + NEW)
        noise = logit_error([t[:NEW] for t in longer.tokens], [l[:NEW] for l in longer.logits], out.tokens, out.logits)
        runs[name] = model, prompts, out, noise
    return runs


def _cache_bytes(gen, prompts):
    """(total bytes, bytes on each device) of the cache the compiled prefill writes."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    prompt, slots = bucket(int(lengths.max())), bucket(int(lengths.max()) + NEW)
    prefill, _ = gen.programs(len(prompts), prompt, slots)
    ids = np.zeros((len(prompts), prompt), np.int32)
    from jaxpar.inference.sampling import SamplingParams

    _, _, cache = prefill(gen.state, ids, lengths, SamplingParams.greedy(len(prompts)))
    leaves = jax.tree.leaves(cache)
    per_device = {}
    for leaf in leaves:
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return sum(x.nbytes for x in leaves), per_device, slots


@pytest.mark.parametrize("name,mesh,devices", LAYOUTS, ids=[f"{m}-{l}" for m, l, _ in LAYOUTS])
def test_decode_layouts_agree_and_never_replicate_the_cache(single_device_runs, name, mesh, devices):
    model, prompts, ref, noise = single_device_runs[name]
    gen = Generator(model, mesh, devices=jax.devices()[:devices])
    out = gen.generate(prompts, max_new_tokens=NEW, return_logits=True)
    margin_check(f"{name}@{mesh}", out.tokens, out.logits, ref.tokens, ref.logits, logit_bound(noise), noise)
    total, per_device, slots = _cache_bytes(gen, prompts)
    cfg = gen.cfg
    if cfg.uses_mla:  # (kv_lora + rope) per token and layer
        per_token = cfg.num_layers * (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * 4
    else:  # 2 · L · K · H · bytes
        per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert total == per_token * BATCH * slots
    assert sorted(set(per_device.values())) == [total // devices], per_device  # split, not replicated
    if mesh == "prefill_cp":  # the slot-split cache is read where it lies: partial softmaxes combined
        decode_hlo = gen.programs(BATCH, bucket(14), slots)[1].as_text()
        assert "all-reduce" in decode_hlo and "all-gather" not in decode_hlo


def test_data_parallel_decode_step_has_no_collective():
    """decode_dp: each device holds the whole model and its own rows' cache, so its compiled decode steps,
    greedy and sampling, hold no collective. The cache write (a scatter per row) and the samplers' sort
    stay on each device's rows, and whether any row draws is decided on the host (no all-reduce of an
    "is every row greedy?" flag)."""
    from jaxpar.analysis.hlo import analyze_compiled

    gen = Generator(_model(_cfg("tiny")), "decode_dp")
    for draws in (False, True):
        _, decode = gen.programs(BATCH, 16, 32, draws)
        assert not analyze_compiled(decode, mesh=gen.mesh).ops


def test_partial_softmax_decode_equals_dense_attention_forward_and_gradient():
    """The decode kernel over a cache split 8 ways along its slots (shard_map, pmax/psum combine)
    against plain softmax attention over the valid slots, written here from scratch."""
    from jaxpar.mesh import build_mesh
    from jaxpar.rules import trace_layout

    b, s, k, g, h = 2, 32, 2, 4, 8
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (b, 1, k * g, h))
    kn, vn = (jax.random.normal(x, (b, 1, k, h)) for x in keys[1:3])
    ck, cv = (jax.random.normal(x, (b, s, k, h)) for x in keys[3:5])
    pos = jnp.array([[13], [29]], jnp.int32)
    mesh = build_mesh("sequence=8")
    rules = compose_rules("t", {"sequence"}, phase=Phase.DECODE)

    def kernel(q, ck, cv):  # the cache as this test holds it, [B, S, K, H] (the model keeps its own layouts)
        with trace_layout(mesh, rules):
            out, cache = gqa_decode(q, kn, vn, KVCache(keys_layout(ck), values_layout(cv)), pos, window=None)
        return out, KVCache(jnp.einsum("bkhs->bskh", cache.k), jnp.einsum("bksh->bskh", cache.v))

    def dense(q, ck, cv):
        rows = jnp.arange(b)
        ck, cv = ck.at[rows, pos[:, 0]].set(kn[:, 0]), cv.at[rows, pos[:, 0]].set(vn[:, 0])
        kk, vv = jnp.repeat(ck, g, axis=2), jnp.repeat(cv, g, axis=2)  # [B, S, N, H]
        scores = jnp.einsum("bnh,bsnh->bns", q[:, 0], kk) / np.sqrt(h)
        scores = jnp.where(jnp.arange(s)[None, None] <= pos[:, :, None], scores, -1e30)
        return jnp.einsum("bns,bsnh->bnh", jax.nn.softmax(scores, -1), vv)[:, None], KVCache(ck, cv)

    out, cache = jax.jit(kernel)(q, ck, cv)
    want, want_cache = dense(q, ck, cv)
    np.testing.assert_allclose(out, want, atol=1e-5)
    np.testing.assert_array_equal(cache.k, want_cache.k)
    w = jax.random.normal(jax.random.key(9), out.shape)
    loss = lambda f: lambda *a: jnp.sum(f(*a)[0] * w)
    got = jax.jit(jax.grad(loss(kernel), argnums=(0, 1, 2)))(q, ck, cv)
    ref = jax.grad(loss(dense), argnums=(0, 1, 2))(q, ck, cv)
    for a, r in zip(got, ref):
        np.testing.assert_allclose(a, r, atol=1e-5)


# ---------------------------------------------------------------------------- buckets, stops, reshard
@pytest.fixture(scope="module")
def tiny_gen():
    return Generator(_model(_cfg("tiny")))


def test_new_prompt_lengths_and_sampler_settings_do_not_recompile(tiny_gen):
    """Within a shape bucket, two programs at most: greedy, and sampling (the first request that draws
    compiles it). New prompt lengths and new sampling settings compile nothing."""
    from jaxpar.inference.sampling import SamplingParams

    tiny_gen.generate(_prompts(256, (5, 9)), max_new_tokens=4)
    greedy = dict(tiny_gen._compiled)
    drawing = lambda **kw: SamplingParams.make(2, **kw)
    tiny_gen.generate(_prompts(256, (7, 2), seed=2), max_new_tokens=4, sampling=drawing(temperature=1.0))
    programs = dict(tiny_gen._compiled)
    assert len(programs) == len(greedy) + 1
    out = tiny_gen.generate(
        _prompts(256, (12, 3), seed=1),
        max_new_tokens=4,
        sampling=drawing(temperature=[0.0, 0.7], top_p=0.9, seed=[1, 2]),
    )
    assert tiny_gen._compiled == programs and out.compile_s < 0.01
    out = tiny_gen.generate(_prompts(256, (4, 11), seed=3), max_new_tokens=4)
    assert tiny_gen._compiled == programs and out.compile_s < 0.01


def test_stops_on_eos_stop_ids_and_max_tokens(tiny_gen):
    prompts = _prompts(256, (6, 6, 6), seed=3)
    free = tiny_gen.generate(prompts, max_new_tokens=6).tokens
    eos = free[0][2]
    gen = Generator(tiny_gen.model, eos_ids=[eos])
    out = gen.generate(prompts, max_new_tokens=[6, 6, 2], stop_ids=[[], [free[1][3]], []])
    assert out.tokens[0] == free[0][:3] and out.finish_reasons[0] == "eos"
    cut = free[1].index(free[1][3]) + 1
    assert out.tokens[1] == free[1][:cut] and out.finish_reasons[1] in ("stop", "eos")
    assert out.tokens[2] == free[2][:2] and out.finish_reasons[2] in ("length", "eos")


def test_training_layout_to_decode_layout_is_one_reshard(monkeypatch):
    from jaxpar.shardings import default_layout

    cfg = _cfg("tiny")
    model = layouts.reshard(build_model(cfg, rngs=nnx.Rngs(0)), default_layout(cfg, "fsdp"))
    assert model.blocks.attn.q[...].sharding.spec[1] == "fsdp"  # FSDP training layout
    calls = []
    real = jax.device_put
    monkeypatch.setattr(layouts.jax, "device_put", lambda *a, **k: calls.append(1) or real(*a, **k))
    gen = Generator(model, "decode_tp")
    assert len(calls) == 1
    assert tuple(gen.model.blocks[0].attn.q[...].sharding.spec)[:2] == (None, "tensor")  # heads over tensor
    assert gen.model.embed.embedding[...].sharding.spec[0] == "tensor"
    specs = [tuple(x.sharding.spec) for x in jax.tree.leaves(nnx.state(gen.model))]
    assert not any("fsdp" in s for s in specs)  # nothing on fsdp


@pytest.mark.parametrize(
    "prompts,new,match",
    [
        ([[]], 4, "prompt 0: empty"),
        ([[1, 256]], 4, "token id 256 is outside the vocabulary"),
        ([[1, 2, 3]], 1022, "exceeds model.max_seq_len=1024"),
        ([[1, 2, 3]], 0, "max_new_tokens"),
    ],
)
def test_bad_requests_are_refused_before_anything_runs(tiny_gen, prompts, new, match):
    compiled = dict(tiny_gen._compiled)
    with pytest.raises(ConfigError, match=match):
        tiny_gen.generate(prompts, max_new_tokens=new)
    assert tiny_gen._compiled == compiled


def test_per_prompt_settings_must_match_the_prompts(tiny_gen):
    from jaxpar.inference.sampling import SamplingParams

    with pytest.raises(ConfigError, match="stop_ids: 1 lists for 2 prompts"):
        tiny_gen.generate([[1], [2]], max_new_tokens=2, stop_ids=[[3]])
    with pytest.raises(ConfigError, match="made for a batch of 3, given 2"):
        tiny_gen.generate([[1], [2]], max_new_tokens=2, sampling=SamplingParams.make(3))
    with pytest.raises(ConfigError, match="max_new_tokens: 3 values for 2 prompts"):
        tiny_gen.generate([[1], [2]], max_new_tokens=[2, 2, 2])


def test_a_decode_layout_that_cannot_divide_is_refused(tiny_gen):
    gen = Generator(tiny_gen.model, "data=8")
    with pytest.raises(LayoutError, match=r"batch \(prompts\)=3 .*data=8"):
        gen.generate(_prompts(256), max_new_tokens=2)
    with pytest.raises(LayoutError, match="stage=2"):
        Generator(tiny_gen.model, "stage=2,tensor=4")
