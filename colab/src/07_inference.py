# %% [markdown]
# # 07 · Inference: the KV cache, prefill against decode, and decode layouts
#
# Generation runs in two phases. **Prefill** reads the whole prompt at once: big matrix products, like
# training's forward pass. **Decode** then produces one token per step per sequence: every step reads
# all the weights and the whole KV cache to do a few FLOPs per byte. This notebook measures the cache
# from jaxpar's own cache objects, the two phases' arithmetic intensity from their compiled programs,
# and what a tensor-parallel and a data-parallel decode layout hold and send; then it trains a tiny model
# and generates from it.

# %%
from jaxpar.mesh import simulate_cpu_devices

simulate_cpu_devices(8)
import dataclasses

import jax
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx

from jaxpar.models import build_model, get_model_preset

print(jax.device_count(), "devices")

# %% [markdown]
# ## KV bytes per token
#
# Each layer caches a key and a value vector per kv head for every position: 2·L·K·H·b bytes per token
# (L layers, K kv heads, H head width, b bytes per number). Grouped-query attention shares each kv head
# among several query heads, so K is small; DeepSeek-V3's multi-head latent attention (MLA) caches one
# compressed latent (plus a small rope key) per layer instead. Below: the bytes of jaxpar's own cache for
# 4,096 positions (built with `jax.eval_shape`: nothing is allocated), divided by 4,096, in bf16.

# %%
S = 4096
kv_bytes, formula = {}, {}
for name in ("llama3-8b", "mistral-7b", "qwen3-8b", "llama3-70b", "mixtral-8x7b", "deepseek-v3"):
    cfg = dataclasses.replace(get_model_preset(name), dtype="bfloat16", param_dtype="bfloat16")
    model = nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0)))
    cache = jax.eval_shape(lambda: model.empty_cache(1, S))
    kv_bytes[name] = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache)) / S
    if cfg.uses_mla:
        formula[name] = (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * cfg.num_layers * 2
    else:
        formula[name] = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    print(f"{name:13s} {kv_bytes[name] / 1024:7.1f} KiB per token   formula {formula[name] / 1024:7.1f} KiB")

plt.figure(figsize=(7, 3))
plt.bar(kv_bytes.keys(), [v / 1024 for v in kv_bytes.values()])
plt.ylabel("KiB per token (bf16)"); plt.title("KV cache per token, read from jaxpar's cache")
plt.xticks(rotation=20); plt.tight_layout(); plt.show()

# %% [markdown]
# ### Checking a claim: "every extra 65k tokens at 70B costs ~2 GB per GPU even with GQA"
#
# Llama-3-70B has 8 kv heads of width 128 over 80 layers. Under the `decode_tp` layout on 8 devices
# each device keeps one kv head; we ask the layout what one device's shard of a 65,536-position cache
# is (shapes only).

# %%
from jaxpar.inference.layouts import build_inference_mesh, check_inference_layout

cfg70 = dataclasses.replace(get_model_preset("llama3-70b"), dtype="bfloat16", param_dtype="bfloat16")
m70 = nnx.eval_shape(lambda: build_model(cfg70, rngs=nnx.Rngs(0)))
_, mesh = build_inference_mesh("decode_tp")
layout = check_inference_layout(cfg70, mesh, "decode_tp", batch=1, prompt=16, slots=65536)
cache70 = jax.eval_shape(lambda: m70.empty_cache(1, 65536))
per_device_65k = 0
for c in cache70.values():
    for x in jax.tree.leaves(c):
        shard = layout.sharding((None,) + c.NAMES).shard_shape(x.shape)
        per_device_65k += int(np.prod(shard)) * x.dtype.itemsize
total_65k = kv_bytes["llama3-70b"] * 65536
print(f"65,536 tokens of Llama-3-70B: {total_65k / 1e9:.2f} GB in all, {per_device_65k / 1e9:.2f} GB per device "
      f"under decode_tp on 8 devices")

# %% [markdown]
# The claim holds in round numbers at tensor parallelism 8: 2.7 GB (2.5 GiB) per GPU per sequence. On
# fewer GPUs each holds more (5.4 GB at 4), and a batch multiplies it: 32 sequences of 65k tokens need
# 86 GB per GPU even at 8-way. Without GQA (64 kv heads) it would be 8× more.
#
# ## Prefill against decode: compute-bound against bandwidth-bound
#
# A chip reaches its peak FLOPs only when a program does more FLOPs per byte it reads than
# peak / bandwidth, the "ridge point" (about 295 for an H100 in bf16). One forward step of Llama-3-8B
# over n tokens does about 2·P·n FLOPs (P parameters) and reads the weights once (2·P bytes in bf16)
# plus the cache it attends over. A prompt of 512 tokens reuses each weight 512 times; a decode step
# uses each weight once per sequence in the batch and reads every sequence's whole cache. P comes from
# the abstract model and the cache bytes per token from the measurement above. (XLA's cost analysis
# cannot give these numbers for jaxpar's models: it counts the scanned layer body once.)

# %%
from jaxpar.analysis.hardware import HARDWARE
from jaxpar.inference.generate import Generator
from jaxpar.shardings import param_shardings, default_layout

cfg8 = dataclasses.replace(get_model_preset("llama3-8b"), dtype="bfloat16", param_dtype="bfloat16")
P8 = param_shardings(cfg8, default_layout(cfg8, "dp")).num_params
kv8, context = kv_bytes["llama3-8b"], 4096
h100 = HARDWARE["h100"]
ridge = h100.peak_bf16_flops / h100.hbm_bandwidth
batches = [1, 2, 4, 8, 16, 32, 64, 128, 256]
prefill_intensity = [2 * P8 * b * 512 / (2 * P8 + b * 512 * kv8) for b in batches]
decode_intensity = [2 * P8 * b / (2 * P8 + b * context * kv8) for b in batches]
print(f"Llama-3-8B, {P8 / 1e9:.2f} B parameters; H100 ridge point {ridge:.0f} FLOPs/byte")
for b, pi, di in zip(batches, prefill_intensity, decode_intensity):
    print(f"batch {b:3d}: prefill (512 tokens) {pi:8.0f}   decode (context {context}) {di:6.2f} FLOPs/byte")

plt.figure(figsize=(6, 3))
plt.loglog(batches, prefill_intensity, "o-", label="prefill, 512-token prompts")
plt.loglog(batches, decode_intensity, "o-", label=f"decode, {context}-token context")
plt.axhline(ridge, color="r", ls="--", label="H100 ridge point")
plt.xlabel("sequences per step"); plt.ylabel("FLOPs per byte read"); plt.legend(); plt.tight_layout(); plt.show()

# %% [markdown]
# Measured on this CPU with the tiny model (one device, 8 prompts of 100 tokens): prefill handles many
# more tokens per second than decode, for the same reason.

# %%
tiny = build_model(get_model_preset("tiny"), rngs=nnx.Rngs(0))
one = Generator(tiny)                                      # one device
prompts = [list(np.random.default_rng(i).integers(0, 256, 100)) for i in range(8)]
one.generate(prompts, max_new_tokens=64)                   # compiles
timing = one.generate(prompts, max_new_tokens=64)
prefill_tok_s = 8 * 100 / timing.prefill_s
print(f"batch 8: prefill {prefill_tok_s:,.0f} tokens/s, decode {timing.decode_tokens_per_s:,.0f} tokens/s")

# %% [markdown]
# Prefill is past the ridge from one prompt on: compute-bound. Decode's intensity grows with the batch
# (the weights are read once for all its sequences) but the caches grow with it, so at a 4k context it
# levels off near 2·P / (context · KV bytes per token) ≈ 30 FLOPs/byte, a tenth of the ridge: decode
# is bandwidth-bound, and batching is what pays for the weight reads.
#
# ## Tensor parallelism for latency, data parallelism for throughput
#
# Under `decode_tp` the 8 devices split every weight matrix and the cache's kv heads: each holds an 8th
# of the model, and its layers exchange activations. Under `decode_dp` every device holds the whole
# model and its own sequences. Read from the compiled decode step (batch 8), per device:

# %%
from jaxpar.analysis.hlo import analyze_compiled

layouts = {}
for name in ("decode_tp", "decode_dp"):
    gen = Generator(tiny, name)
    _, dec = gen.programs(8, 16, 64)
    report = analyze_compiled(dec, mesh=gen.mesh)
    weights = sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
                  for x in jax.tree.leaves(gen.state))
    sent = {}
    for c in report.ops:
        sent[c.kind] = sent.get(c.kind, 0) + c.bytes * c.executions
    layouts[name] = {"weight_bytes_per_device": weights, "collective_bytes": sent}
    print(f"{name}: {weights:,} weight bytes per device; collective bytes per decode step {sent}")

