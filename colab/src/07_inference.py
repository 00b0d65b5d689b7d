# %% [markdown]
# # 07 · Inference: the KV cache, prefill against decode, and decode layouts
#
# Generation runs in two phases. **Prefill** reads the whole prompt at once: big matrix products, like
# the forward pass of training. **Decode** then produces one token per step for each sequence, and every
# step reads all the weights and the whole KV cache to do only a few FLOPs per byte. This notebook
# measures the cache from jaxpar's own cache objects, reads the two phases' FLOPs from their compiled
# programs, and compares them with a chip's ridge point. It then compiles a tensor-parallel and a
# data-parallel decode step and reads what each device holds and sends. Last, it trains a tiny model
# and generates from it.

# %%
from jaxpar.mesh import simulate_cpu_devices

simulate_cpu_devices(8)
import dataclasses

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx

from jaxpar.models import ExecutionConfig, build_model, get_model_preset

print(jax.device_count(), "devices")


def abstract(name, **changes):
    """A model preset in bf16 (its parameters; and computed in bf16: an execution setting), built with
    shapes only (nothing allocated)."""
    cfg = dataclasses.replace(get_model_preset(name), param_dtype="bfloat16", **changes)
    return nnx.eval_shape(lambda: build_model(cfg, execution=ExecutionConfig(dtype="bfloat16"), rngs=nnx.Rngs(0)))


def nbytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


# %% [markdown]
# ## 1. KV bytes per token
#
# For every position, each layer caches a key vector and a value vector per kv head. That makes
# 2·L·K·H·b bytes per token (L layers, K kv heads, H head width, b bytes per number). The number of kv
# heads is what separates the attention variants:
#
# * **MHA** (multi-head attention) has one kv head per query head.
# * **GQA** (grouped-query attention) shares each kv head among a group of query heads.
# * **MQA** (multi-query attention) has a single kv head.
#
# DeepSeek-V3's multi-head latent attention (**MLA**) works differently. It caches one compressed latent
# per layer, plus a small rotary key, and rebuilds the heads from them.
#
# Below, each model's cache is read from jaxpar: `empty_cache(1, S)` under `jax.eval_shape`, so only
# shapes are computed. Its bytes are divided by the S = 4,096 positions it holds, in bf16. Llama-3-70B
# also appears with its 8 kv heads changed to 64 (MHA) and to 1 (MQA); nothing else about it changes.

