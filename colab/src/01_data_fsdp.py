# %% [markdown]
# # 01 · Data parallelism and ZeRO/FSDP: memory per device against bytes moved
#
# Data parallelism (DP) gives every device the whole model and a slice of the batch; after the
# backward pass the devices average their gradients with one all-reduce and all apply the same update.
# It is simple and its communication overlaps well with compute, but every device holds everything:
# parameters, gradients and optimizer state. ZeRO (DeepSpeed) and FSDP (PyTorch) keep the data-parallel
# split of the batch and instead *shard* that state, so each device stores 1/N of it, gathering a
# layer's weights just before it runs and reduce-scattering the gradients afterwards.
#
# This notebook measures both in jaxpar, whose presets `dp`, `fsdp` and `hsdp` are these three layouts:
#
# 1. the bookkeeping: 16 bytes per parameter, and the three ZeRO stages by formula;
# 2. what each device holds for a real-size model (Llama-3-8B, built abstractly: no memory allocated);
# 3. the memory XLA allocates for jaxpar's compiled train step (`compiled.memory_analysis()`);
# 4. the bytes each layout moves per step, read from the compiled HLO, against the ring formulas;
# 5. when FSDP pays: memory per device against bytes moved, across device counts.

# %%
from jaxpar.mesh import simulate_cpu_devices

simulate_cpu_devices(8)  # before any other JAX operation: the CPU shows up as 8 devices
import jax

n = jax.device_count()
print(n, "devices")

# %% [markdown]
# ## 1 · Sixteen bytes per parameter
#
# For a model of Ψ parameters trained with Adam in mixed precision, the ZeRO paper counts
# **16Ψ bytes** per data-parallel replica: 2Ψ for the fp16 weights the matmuls use, 2Ψ for their fp16
# gradients, and 12Ψ of optimizer state kept in fp32 (a master copy of the weights and Adam's two
# moments). jaxpar trains with float32 parameters (optionally computing in bf16), so its split is
# different but its total is the same: 4Ψ parameters + 4Ψ gradients + 8Ψ for the two moments.
#
# ZeRO shards these pieces in stages over the N data-parallel devices:
#
# | stage | sharded | per device (mixed precision, 2 + 2 + 12) | per device (jaxpar's fp32, 4 + 4 + 8) |
# |---|---|---|---|
# | DP | nothing | 16Ψ | 16Ψ |
# | ZeRO-1 | optimizer state | 4Ψ + 12Ψ/N | 8Ψ + 8Ψ/N |
# | ZeRO-2 | + gradients | 2Ψ + 14Ψ/N | 4Ψ + 12Ψ/N |
# | ZeRO-3 = FSDP | + parameters | 16Ψ/N | 16Ψ/N |
#
# Here are those formulas for Llama-3-8B on the 8 devices, with Ψ counted by jaxpar's abstract build.

# %%
from jaxpar.meshes import PRESETS
from jaxpar.models import get_model_preset
from jaxpar.shardings import default_layout, param_shardings

GB = 1e9
big = get_model_preset("llama3-8b")
reports = {name: param_shardings(big, default_layout(big, PRESETS[name])) for name in ("dp", "fsdp", "hsdp")}
psi = reports["dp"].num_params
zero = {
    "DP": (16 * psi, 16 * psi),
    "ZeRO-1": (4 * psi + 12 * psi / n, 8 * psi + 8 * psi / n),
    "ZeRO-2": (2 * psi + 14 * psi / n, 4 * psi + 12 * psi / n),
    "ZeRO-3": (16 * psi / n, 16 * psi / n),
}
print(f"Llama-3-8B: Ψ = {psi / 1e9:.2f} B parameters, N = {n}")
for stage, (mixed, fp32) in zero.items():
    print(f"  {stage:7s} {mixed / GB:7.1f} GB per device (2+2+12)   {fp32 / GB:7.1f} GB (4+4+8)")