# %% [markdown]
# TP cuts the weights each device reads per step (lower latency per token when bandwidth-bound) and
# pays with collectives in every layer; DP keeps the weights whole and its step sends a single byte
# (the all-reduce of "is every row greedy?", which lets an all-greedy batch skip the samplers' sort),
# and it serves 8 times the sequences per step. The tiny model's
# shapes here are only for reading the programs; `jaxpar plan` prices these choices for real models.
#
# ## Generate from a model trained a minute ago
#
# Train the tiny model for 60 steps on the embedded Markov source (every token has 8 possible
# successors), then generate greedily. The first generated token must equal the argmax of the
# training forward pass on the prompt.

# %%
import pathlib
import tempfile

from jaxpar.convert.store import load_model
from jaxpar.shardings import default_layout
from jaxpar.train.config import apply_overrides, default_config
from jaxpar.train.loop import train

run = pathlib.Path(tempfile.mkdtemp()) / "tiny"
cfg = apply_overrides(default_config("tiny", mesh="3d", steps=60, batch=16, seq=64), [
    "optimizer.learning_rate=1e-2", "optimizer.warmup_steps=10", "log.progress=false", "log.tensorboard=false"])
result = train(cfg, run)
print(f"train loss {result.losses[60]:.3f} (entropy rate of the source {result.entropy_rate:.3f})")
trained, _ = load_model(run, default_layout(cfg.model, "dp"))
prompt = [int(t) for t in np.random.default_rng(5).integers(0, 256, 12)]
out = Generator(trained).generate([prompt], max_new_tokens=16)
forward_argmax = int(np.argmax(np.asarray(trained(np.asarray([prompt], np.int32)))[0, -1]))
print("prompt   ", prompt)
print("generated", out.tokens[0])
print("first generated token == argmax of the forward pass:", out.tokens[0][0] == forward_argmax)

# %%
key_numbers = {"kv_bytes_per_token": kv_bytes, "kv_formula": formula, "per_device_65k_70b": per_device_65k,
               "total_65k_70b": total_65k, "params_8b": P8, "prefill_intensity": prefill_intensity,
               "decode_intensity": decode_intensity, "batches": batches, "ridge_h100": ridge, "layouts": layouts,
               "prefill_tok_s": prefill_tok_s, "decode_tok_s": timing.decode_tokens_per_s,
               "final_loss": result.losses[60], "entropy_rate": result.entropy_rate,
               "first_token_matches_forward": out.tokens[0][0] == forward_argmax}
key_numbers