# %%
S = 4096
models = {
    "llama2-7b": ("llama2-7b", {}),
    "llama3-8b": ("llama3-8b", {}),
    "mistral-7b": ("mistral-7b", {}),
    "qwen3-8b": ("qwen3-8b", {}),
    "mixtral-8x7b": ("mixtral-8x7b", {}),
    "deepseek-v3": ("deepseek-v3", {}),
    "70b MHA (K=64)": ("llama3-70b", dict(num_kv_heads=64)),
    "llama3-70b": ("llama3-70b", {}),
    "70b MQA (K=1)": ("llama3-70b", dict(num_kv_heads=1)),
}
kv_bytes, formula, kind = {}, {}, {}
for label, (name, changes) in models.items():
    model = abstract(name, **changes)
    cfg = model.cfg
    kv_bytes[label] = nbytes(jax.eval_shape(lambda model=model: model.empty_cache(1, S))) / S
    if cfg.uses_mla:
        formula[label] = (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * cfg.num_layers * 2
        kind[label] = "MLA"
    else:
        formula[label] = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
        kind[label] = "MHA" if cfg.num_kv_heads == cfg.num_heads else "MQA" if cfg.num_kv_heads == 1 else "GQA"
    print(
        f"{label:15s} {kind[label]}  L={cfg.num_layers:2d}  {kv_bytes[label] / 1024:7.1f} KiB per token   "
        f"formula {formula[label] / 1024:7.1f} KiB"
    )

colors = {"MHA": "tab:red", "GQA": "tab:blue", "MQA": "tab:green", "MLA": "tab:purple"}
plt.figure(figsize=(8, 3.2))
plt.bar(kv_bytes.keys(), [v / 1024 for v in kv_bytes.values()], color=[colors[kind[k]] for k in kv_bytes])
for k, c in colors.items():
    plt.bar([0], [0], color=c, label=k)
plt.yscale("log")
plt.ylabel("KiB per token (bf16)")
plt.legend(ncol=4, fontsize=8)
plt.title("KV cache per token, read from jaxpar's cache arrays")
plt.xticks(rotation=25, ha="right")
plt.tight_layout()
plt.show()

# %% [markdown]
# The cache arrays match the formula for every model. GQA keeps Llama-3-70B at 320 KiB per token, an
# eighth of the 2.5 MiB that MHA would cost at the same shape. MQA divides it by another 8. DeepSeek-V3,
# with 61 layers, caches only 68.6 KiB per token.
#
# ## 2. Checking a claim: "every extra 65k tokens at 70B costs ~2 GB/GPU even with GQA"
#
# The texts state this as a rough rule without a setting: they give no tensor-parallel degree and no
# dtype. Under `decode_tp`, jaxpar splits the cache's kv heads over the `tensor` axis. So we ask the
# layout for one device's shard of a 65,536-position cache (one sequence) on 1, 2, 4 and 8 devices, in bf16.

# %%
from jaxpar.inference.layouts import build_inference_mesh, check_inference_layout


def cache_per_device(model, mesh, name, batch, slots):
    """Bytes of one device's shard of the cache (batch sequences × slots), placed by the decode layout."""
    layout = check_inference_layout(model.cfg, mesh, name, batch=batch, prompt=16, slots=slots)
    total = 0
    for layers in jax.eval_shape(lambda: model.empty_cache(batch, slots)).values():
        for c in layers:  # one cache per layer
            for x, names in zip(jax.tree.leaves(c), c.NAMES):  # each array with its logical axis names
                total += int(np.prod(layout.sharding(names).shard_shape(x.shape))) * x.dtype.itemsize
    return total


T65 = 65536
m70 = abstract("llama3-70b")
total_65k = kv_bytes["llama3-70b"] * T65
per_device_65k = {}
for t in (1, 2, 4, 8):
    _, mesh = build_inference_mesh(f"tensor={t}", devices=jax.devices()[:t])
    per_device_65k[t] = cache_per_device(m70, mesh, "decode_tp", 1, T65)
    print(f"tensor={t}: {per_device_65k[t] / 1e9:5.2f} GB per GPU ({per_device_65k[t] / 2**30:5.2f} GiB)")
batch32_tp8 = cache_per_device(m70, mesh, "decode_tp", 32, T65)
mha_tp8 = cache_per_device(abstract("llama3-70b", num_kv_heads=64), mesh, "decode_tp", 1, T65)
print(
    f"all devices together: {total_65k / 1e9:.2f} GB. At tensor=8: a batch of 32 such sequences "
    f"{batch32_tp8 / 1e9:.1f} GB per GPU; one sequence at MHA (64 kv heads) {mha_tp8 / 1e9:.1f} GB per GPU"
)

# %% [markdown]
# The claim holds at 8-way tensor parallelism in bf16, the usual way to serve a 70B model on one
# 8-GPU node: 2.7 GB (2.5 GiB) per GPU for each sequence. That is "~2 GB" rounded down by a third. On
# fewer GPUs each one holds more (5.4 GB at 4, 10.7 GB at 2). An 8-bit cache would halve every number,
# so the claim also fits 4 GPUs with an fp8 cache. Two things make it "add up fast":
# * The cost is per sequence. A batch of 32 such sequences needs 86 GB per GPU even at 8-way.
# * Without GQA, at 64 kv heads, one sequence would take 21.5 GB per GPU.
#
# ## 3. Prefill against decode: compute-bound against bandwidth-bound
#
# A chip reaches its peak FLOP/s only on programs that do more FLOPs per byte they move than
# peak ÷ bandwidth. That ratio is the **ridge point**. `jaxpar.analysis.hardware` has the datasheet
# numbers: for an H100 in bf16 it is 989 TFLOP/s ÷ 3.35 TB/s ≈ 295 FLOPs per byte.
#
# We compile Llama-3-8B's real prefill and decode programs (`model.prefill`, `model.decode`: the code
# `Generator` runs) from shapes alone, and read their FLOPs from XLA's `cost_analysis`. We do it for
# prompts of 512 tokens and for decode over a 4,096-slot cache, at several batch sizes.
#
# Generation runs the layers unrolled, one block per layer with arrays of its own
# (`jaxpar.inference.unstack`), so the 32-layer program's `cost_analysis` counts every layer. Compiling
# that program for every batch size takes a while, so we compile two exact, small programs instead:
# * the whole model with one layer (embedding, one layer, LM head);
# * one layer's cached step alone.
#
# The 32-layer count is the first plus 31 times the second; the full 32-layer decode program, compiled
# once, checks the sum. We compile in float32, because XLA:CPU upcasts bf16 matmuls, and those converts
# would show up as extra FLOPs and bytes.

# %%
from jaxpar.analysis.hardware import HARDWARE
from jaxpar.inference.layouts import generation_execution
from jaxpar.inference.unstack import unstack
from jaxpar.layers.kvcache import DECODE, PREFILL, Step

cfg8, gen8 = get_model_preset("llama3-8b"), generation_execution()  # run as generation runs: float32; no remat
PROMPT, CONTEXT = 512, 4096


def cost(fn, *args):
    c = jax.jit(fn).lower(*args).compile().cost_analysis()
    return np.array([c["flops"], c["bytes accessed"]])


def phase_costs(cfg, batch, tokens, slots, prefill):
    """[FLOPs, XLA bytes accessed] of one prefill (or decode) call over all cfg.num_layers layers."""
    one = unstack(
        nnx.eval_shape(lambda: build_model(dataclasses.replace(cfg, num_layers=1), execution=gen8, rngs=nnx.Rngs(0)))
    )
    graph, state = nnx.split(one)
    layer_graph, layer_state = nnx.split(one.blocks[0])
    cache = jax.eval_shape(lambda: one.empty_cache(batch, slots))
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    x = jax.ShapeDtypeStruct((batch, tokens, cfg.embed_dim), jnp.float32)
    lengths = i32(batch)
    if prefill:
        whole = cost(
            lambda s, ids, n, c: nnx.merge(graph, s).prefill(ids, n, c), state, i32(batch, tokens), lengths, cache
        )
        layer = cost(
            lambda s, x, p, c, n: nnx.merge(layer_graph, s)(x, p, p, c, Step(PREFILL, n)),
            layer_state,
            x,
            i32(batch, tokens),
            cache["blocks"][0],
            lengths,
        )
    else:
        whole = cost(
            lambda s, ids, p, c: nnx.merge(graph, s).decode(ids, p, c), state, i32(batch, 1), i32(batch, 1), cache
        )
        layer = cost(
            lambda s, x, p, c: nnx.merge(layer_graph, s)(x, p, p, c, Step(DECODE)),
            layer_state,
            x,
            i32(batch, 1),
            cache["blocks"][0],
        )
    return whole + (cfg.num_layers - 1) * layer


# the whole 32-layer decode program, batch 1, unrolled as generation runs it
full = unstack(nnx.eval_shape(lambda: build_model(cfg8, execution=gen8, rngs=nnx.Rngs(0))))
g, s = nnx.split(full)
i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
whole_program = cost(
    lambda s, ids, p, c: nnx.merge(g, s).decode(ids, p, c),
    s,
    i32(1, 1),
    i32(1, 1),
    jax.eval_shape(lambda: full.empty_cache(1, CONTEXT)),
)[0]
batches = [1, 16, 256]
compiled = {"prefill": {}, "decode": {}}
for b in batches:
    compiled["prefill"][b] = phase_costs(cfg8, b, PROMPT, CONTEXT, True)
    compiled["decode"][b] = phase_costs(cfg8, b, 1, CONTEXT, False)
print(
    f"the 32-layer decode program reports {whole_program:.3g} FLOPs; "
    f"composed from exact programs: {compiled['decode'][1][0]:.3g}"
)

# %% [markdown]
# What must a step move, at the least? It reads every weight once and every cached key and value it
# attends over once, and prefill also writes its prompts' keys and values. In bf16 that is 2 bytes per
# parameter plus the KV bytes per token measured in section 1. The parameter count comes from the
# abstract model. The compiled FLOPs divided by these bytes is the intensity a fused GPU or TPU program
# approaches.
#
# XLA:CPU's own `bytes accessed` counts something else: every operation's inputs and outputs, in
# float32. Here each op is a separate pass over memory, and attention writes its full score matrix.
# The table shows both intensities.

# %%
from jaxpar.shardings import default_layout, param_shardings

P8 = param_shardings(cfg8, default_layout(cfg8, "dp")).num_params
kv8 = kv_bytes["llama3-8b"]
h100 = HARDWARE["h100"]
ridge = h100.peak_bf16_flops / h100.hbm_bandwidth
moved = {
    "prefill": {b: 2 * P8 + b * PROMPT * kv8 for b in batches},
    "decode": {b: 2 * P8 + b * CONTEXT * kv8 for b in batches},
}
intensity = {ph: {b: compiled[ph][b][0] / moved[ph][b] for b in batches} for ph in moved}
xla_intensity = {ph: {b: compiled[ph][b][0] / compiled[ph][b][1] for b in batches} for ph in moved}
print(f"Llama-3-8B: {P8 / 1e9:.2f} B parameters; H100 ridge point {ridge:.0f} FLOPs/byte (bf16)")
print("phase    batch   compiled FLOPs   FLOPs/token   bytes moved (bf16)   FLOPs/byte   (XLA:CPU count, f32)")
for ph, per in (("prefill", PROMPT), ("decode", 1)):
    for b in batches:
        f = compiled[ph][b][0]
        print(
            f"{ph:8s} {b:5d} {f:16.3e} {f / (b * per):13.3e} {moved[ph][b]:18.3e} {intensity[ph][b]:12.1f}"
            f" {xla_intensity[ph][b]:14.1f}"
        )

plt.figure(figsize=(6.5, 3.4))
for ph, c in (("prefill", "tab:orange"), ("decode", "tab:blue")):
    label = f"prefill, {PROMPT}-token prompts" if ph == "prefill" else f"decode, {CONTEXT}-slot cache"
    plt.loglog(batches, [intensity[ph][b] for b in batches], "o-", color=c, label=label)
    plt.loglog(
        batches, [xla_intensity[ph][b] for b in batches], "x--", color=c, alpha=0.6, label=f"{ph}, XLA:CPU's byte count"
    )
plt.axhline(ridge, color="r", ls=":", label="H100 ridge point (bf16)")
plt.xlabel("sequences per step")
plt.ylabel("FLOPs per byte")
plt.title("Llama-3-8B, compiled programs")
plt.legend(fontsize=7)
plt.tight_layout()
plt.show()

# %% [markdown]
# The compiled FLOPs are what the parameter count predicts. A decode token costs about 2 FLOPs per
# weight (1.5·10¹⁰ for the 7.5 B weights outside the embedding) plus attention over the 4,096 slots,
# about 2·10⁹ more. Prefill spends the same per prompt token and runs the LM head only for each prompt's
# last token.
#
# **Prefill** is past the ridge from a single prompt: 512 tokens reuse every weight 512 times. **Decode**
# is far below it. One token per sequence does about 2 FLOPs per 2-byte weight. Batching shares the
# weight reads, but every sequence brings its own cache, and at a 4k context the cache soon dominates
# the bytes. The intensity levels off near (FLOPs per token) ÷ (4,096 × 128 KiB) ≈ 30, a tenth of the
# ridge. Decode is bandwidth-bound at any batch, and batching is what pays for the weight reads.
#
# XLA:CPU's count (dashed) is lower still. It counts a memory round trip for every unfused op and for
# the 512 × 512 attention scores. That is why prefill kernels on accelerators fuse their operations and
# never write the scores out (flash attention): without that, even prefill would lean on bandwidth.
#
# The same shows up in measurements on this CPU with the tiny model, on one device, with 8 prompts of 32
# tokens: prefill handles many more tokens per second than decode.

# %%
from jaxpar.inference.generate import Generator

tiny = build_model(get_model_preset("tiny"), rngs=nnx.Rngs(0))
one = Generator(tiny)  # one device
prompts = [list(np.random.default_rng(i).integers(0, 256, 32)) for i in range(8)]
one.generate(prompts, max_new_tokens=64)  # compiles
timing = one.generate(prompts, max_new_tokens=64)
prefill_tok_s = 8 * 32 / timing.prefill_s
print(f"batch 8: prefill {prefill_tok_s:,.0f} tokens/s, decode {timing.decode_tokens_per_s:,.0f} tokens/s")

# %% [markdown]
# ## 4. Tensor parallelism for latency, data parallelism for throughput
#
# Two decode layouts on the 8 devices (`jaxpar/inference/layouts.py`):
#
# * **`decode_tp`** splits every weight matrix over `tensor`, as tensor-parallel training does. Each
#   device holds an eighth of the model and reads an eighth of the weights per token, which is what
#   lowers the latency of a bandwidth-bound step. The price is activation collectives in every layer.
# * **`decode_dp`** keeps the whole model on every device and gives each device its own sequences and
#   their caches.
#
# We compile both decode steps for the tiny model, with a batch of 8 and a 64-slot cache. Then we read
# from the compiled programs what one device holds and, with `analyze_compiled`, every collective it
# runs. Tiny has 2 kv heads, fewer than the 8 tensor ways. Rather than replicate the cache, the layout
# check moves the spare ways onto the cache's batch, so under both layouts each device holds one
# sequence's cache.

# %%
from jaxpar.analysis.hlo import analyze_compiled


def collectives(gen):
    """{(kind, bytes): executions} of the collectives of ``gen``'s decode step (batch 8, 64 slots)."""
    _, dec = gen.programs(8, 16, 64)
    report, counts = analyze_compiled(dec, mesh=gen.mesh), {}
    for c in report.ops:
        counts[c.kind, c.bytes] = counts.get((c.kind, c.bytes), 0) + c.executions
    return report, counts


def by_kind(counts):
    out = {}
    for (kind, size), n in counts.items():
        if n:
            count, sent = out.get(kind, (0, 0))
            out[kind] = (count + n, sent + n * size)
    return out


# The layers run unrolled, so a layer's collectives appear once per layer. Tiny has 2 layers; the same
# model cut to 1 layer runs the same step with one layer fewer: the difference is one layer's collectives.
tiny1 = build_model(dataclasses.replace(tiny.cfg, num_layers=1), rngs=nnx.Rngs(0))
layouts = {}
for name in ("decode_tp", "decode_dp"):
    gen = Generator(tiny, name)
    report, two = collectives(gen)
    _, one_layer = collectives(Generator(tiny1, name))
    layer = {k: two.get(k, 0) - one_layer.get(k, 0) for k in two.keys() | one_layer.keys()}
    per_layer, per_step = by_kind(layer), by_kind({k: one_layer.get(k, 0) - n for k, n in layer.items()})
    weights = sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in jax.tree.leaves(gen.state))
    layouts[name] = {
        "weight_bytes_per_device": weights,
        "cache_bytes_per_device": cache_per_device(gen.model, gen.mesh, name, 8, 64),
        "collective_bytes_per_step": report.collectives.total_bytes,
        "per_layer": per_layer,
        "per_step": per_step,
    }
    print(
        f"{name}: mesh {dict((k, v) for k, v in gen.mesh.shape.items() if v > 1)}; per device: "
        f"{weights:,} weight bytes, {layouts[name]['cache_bytes_per_device']:,} cache bytes"
    )
    print(f"   collectives in each layer (count, bytes): {per_layer}")
    print(f"   once per step, outside the layers:        {per_step}")
    print(f"   bytes sent per decode step: {report.collectives.total_bytes:,}")