# %% [markdown]
# ## 2 · What jaxpar's layouts hold, for the real-size model
#
# jaxpar has no ZeRO-1 or ZeRO-2 layout: its `fsdp` preset shards parameters, gradients and both Adam
# moments together on the weights' `embed` dimension (ZeRO-3), `dp` shards nothing, and `hsdp` runs
# FSDP inside groups of 4 devices (`fsdp=4`) and replicates across the 2 groups (`data=2`). The
# abstract build reports, per parameter, the shard each device keeps; 16 bytes per element of those
# shards give the per-device state. The norm scales are never sharded, which is why `fsdp` comes out a
# hair above 16Ψ/8.

# %%
llama = {}
for name, r in reports.items():
    local = sum(p.bytes_per_device // 4 for p in r.params)  # float32 elements each device keeps
    llama[name] = 16 * local
    print(
        f"{name:5s} {dict(r.mesh)}: {local / 1e9:5.2f} B elements per device -> {16 * local / GB:6.1f} GB "
        f"(16Ψ/{psi / local:.2f})"
    )

# %% [markdown]
# ## 3 · Measured: the compiled train step
#
# The numbers above are bookkeeping. What XLA actually allocates comes from compiling jaxpar's real
# train step (forward, backward, gradient clipping and AdamW) under each layout and asking the
# compiled program for its `memory_analysis()`. We compile from abstract inputs, so nothing is
# allocated, on a small model whose parameters dominate its memory: 8 layers of width 256, 8.7 M
# parameters, and only 16 tokens per device.
#
# `memory_analysis()` splits a device's memory into *arguments* (what the step receives: the
# parameters and the two Adam moments, plus the token ids), *temporaries* (what exists only during the
# step: gradients, gathered weights, activations) and outputs; the new state is written over the old
# one (the state is donated), so outputs add nothing beyond the arguments.

# %%
import time

from jaxpar.analysis import analyze_compiled
from jaxpar.analysis.plan import compile_step
from jaxpar.layout import make_layout

small = get_model_preset(
    "tiny", vocab_size=512, embed_dim=256, num_layers=8, num_heads=8, num_kv_heads=8, head_dim=32, mlp_dim=1024
)
P = small.num_params(padded=True)
B, T = 8, 16
compiled, measured = {}, {}
for name in ("dp", "fsdp", "hsdp"):
    start = time.perf_counter()
    layout = make_layout(small, PRESETS[name], batch=B, seq=T)
    compiled[name] = compile_step(small, layout, batch=B, seq=T)  # jaxpar's train step, compiled
    measured[name] = analyze_compiled(compiled[name], mesh=layout.mesh)  # its collectives, read from the HLO
    print(f"{name:5s} {dict(layout.mesh.shape)}  compiled in {time.perf_counter() - start:.1f} s")

memory = {}
for name, c in compiled.items():
    m = c.memory_analysis()
    total = m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    memory[name] = dict(arguments=m.argument_size_in_bytes, temporaries=m.temp_size_in_bytes, total=total)
print(f"P = {P:,} parameters; bytes per parameter on one device:")
print(f"{'':6s}{'arguments':>11s}{'temporaries':>13s}{'total':>8s}")
for name, m in memory.items():
    print(f"{name:6s}{m['arguments'] / P:11.2f}{m['temporaries'] / P:13.2f}{m['total'] / P:8.2f}")

# %% [markdown]
# Reading the table:
#
# * **Arguments** are the persistent state, 12 bytes per parameter whole under `dp` (parameter and
#   two moments), an eighth of that under `fsdp` and a quarter under `hsdp`, exactly as the abstract
#   report says (plus the unsharded norm scales and a few hundred bytes of token ids and counters).
# * **Temporaries** under `dp` are 8 bytes per parameter: the 4-byte gradient of the bookkeeping plus a
#   second parameter-sized buffer XLA keeps during the update. So plain DP here costs 20 bytes per
#   parameter, not 16.
# * Under `fsdp` the gradient buffers are sharded too (8/N bytes per parameter), but while a layer
#   runs the device also holds that layer's *gathered* weights, and those do not shrink with N. Here
#   one layer is an eighth of the model, about 0.5 bytes per parameter (printed below). At N = 8 that
#   floor shows: the temporaries are 1.55 bytes per parameter rather than 8/8 = 1, and the total is
#   about 3 rather than 20/8 = 2.5. Under `hsdp` the sharded gradient buffers (8/4 = 2 bytes per
#   parameter) are larger than the floor, and the total is 20/4. The more layers a model has, the
#   less the floor weighs.

# %%
one_layer = 4 * (P - 2 * small.padded_vocab * small.embed_dim - small.embed_dim) / small.num_layers
print(f"one layer's weights, gathered: {one_layer / P:.2f} bytes per parameter of the model")

# %%
import matplotlib.pyplot as plt

names = list(memory)
args = [memory[k]["arguments"] / P for k in names]
temps = [memory[k]["temporaries"] / P for k in names]
plt.figure(figsize=(6, 3.2))
plt.bar(names, args, label="arguments: parameters + Adam moments")
plt.bar(names, temps, bottom=args, label="temporaries: gradients, gathered weights")
for i, k in enumerate(names):
    shards = {"dp": 1, "fsdp": 8, "hsdp": 4}[k]
    plt.plot([i - 0.4, i + 0.4], [16 / shards] * 2, "k--", lw=1, label="16Ψ / shards (bookkeeping)" if i == 0 else None)
plt.ylabel("bytes per parameter, one device")
plt.title(f"Compiled train step, {P / 1e6:.1f} M parameters, 8 devices")
plt.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 4 · What moves: one all-reduce against gathers and reduce-scatters
#
# `jaxpar.analysis` reads every collective of the compiled program: its kind, the mesh axes its
# device groups span, its result size on one device and how many times it runs per step (the layers
# run in a loop, so a collective inside it runs once per layer). Per device, a ring algorithm on n
# devices sends
#
# * all-reduce of a buffer of S bytes: 2(n−1)/n · S (a reduce-scatter then an all-gather);
# * all-gather producing S bytes, or reduce-scatter of S bytes: (n−1)/n · S each.
#
# **DP** all-reduces every gradient once: S = P·b with b = 4 bytes (float32 gradients), so the ring
# sends 2(n−1)/n · P·b per device.


# %%
def volumes(report) -> dict:
    """Result bytes per step of each (kind, mesh axes) of collectives."""
    return {f"{k}@{'+'.join(a)}": v["bytes"] for (k, a), v in report.collectives.by_kind_axes.items()}


def ring_sent(report) -> float:
    """Bytes one device sends per step, each collective as the ring algorithm of its kind (as compiled)."""
    return sum(op.sent_bytes * op.executions for op in report.ops)


b = 4
dp_volumes = volumes(measured["dp"])
dp_sent = ring_sent(measured["dp"])
ring_formula = 2 * (n - 1) / n * P * b
print("dp collectives:", dp_volumes)
print(f"all-reduced: {dp_volumes['all-reduce@data']:,} B = P·b + {dp_volumes['all-reduce@data'] - P * b} B (the loss)")
print(
    f"ring sends {dp_sent:,.0f} B per device; 2(n−1)/n·P·b = {ring_formula:,.0f} B (ratio {dp_sent / ring_formula:.7f})"
)

# %% [markdown]
# **FSDP** sends three things per step instead: every layer's weights gathered in the forward pass,
# gathered again in the backward pass (jaxpar recomputes each layer's forward there, and the
# recompute and the backward share one gather), and the gradients reduce-scattered, each device
# keeping the sum of its own shard. Each of the three passes P·b bytes through a ring at (n−1)/n, so
# by formula FSDP sends 3(n−1)/n · P·b: **1.5 times what DP sends**, for 1/N of the memory. The
# compiled program does slightly better: the embedding table is never gathered (its lookup runs on
# each device's columns and one all-to-all of the activation returns the result), and the LM head is
# gathered once.
#
# One caveat of the CPU backend: XLA:CPU writes a reduce-scatter as an all-reduce followed by a slice,
# so the HLO shows all-reduces on `fsdp`, and a ring on them would send twice what a GPU's
# reduce-scatter sends. Below, "reduced" is the volume of the gradients summed, whatever the kind,
# and the ring bytes are given both as compiled and as a reduce-scatter would send them.

# %%
from jaxpar.analysis.costmodel import weight_bytes


def fsdp_traffic(report, axis: str, ways: int) -> dict:
    v = volumes(report)
    gathered = v.get(f"all-gather@{axis}", 0)
    reduced = v.get(f"all-reduce@{axis}", 0) + ways * v.get(f"reduce-scatter@{axis}", 0)
    return dict(
        gathered=gathered,
        reduced=reduced,
        all_to_all=v.get(f"all-to-all@{axis}", 0),
        sent_reduce_scatter=(ways - 1) / ways * (gathered + reduced),
        sent_as_compiled=(ways - 1) / ways * gathered + 2 * (ways - 1) / ways * reduced,
    )


fsdp = fsdp_traffic(measured["fsdp"], "fsdp", n)
minimum = weight_bytes(
    param_shardings(small, make_layout(small, PRESETS["fsdp"], batch=B, seq=T)),
    {"stage": 1, "data": 1, "fsdp": n, "expert": 1, "sequence": 1, "tensor": 1},
    {"fsdp"},
)
print("fsdp collectives:", volumes(measured["fsdp"]))
print(f"gathered {fsdp['gathered'] / (P * b):.3f}·P·b, reduced {fsdp['reduced'] / (P * b):.3f}·P·b")
print(
    f"ring, reduce-scatter: {fsdp['sent_reduce_scatter'] / (P * b):.3f}·P·b   "
    f"(formula 3(n−1)/n = {3 * (n - 1) / n:.3f}; the lab's minimum {minimum['fsdp'] / (P * b):.3f})"
)
print(f"ring, as compiled:    {fsdp['sent_as_compiled'] / (P * b):.3f}·P·b")
print(f"DP's all-reduce:      {dp_sent / (P * b):.3f}·P·b  ->  FSDP / DP = {fsdp['sent_reduce_scatter'] / dp_sent:.2f}")

# %% [markdown]
# **HSDP** (`data=2 × fsdp=4`) gathers and reduce-scatters inside each group of 4, so those volumes
# are FSDP's on 4 devices, and then all-reduces each device's quarter of the gradient across the 2
# groups: a DP all-reduce of P·b/4.
#
# Compiling `hsdp` printed one XLA warning above ("Involuntary full rematerialization"). It concerns an
# activation, not the weights: in the backward pass of the embedding lookup, the gradient of the
# lookup's output [B, T, D] has to go from split by batch over all 8 devices to split along D over
# `fsdp`. Under `fsdp` alone that is the one all-to-all seen above; here XLA gathers it whole, the
# all-gather on `data+fsdp` of B·T·D·4 = 131,072 bytes in the list below (the 32,768 bytes gathered on
# `data` belong to the same lookup).

# %%
hsdp_v = volumes(measured["hsdp"])
hsdp = fsdp_traffic(measured["hsdp"], "fsdp", 4)
hsdp_data = hsdp_v.get("all-reduce@data", 0)
hsdp_sent = hsdp["sent_reduce_scatter"] + 2 * (2 - 1) / 2 * hsdp_data
print("hsdp collectives:", hsdp_v)
print(
    f"inside groups: gathered {hsdp['gathered'] / (P * b):.3f}·P·b, reduced {hsdp['reduced'] / (P * b):.3f}·P·b;"
    f" across groups all-reduced {hsdp_data / (P * b):.3f}·P·b"
)
print(f"ring, reduce-scatter: {hsdp_sent / (P * b):.3f}·P·b per device")

# %% [markdown]
# ## 5 · When FSDP pays
#
# Per device and per step, DP holds 16Ψ bytes and sends 2(N−1)/N · 4Ψ; FSDP holds 16Ψ/N and sends
# 3(N−1)/N · 4Ψ. FSDP never sends less. What it buys is memory, and it buys a lot: for Llama-3-8B,
# DP needs 128 GB of state on every device, more than an 80 GB H100 has, whatever N is; FSDP fits
# from N = 2 on (before activations). The plot shows the trade across N, with the numbers from the
# layout lab's abstract tools (`jaxpar.analysis.search.resharded`, the parameter shards of a layout
# without a compile, and `costmodel.weight_bytes`, the ring bytes of its weights and gradients).

# %%
from jaxpar.analysis.search import base_report, resharded
from jaxpar.meshes import compose_rules

base = base_report(big)
sweep = {"dp": {}, "fsdp": {}, "hsdp": {}}
for N in (2, 4, 8, 16, 32, 64):
    for name, axes in (("dp", {"data": N}), ("fsdp", {"fsdp": N}), ("hsdp", {"data": 2, "fsdp": N // 2})):
        if name == "hsdp" and N < 4:
            continue
        mesh = {"stage": 1, "data": 1, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 1} | axes
        rules = compose_rules(name, {a for a, k in axes.items() if k > 1})
        r = resharded(base, rules, mesh)
        state = 16 * sum(p.bytes_per_device // 4 for p in r.params)
        sent = sum(weight_bytes(r, mesh, {a for a, k in axes.items() if k > 1}).values())
        sweep[name][N] = (sent, state)

fig, ax = plt.subplots(figsize=(6.5, 4))
for name, marker in (("dp", "o"), ("fsdp", "s"), ("hsdp", "^")):
    xs, ys = zip(*sweep[name].values())
    ax.plot([x / GB for x in xs], [y / GB for y in ys], marker=marker, label=name)
    shown = list(sweep[name]) if name == "fsdp" else [min(sweep[name]), max(sweep[name])]
    for N in shown:
        x, y = sweep[name][N]
        offset = {"dp": (-12, 7), "fsdp": (-34, -3), "hsdp": (6, 2)}[name]
        ax.annotate(f"N={N}", (x / GB, y / GB), textcoords="offset points", xytext=offset, fontsize=7)
ax.axhline(80, color="r", ls="--", lw=1, label="80 GB (H100)")
ax.set_yscale("log")
ax.set_yticks([2, 5, 10, 20, 50, 100], ["2", "5", "10", "20", "50", "100"])
ax.set_xlabel("GB sent per device per step (ring)")
ax.set_ylabel("GB of state per device")
ax.set_title("Llama-3-8B across N devices: parameters + gradients + Adam (fp32)", fontsize=10)
ax.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# FSDP's extra traffic only costs time when it cannot hide behind compute. Its gathers for the next
# layer can run while the current one computes, so what matters is the ratio of the two per step:
# communication 3(N−1)/N · 4Ψ bytes over the link, compute 6Ψ FLOPs per token (forward and backward)
# for the device's tokens. Ψ cancels: FSDP's weights traffic hides once each device processes more
# than 3(N−1)/N · 4 · (achieved FLOP/s) / (6 · link bandwidth) tokens per step. With the lab's H100
# profile (989 TFLOP/s at 60 %, NVLink 450 GB/s each way inside a node, 50 GB/s InfiniBand across):

# %%
from jaxpar.analysis.hardware import HARDWARE

h100 = HARDWARE["h100"]
hide = {}
for link_name, link in (("NVLink", h100.fast_link), ("InfiniBand", h100.slow_link)):
    for name, factor in (("dp", 2), ("fsdp", 3)):
        hide[f"{name}_{link_name}"] = factor * (n - 1) / n * 4 * h100.peak_bf16_flops * 0.6 / (6 * link)
        tokens = hide[f"{name}_{link_name}"]
        print(f"{name:4s} over {link_name:10s}: hidden above {tokens:8,.0f} tokens per device per step")

# %% [markdown]
# So inside a node FSDP's traffic hides behind a few thousand tokens per device; across InfiniBand it
# needs 9 times more (the ratio of the two links). That is why the common hybrid is `hsdp`: shard
# inside the fast domain, replicate across domains, and send only a DP all-reduce of each shard over
# the slow links.

# %%
key_numbers = {
    "devices": n,
    "batch": B,
    "seq": T,
    "small": {
        k: getattr(small, k)
        for k in ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim")
    },
    "small_params": P,
    "memory": memory,
    "dp_volumes": dp_volumes,
    "dp_sent": dp_sent,
    "fsdp": fsdp,
    "fsdp_minimum": minimum["fsdp"],
    "hsdp": hsdp,
    "hsdp_data_reduced": hsdp_data,
    "hsdp_sent": hsdp_sent,
    "llama_params": psi,
    "llama_state": llama,
    "zero_stages": {k: v[0] for k, v in zero.items()},
    "sweep": {name: {str(N): list(v) for N, v in s.items()} for name, s in sweep.items()},
    "hide_tokens": hide,
}
key_numbers
