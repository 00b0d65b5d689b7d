"""The decoders ``benchmarks/generate.py --peers`` measures beside ``jaxpar generate`` (issue 33), on one
checkpoint: the paged engine's decode, a plain-JAX decoder written here, and transformers' ``generate``.

Legend: B batch, T tokens of a call, S cache slots, D width, N query heads, K kv heads, G = N / K, H head
width, F MLP width, V vocabulary.

The plain-JAX decoder is what one writes by hand for a Llama at the memory roofline, gpt-fast style, and
shares no code with jaxpar: each layer's weights are arrays of their own, the layers run unrolled, one
program serves prompt and decode (T tokens at one start position, the same for every row: the benchmark's
prompts have one length), and the cache, [B, K, S, H] per layer, is written by ``dynamic_update_slice`` at
the start position and donated. Greedy. transformers runs the same weights, exported by ``jaxpar.convert``,
in float32 eager torch on the CPU; its decode rate counts the n − 1 decode steps of one ``generate``, timed
from the first step's logits to the last's, at ``torch.get_num_threads()`` threads.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


# ------------------------------------------------------------------------------------- plain JAX
def plain_weights(model) -> dict:
    """A stacked jaxpar Llama's weights as plain arrays: {"layers": [per-layer dict], ...}, each layer's
    arrays copied out of the stacks once."""
    pure = nnx.to_pure_dict(nnx.state(model))
    blocks, n = pure["blocks"], model.cfg.num_layers
    layer = lambda i: {
        "q": blocks["attn"]["q"][i],
        "k": blocks["attn"]["k"][i],
        "v": blocks["attn"]["v"][i],
        "o": blocks["attn"]["o"][i],
        "attn_norm": blocks["attn_norm"]["scale"][i],
        "gate_up": blocks["mlp"]["gate_up"][i],
        "down": blocks["mlp"]["down"][i],
        "mlp_norm": blocks["mlp_norm"]["scale"][i],
    }
    layers = [jax.tree.map(jnp.copy, layer(i)) for i in range(n)]
    return {
        "embed": pure["embed"]["embedding"],
        "final_norm": pure["final_norm"]["scale"],
        "lm_head": pure["lm_head"] if "lm_head" in pure else pure["embed"]["embedding"].T,  # tied: the table
        "layers": layers,
    }


def _rms(x, scale, eps):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps) * scale).astype(x.dtype)


def _rotate(x, pos, theta):
    """x [B, T, heads, H] at positions pos [T] (half-split rotation pairs)."""
    half = x.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    ang = pos.astype(jnp.float32)[:, None, None] * freq  # [T, 1, H/2]
    a, b = x[..., :half], x[..., half:]
    out = jnp.concatenate([a * jnp.cos(ang) - b * jnp.sin(ang), b * jnp.cos(ang) + a * jnp.sin(ang)], -1)
    return out.astype(x.dtype)


def _layer(x, w, ck, cv, start, cfg):
    """One Llama block over x [B, T, D] at positions start + [0, T); ck/cv [B, K, S, H]."""
    b, t, _ = x.shape
    k_heads, h = w["k"].shape[1], w["k"].shape[2]
    pos = start + jnp.arange(t)
    y = _rms(x, w["attn_norm"], cfg.norm_eps)
    q = _rotate(jnp.einsum("btd,dnh->btnh", y, w["q"]), pos, cfg.rope_theta)
    k = _rotate(jnp.einsum("btd,dkh->btkh", y, w["k"]), pos, cfg.rope_theta)
    v = jnp.einsum("btd,dkh->btkh", y, w["v"])
    ck = jax.lax.dynamic_update_slice(ck, jnp.einsum("btkh->bkth", k), (0, 0, start, 0))
    cv = jax.lax.dynamic_update_slice(cv, jnp.einsum("btkh->bkth", v), (0, 0, start, 0))
    q = q.reshape(b, t, k_heads, -1, h)
    s = jnp.einsum("btkgh,bksh->bkgts", q, ck) * h**-0.5
    seen = jnp.arange(ck.shape[2])[None, :] <= pos[:, None]  # [T, S]
    p = jax.nn.softmax(jnp.where(seen, s, -jnp.inf), axis=-1)
    out = jnp.einsum("bkgts,bksh->btkgh", p, cv).reshape(b, t, -1)
    x = x + out @ w["o"].reshape(-1, x.shape[-1])
    y = _rms(x, w["mlp_norm"], cfg.norm_eps)
    gu = jnp.einsum("btd,dgf->btgf", y, w["gate_up"])
    return x + (jax.nn.silu(gu[..., 0, :]) * gu[..., 1, :]) @ w["down"], ck, cv


def plain_forward(weights, caches, tokens, start, cfg):
    """tokens [B, T] at start -> (the greedy next token [B] after the last, the updated caches)."""
    x = weights["embed"][tokens]
    out = []
    for w, (ck, cv) in zip(weights["layers"], caches):
        x, ck, cv = _layer(x, w, ck, cv, start, cfg)
        out.append((ck, cv))
    logits = _rms(x[:, -1], weights["final_norm"], cfg.norm_eps) @ weights["lm_head"]
    return jnp.argmax(logits[:, : cfg.vocab_size], axis=-1).astype(jnp.int32), out


def plain_generate(weights, cfg, prompts: np.ndarray, new: int, slots: int, dtype=jnp.float32):
    """Greedy tokens [B, new] and the decode steps' seconds (each with the host fetch of its tokens); the
    cache holds ``dtype``."""
    b = prompts.shape[0]
    shape = (b, cfg.num_kv_heads, slots, cfg.head_dim)
    caches = [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers)]
    step = jax.jit(plain_forward, static_argnums=4, donate_argnums=1)
    token, caches = step(weights, caches, jnp.asarray(prompts), jnp.int32(0), cfg)
    tokens, times = [np.asarray(token)], []
    for i in range(new - 1):
        t0 = time.perf_counter()
        token, caches = step(weights, caches, token[:, None], jnp.int32(prompts.shape[1] + i), cfg)
        tokens.append(np.asarray(token))
        times.append(time.perf_counter() - t0)
    return np.stack(tokens, 1), times


# ---------------------------------------------------------------------------------- transformers
def hf_model(model):
    """transformers' model of ``model``'s weights (exported by ``jaxpar.convert.to_hf``), float32, eval."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxpar.convert import to_hf

    with tempfile.TemporaryDirectory() as tmp:
        folder = to_hf(model, Path(tmp) / "hf")
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_generate(hf, prompts: np.ndarray, new: int):
    """(greedy tokens [B, new], decode seconds: from the first step's logits to the last's, over the
    new − 1 decode steps; a logits processor stamps the time in every step of ``generate``)."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class Stamp(LogitsProcessor):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    stamp = Stamp()
    with torch.inference_mode():
        out = hf.generate(
            torch.as_tensor(prompts),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([stamp]),
        )
    return out[:, prompts.shape[1] :].numpy(), stamp.times[-1] - stamp.times[0]


# ----------------------------------------------------------------------------------- the engine
def engine_decode(engine, prompts: np.ndarray, new: int):
    """Greedy tokens [B, new] from the paged engine and its decode rate over its pure decode steps."""
    from jaxpar.inference.scheduler import Request

    start = len(engine.log)
    done = engine.run([Request(i, list(map(int, p)), new) for i, p in enumerate(prompts)])
    steps = list(engine.log)[start:]
    decode = [s for s in steps if s.prefilled == 0 and s.decoded]
    rate = sum(s.decoded for s in decode) / sum(s.seconds for s in decode)
    tokens = np.array([r.tokens[len(r.prompt) :] for r in sorted(done, key=lambda r: r.id)])
    return tokens, rate


def agreement(a: np.ndarray, b: np.ndarray) -> float:
    """The share of rows whose greedy tokens are identical."""
    return float(np.mean([(x == y).all() for x, y in zip(a, b)]))


def median_rate(rates: list[float]) -> float:
    return round(statistics.median(rates), 2)


# ------------------------------------------------------------------------------------ the comparison
def compare(name: str, batches: list[int], prompt: int, new: int, rounds: int, peak_gb_s: float) -> dict:
    """Every decoder at every batch, ``rounds`` interleaved rounds after one warm-up (compiles) each: decode
    tokens/s per round and their median, greedy-token agreement with ``jaxpar generate``, and the bytes a
    step must read (weights + the whole cache) over the median step time, against ``peak_gb_s``."""
    import torch

    from jaxpar.inference.engine import Engine
    from jaxpar.inference.generate import Generator, bucket
    from jaxpar.models import build_model, get_model_preset

    cfg = get_model_preset(name)
    model = build_model(cfg, rngs=nnx.Rngs(params=0))
    weights, hf = plain_weights(model), hf_model(model)
    gen = Generator(model)
    slots = bucket(prompt + new)
    engines = {b: Engine(model, max_slots=b, max_length=slots, chunk=prompt) for b in batches}
    weight_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    runs = {
        "jaxpar generate": lambda p: _generator(gen, p, new),
        "jaxpar engine": lambda p: engine_decode(engines[len(p)], p, new),
        "plain JAX (unrolled, donated)": lambda p: _plain(weights, cfg, p, new, slots),
        f"transformers generate (torch {torch.__version__}, eager)": lambda p: _hf(hf, p, new),
    }
    out = {"model": name, "batches": {}, "torch_threads": torch.get_num_threads()}
    for b in batches:
        rows = np.random.default_rng(b).integers(0, cfg.vocab_size, (b, prompt))
        tokens = {k: run(rows)[0] for k, run in runs.items()}  # warm-up: compiles
        rates = {k: [] for k in runs}
        for _ in range(rounds):
            for k, run in runs.items():
                rates[k].append(round(run(rows)[1], 2))
        cache_bytes = 2 * cfg.num_layers * b * cfg.num_kv_heads * slots * cfg.head_dim * 4
        step_bytes = weight_bytes + cache_bytes
        out["batches"][b] = {
            k: {
                "decode_tokens_per_s": rates[k],
                "median": median_rate(rates[k]),
                "same_tokens_as_jaxpar": agreement(tokens[k], tokens["jaxpar generate"]),
                "achieved_gb_s": round(step_bytes * median_rate(rates[k]) / b / 1e9, 2),
                "share_of_peak": round(step_bytes * median_rate(rates[k]) / b / 1e9 / peak_gb_s, 3),
            }
            for k in runs
        } | {"bytes_per_step": step_bytes}
    return out


def _generator(gen, rows, new):
    run = gen.generate(rows.tolist(), max_new_tokens=new)
    return np.array(run.tokens), run.decode_tokens_per_s


def _plain(weights, cfg, rows, new, slots):
    tokens, times = plain_generate(weights, cfg, rows, new, slots)
    return tokens, rows.shape[0] * len(times) / sum(times)


def _hf(hf, rows, new):
    tokens, seconds = hf_generate(hf, rows, new)
    return tokens, rows.shape[0] * (new - 1) / seconds