fig, ax = plt.subplots(figsize=(6.5, 3))
what = ["weight_bytes_per_device", "cache_bytes_per_device", "collective_bytes_per_step"]
for i, name in enumerate(layouts):
    ax.bar(np.arange(3) + 0.38 * i, [max(layouts[name][w], 1) for w in what], 0.38, label=name)
ax.set_xticks(np.arange(3) + 0.19, ["weights per device", "cache per device", "collective bytes per step"])
ax.set_yscale("log")
ax.set_ylabel("bytes")
ax.set_title("tiny, batch 8, 8 devices: one decode step")
ax.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# Reading the two programs:
#
# * **`decode_tp`**: each layer ends its attention and its MLP with an all-reduce of the batch's
#   [8, 1, 64] activations, the row-parallel matmuls' partial sums. The same happens in TP training, but
#   here it is once per generated token. Two all-to-alls per layer move the token's queries to the
#   device holding their cache and move the outputs back: the spare tensor ways at work (four small
#   all-gathers, 128 bytes each, come with each layer too). Outside the layers, the vocabulary is split
#   too. The embedding lookup needs an all-reduce, and the argmax needs the logits' pieces brought
#   together (counted once per step). This is the greedy step; a generator asked to sample compiles a
#   second program with the samplers' sort, chosen on the host, never a branch inside the step.
# * **`decode_dp`** sends nothing: each device decodes its own rows with its own whole copy of the
#   weights.
#
# TP buys latency. Each device reads an eighth of the weights per token and pays with a few small
# collectives per layer (2 KiB all-reduces here: one token per sequence), which a fast link absorbs.
# DP buys throughput. It runs 8 independent copies, each with the full weight reads of a one-device
# step. On a real model the choice is priced by `jaxpar plan` with a chip's bandwidths; the tiny shapes
# here only make the programs easy to read. (Timing the two layouts on simulated CPU devices would not
# tell which is faster on GPUs, so this notebook does not.)
#
# ## 5. Generate from a model trained a minute ago
#
# We train the tiny model for 60 steps with jaxpar's training loop, on one device, on the embedded Markov
# source: each token has 8 possible successors, an entropy of 1.47 nats per token. (Notebook 08 trains
# on all 8 devices under `3d`; here one device is quicker.) Then we load the checkpoint and generate
# greedily. As a check, the first generated token must equal the argmax of the training forward pass on
# the prompt.

# %%
import pathlib
import tempfile

from jaxpar.convert.store import load_model
from jaxpar.train.config import apply_overrides, default_config
from jaxpar.train.loop import train

run = pathlib.Path(tempfile.mkdtemp()) / "tiny"
cfg = apply_overrides(
    default_config("tiny", mesh="dp", steps=60, batch=8, seq=64),
    [
        "optimizer.learning_rate=1e-2",
        "optimizer.warmup_steps=10",
        "log.eval_every=0",
        "log.progress=false",
        "log.tensorboard=false",
    ],
)
result = train(cfg, run, devices=jax.devices()[:1])
print(
    f"train loss {result.losses[1]:.3f} at step 1 -> {result.losses[60]:.3f} at step 60 "
    f"(entropy rate of the source {result.entropy_rate:.3f}, ln 256 = {np.log(256):.3f})"
)
dp = default_layout(cfg.model, "dp")  # the run's layout: its weights are on every device, replicated
trained, _ = load_model(run, dp)
prompt = [int(t) for t in np.random.default_rng(5).integers(0, 256, 12)]
out = Generator(trained).generate([prompt], max_new_tokens=16)
with dp.activate():  # the training forward on the run's layout (8 copies of the prompt: a batch it divides)
    forward_argmax = int(np.argmax(np.asarray(trained(np.asarray([prompt] * 8, np.int32)))[0, -1]))
print("prompt   ", prompt)
print("generated", out.tokens[0])
print("first generated token == argmax of the forward pass:", out.tokens[0][0] == forward_argmax)

# %%
key_numbers = {
    "kv_bytes_per_token": kv_bytes,
    "kv_formula": formula,
    "total_65k_70b": total_65k,
    "per_device_65k_70b": {str(t): v for t, v in per_device_65k.items()},
    "mha_65k_tp8": mha_tp8,
    "batch32_65k_tp8": batch32_tp8,
    "params_8b": P8,
    "batches": batches,
    "prompt": PROMPT,
    "context": CONTEXT,
    "whole_program_flops": float(whole_program),
    "compiled_flops": {ph: [float(compiled[ph][b][0]) for b in batches] for ph in compiled},
    "xla_bytes": {ph: [float(compiled[ph][b][1]) for b in batches] for ph in compiled},
    "intensity": {ph: [intensity[ph][b] for b in batches] for ph in intensity},
    "xla_intensity": {ph: [xla_intensity[ph][b] for b in batches] for ph in xla_intensity},
    "ridge_h100": ridge,
    "layouts": layouts,
    "prefill_tok_s": prefill_tok_s,
    "decode_tok_s": timing.decode_tokens_per_s,
    "first_loss": result.losses[1],
    "final_loss": result.losses[60],
    "entropy_rate": result.entropy_rate,
    "first_token_matches_forward": out.tokens[0][0] == forward_argmax,
}
key_numbers
