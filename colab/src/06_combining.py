# %% [markdown]
# # 06 · Combining the axes: a 5D layout, a layout search, and "what is your bottleneck?"
#
# Real training runs split a model over several mesh axes at once, each axis taking the job it does
# best: `data` replicates and splits the batch, `fsdp` shards weights and batch (ZeRO-3), `tensor` splits
# the matmuls inside a layer, `expert` places whole experts, `sequence` splits the positions, `stage`
# cuts the depth into a pipeline. In jaxpar they compose because the model names only logical axes: a
# layout is one rules table, and each logical axis may map to several mesh axes.
#
# This notebook does three things:
#
# 1. lays `tiny-moe` (with ring attention) out over **five axes on 32 simulated devices**, reads what each
#    device holds, and reads from the compiled training step which collectives run over which axis;
# 2. ranks every layout of a real model (Mixtral-8x7B on 64 H100s) with the layout lab's search, the
#    Python side of `jaxpar plan --search`, and plots the candidates;
# 3. takes the background texts' decision list, "what is your bottleneck?", and answers it for a few
#    concrete cases with the lab's numbers.

# %%
from jaxpar.mesh import simulate_cpu_devices

simulate_cpu_devices(32)  # before any other JAX operation: the CPU shows up as 32 devices
import jax

print(jax.device_count(), "devices")

# %% [markdown]
# ## 1 · Five axes at once
#
# The mesh is data=2 × fsdp=2 × expert=2 × sequence=2 × tensor=2 = 32 devices, in that order (outermost
# first: the axes whose collectives are rare or large go outside, the chatty ones inside, where a real
# machine's links are fastest). The rules table the axis spec composes says where each logical axis goes:

# %%
from jaxpar.meshes import resolve_mesh_arg
from jaxpar.rules_report import format_rules, rules_report

SPEC = "data=2,fsdp=2,tensor=2,expert=2,sequence=2"
preset = resolve_mesh_arg(SPEC)
print(format_rules(rules_report(preset, 32, model="tiny-moe")))

# %% [markdown]
# Read it as: the batch is split 8 ways (expert × data × fsdp: every axis but sequence and tensor sees
# different sequences), the positions 2 ways over `sequence` (ring attention) and the residual stream's
# positions 4 ways over sequence × tensor (tensor's sequence parallelism between the matmuls); weights
# are sharded over `fsdp` on their `embed` dimension and over `tensor` on heads, MLP columns and
# vocabulary; experts live on `expert`.
#
# What each device holds, from an abstract build (`jaxpar.shardings.param_shardings`, shapes only):

# %%
from jaxpar.layout import make_layout
from jaxpar.models import get_execution_preset, get_model_preset
from jaxpar.shardings import param_shardings

cfg = get_model_preset("tiny-moe")  # what the model is; how it runs:
run = get_execution_preset("tiny-moe", context_parallel="ring", remat="none")
B, T = 8, 32  # tiny: the 32-device compile is this notebook's cost
layout = make_layout(cfg, preset, batch=B, seq=T, execution=run)
held = param_shardings(cfg, layout)
print(f"{'parameter':26s} {'logical axes':42s} {'shape':18s} {'spec':36s} per device")
for p in held.params:
    spec = str(tuple(p.spec)).replace("'", "")
    print(f"{p.path:26s} {str(p.names).replace(chr(39), ''):42s} {str(p.shape):18s} {spec:36s} {p.shard_shape}")
print(
    f"\n{held.num_params:,} parameters; a device keeps {held.per_device_adamw_bytes:,} bytes of parameters and "
    f"AdamW moments of {12 * held.num_params:,} ({12 * held.num_params / held.per_device_adamw_bytes:.1f}× less)"
)

# %% [markdown]
# The expert weights are cut over three axes (expert × fsdp × tensor: 8 shards), the attention, embedding
# and head weights over two (fsdp × tensor: 4 shards), the norms not at all. No device holds a whole expert matrix:
# FSDP gathers the fsdp
# shards before use, and tensor keeps its half of the MLP columns.
#
# ## 2 · The collectives of each axis, read from the compiled step
#
# We compile the whole training step (forward, backward, AdamW update) for the 32 devices from abstract
# inputs (`jaxpar.analysis.plan.compile_step`: nothing is allocated) and read its collectives from the
# compiled HLO (`jaxpar.analysis.analyze_compiled`). Each collective is labelled with the mesh axes its
# device groups span, and counted as often as it runs (the layer stack is a loop).

# %%
import time
from collections import defaultdict

from jaxpar.analysis import analyze_compiled
from jaxpar.analysis.plan import compile_step

start = time.perf_counter()
compiled = compile_step(cfg, layout, batch=B, seq=T, execution=run)
print(f"compiled the 32-device train step in {time.perf_counter() - start:.1f} s")
report = analyze_compiled(compiled, mesh=layout.mesh)

KINDS = ("all-reduce", "all-gather", "all-to-all", "collective-permute")
ORDER = tuple(layout.mesh.axis_names)
sent = defaultdict(lambda: defaultdict(float))  # axis group -> kind -> bytes one device sends
runs = defaultdict(lambda: defaultdict(int))  # axis group -> kind -> executions per step
for op in report.ops:
    group = "+".join(op.axes) or "(groups of one device)"
    sent[group][op.kind] += op.sent_bytes * op.executions
    runs[group][op.kind] += op.executions
groups = sorted(sent, key=lambda g: (len(g.split("+")), [ORDER.index(a) for a in g.split("+") if a in ORDER]))
print(f"\n{'axis group':34s}" + "".join(f"{k:>22s}" for k in KINDS) + "   (bytes sent per device, runs)")
for g in groups:
    cells = [f"{sent[g][k]:>13,.0f} ({runs[g][k]:>3d})" if runs[g][k] else f"{'·':>22s}" for k in KINDS]
    print(f"{g:34s}" + "".join(f"{c:>22s}" for c in cells))

# %%
import matplotlib.pyplot as plt
import numpy as np

fig, ax = plt.subplots(figsize=(8, 4.5))
left = np.zeros(len(groups))
for kind in KINDS:
    values = np.array([sent[g][kind] / 1e3 for g in groups])
    ax.barh(groups, values, left=left, label=kind)
    left += values
ax.invert_yaxis()
ax.set_xlabel("kB sent per device per step")
ax.legend(fontsize=8)
ax.set_title(f"tiny-moe train step on {SPEC}: collectives by mesh-axis group")
plt.tight_layout()
plt.show()

# %% [markdown]
# Each axis leaves its own signature in the program:
#
# - **fsdp**: all-gathers, the weight shards collected before the forward use and again in the backward;
#   the gradients are reduced over the groups that split the batch (the mixed `data+fsdp…` rows).
# - **tensor**: all-reduces of the row-parallel matmuls' partial sums, and the all-gathers of sequence
#   parallelism (the `sequence+tensor` rows: the residual stream's positions are split over both).
# - **expert**: the all-to-alls of dispatch and combine, forward and backward. (The two small all-to-alls
#   on `tensor` are a reshard XLA's partitioner put at the attention's output projection.)
# - **sequence**: collective-permutes, the ring passing key/value blocks from neighbour to neighbour.
# - **data**: no signature of its own beyond the gradient reductions it shares with the other batch
#   axes; its traffic is once per step.
#
# The mixed rows hold what XLA's partitioner adds around them (scalars, small reshards). The compile also
# printed a warning, "Involuntary full rematerialization": the embedding lookup gathers rows of a table
# whose embed dimension is split over fsdp, and the partitioner finds no cheap way from that result's
# sharding to the batch × length split the next layer wants, so it replicates the [B, T, D/2] result
# first. At this size it costs nothing; on a real model it is an activation-sized reshard per step, the
# kind of cost only the compiled program shows.
#
# One number is easy to predict exactly: the expert all-to-all. Its buffer holds one device group's
# sequences, and the batch is split over expert × data × fsdp only, so a device's buffer is B/8
# sequences × E × C slots × D; sequence and tensor do not split it (the four devices of a sequence ×
# tensor group send the same buffer). Per MoE layer: 4 · (ep−1)/ep · T_dev · k · cf · D · 4 bytes with
# T_dev = B·T/8.

# %%
import math

from jaxpar.parallel.moe import a2a_bytes_formula

moe = cfg.moe
a2a = [op for op in report.ops if op.kind == "all-to-all" and op.axes == ("expert",)]
a2a_sent = sum(op.sent_bytes * op.executions for op in a2a)
batch_ways = math.prod(layout.mesh.shape[a] for a in ("data", "fsdp", "expert"))
slots = moe.num_experts * math.ceil(run.capacity_factor * T * moe.top_k / moe.num_experts)
a2a_formula = cfg.num_moe_layers * a2a_bytes_formula(
    tokens_per_device=B * T // batch_ways,
    top_k=moe.top_k,
    capacity_factor=slots / (T * moe.top_k),
    embed_dim=cfg.embed_dim,
    ep=layout.mesh.shape["expert"],
    bytes_per_element=4,
)
print(
    f"expert all-to-all: {len(a2a)} instructions, buffer {a2a[0].shapes[0]} each, "
    f"{a2a_sent:,.0f} bytes sent per device per step; formula {a2a_formula:,.0f}"
)

# %% [markdown]
# `tests/test_five_d.py` trains this layout for 3 steps and finds the losses, the per-expert loads and every
# parameter's gradients of one device, within a multiple of one device's own float noise (docs/testing.md).
#
# ## 3 · Searching the layouts of a real model
#
# For a real model the question becomes: which of the many factorisations of the devices over the axes
# should I use? `jaxpar plan --search` (Python: `jaxpar.analysis.search.search`) enumerates every one,
# estimates each analytically (memory per device; the minimum bytes each axis group must send; a roofline
# step time on named hardware, where a group's traffic crosses NVLink when its devices fit in one
# 8-GPU node and InfiniBand otherwise), and ranks the ones that fit by predicted step time. No compile is
# needed, so a few hundred candidates take seconds.
#
# Mixtral-8x7B (46.7 B parameters, 8 experts) on 64 H100s, a batch of 256 sequences of 4,096 tokens:

# %%
from jaxpar.analysis.hardware import HARDWARE
from jaxpar.analysis.plan_command import candidates_figure
from jaxpar.analysis.search import search

MODEL, N, BATCH, SEQ, HW = "mixtral-8x7b", 64, 256, 4096, "h100"
# This notebook reads the roofline: every axis group's bytes over its link, so that each bottleneck below is
# one division. (`jaxpar plan` prices layouts without `sequence` with the calibrated step-time model from
# mechanisms instead, MoE layers and their all-to-all included; see docs/layout-lab.md.)
# Pipelines run 1F1B here (the search tries every schedule unless one is named).
ROOFLINE = dict(efficiency=0.6, overlap=0.8, schedule="1f1b")
# On H100s attention runs in cuDNN's flash kernel (`execution.attention_impl=cudnn`), as a GPU user sets it:
# jaxpar's default is XLA's attention, which holds every score of a layer (see section 4's long context).
GPU = dict(attention_impl="cudnn")
start = time.perf_counter()
ranked, refused = search(MODEL, N, batch=BATCH, seq=SEQ, hardware=HW, **ROOFLINE, execution=GPU)
fitting = [c for c in ranked if c.fits]
print(
    f"{len(ranked)} layouts estimated, {len(refused)} refused (cannot divide the model), {len(fitting)} fit "
    f"in {HARDWARE[HW].hbm_bytes / 1e9:.0f} GB; {time.perf_counter() - start:.1f} s"
)
print(f"{'rank':>4}  {'mesh':36s}{'GB/device':>10s}{'step s':>8s}{'MFU':>7s}")
for i, c in enumerate(ranked[:10], 1):
    mesh = ",".join(f"{a}={n}" for a, n in c.mesh.items())
    print(f"{i:>4}  {mesh:36s}{c.memory_bytes / 1e9:>10.1f}{c.predicted_step_s:>8.2f}{c.predicted_mfu:>7.1%}")
print("refused, e.g.:", refused[0][1][:110], "…")
hw = HARDWARE[HW]
print(
    f"{HW}: {hw.peak_bf16_flops / 1e12:.0f} TFLOP/s bf16, {hw.hbm_bytes / 1e9:.0f} GB HBM, "
    f"links {hw.fast_link / 1e9:.0f} GB/s inside a {hw.fast_domain}-GPU node, "
    f"{hw.slow_link / 1e9:.0f} GB/s across nodes (per direction)"
)

# %% [markdown]
# The CLI's `--plot` draws this figure (here returned by `candidates_figure` and shown inline): for the
# 20 best layouts, the memory per device (green: fits) and the minimum bytes each axis group sends per
# step.

# %%
candidates_figure(ranked[:20], title=f"{MODEL}, {N} × {HW}: the 20 best layouts")
plt.show()

# %% [markdown]
# All the candidates at once: memory per device against predicted step time. Left of the red line they
# fit; the fastest ones put the experts on `expert` and shard the rest with FSDP.

# %%
from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

has_expert = np.array(["expert" in c.mesh for c in ranked])
memory = np.array([c.memory_bytes / 1e9 for c in ranked])
step = np.array([c.predicted_step_s for c in ranked])
plt.figure(figsize=(6.5, 4))
plt.scatter(memory[~has_expert], step[~has_expert], s=12, alpha=0.6, label="no expert axis")
plt.scatter(memory[has_expert], step[has_expert], s=12, alpha=0.6, label="with an expert axis")
top = fitting[0]
plt.scatter(
    [top.memory_bytes / 1e9],
    [top.predicted_step_s],
    s=120,
    marker="*",
    color="k",
    label="best: " + ",".join(f"{a}={n}" for a, n in top.mesh.items()),
)
plt.axvline(HARDWARE[HW].hbm_bytes / 1e9, color="r", ls="--", label="80 GB HBM")
plt.xscale("log")
plt.yscale("log")
for axis, ticks in ((plt.gca().xaxis, [10, 20, 40, 80, 160, 320, 640]), (plt.gca().yaxis, [3, 4, 6, 10, 20, 40])):
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(ScalarFormatter())
    axis.set_minor_locator(NullLocator())
plt.xlabel("memory per device (GB)")
plt.ylabel("predicted step (s)")
plt.title(f"{MODEL} on {N} H100s: {len(ranked)} layouts")
plt.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 4 · "What is your bottleneck?"
#
# The background texts end on a decision list. Paraphrased: if memory is full (the weights and optimizer
# state do not fit), shard with ZeRO/FSDP, then add tensor or pipeline parallelism; if activations or the
# KV cache of long contexts are too big, split the sequence (context parallelism); if single-token latency
# matters, tensor parallelism inside a node; if throughput is too low, more data parallelism; if gradient
# synchronisation is slow, ring all-reduce or FSDP; for MoE, expert parallelism. And always: keep the
# chatty axis (tensor) on the fastest links.
#
# The layout lab can answer each case with numbers. For each case below we estimate a naive layout,
# name its bottleneck from the lab's numbers (does not fit; or the largest of compute, HBM traffic and
# *exposed* communication, which is communication compute cannot hide), apply the texts' remedy, and
# compare with the search's best layout for the same devices.

# %%
import functools

from jaxpar.analysis.plan import plan_execution
from jaxpar.analysis.search import estimate


def candidate(model, mesh, batch, seq, **execution):
    """``model``'s estimate under ``mesh``, run as the lab runs it (bf16 compute) with cuDNN's attention
    and the ``execution`` changes."""
    run = plan_execution(model, GPU | execution)
    return estimate(get_model_preset(model), mesh, batch=batch, seq=seq, hardware=HW, **ROOFLINE, execution=run)


def bottleneck(c):
    """The lab's reading of a candidate: does not fit, or the largest part of its predicted step."""
    if not c.fits:
        return f"memory: {c.memory_bytes / 1e9:,.0f} GB > 80 GB"
    t = c.times
    parts = {"compute": t["compute_s"], "HBM": t["memory_s"], "communication": t["exposed_communication_s"]}
    name = max(parts, key=parts.get)
    if name == "communication":
        axis = max(t["communication_s"], key=t["communication_s"].get)
        return f"communication ({axis}): {parts[name]:.2f} of {t['step_s']:.2f} s exposed"
    return f"{name}: {parts[name]:.2f} of {t['step_s']:.2f} s"


@functools.cache
def best_layout(model, n, batch, seq):
    """The search's first candidate (searched once per setting; section 3's is reused)."""
    if (model, n, batch, seq) == (MODEL, N, BATCH, SEQ):
        return ranked[0]
    return search(model, n, batch=batch, seq=seq, hardware=HW, **ROOFLINE, execution=GPU)[0][0]


def mesh_text(mesh):
    return ",".join(f"{a}={n}" for a, n in mesh.items())


CASES = [  # (case, model, devices, batch, seq, naive layout, the texts' remedy, remedy's layout)
    ("weights + optimizer don't fit", "llama3-70b", 64, 64, 4096, {"data": 64}, "ZeRO / FSDP", {"fsdp": 64}),
    ("FSDP over 8 nodes", "llama3-70b", 64, 64, 4096, {"fsdp": 64}, "TP inside the node", {"fsdp": 8, "tensor": 8}),
    (
        "TP across nodes",
        "llama3-70b",
        64,
        64,
        4096,
        {"fsdp": 4, "tensor": 16},
        "keep TP ≤ a node",
        {"fsdp": 8, "tensor": 8},
    ),
    (
        "long context (64k tokens)",
        "llama3-8b",
        64,
        8,
        65536,
        {"fsdp": 8},
        "context parallelism",
        {"fsdp": 8, "sequence": 8},
    ),
    ("MoE experts", "mixtral-8x7b", 64, 256, 4096, {"fsdp": 64}, "expert parallelism", {"fsdp": 8, "expert": 8}),
    ("throughput (one node)", "llama3-8b", 64, 64, 2048, {"fsdp": 8}, "more data parallelism", {"data": 8, "fsdp": 8}),
]
rows, cases = [], {}
for name, model, n, batch, seq, naive, remedy, fix in CASES:
    before, after = candidate(model, naive, batch, seq), candidate(model, fix, batch, seq)
    best = best_layout(model, n, batch, seq)
    cases[name] = dict(
        model=model,
        devices=n,
        batch=batch,
        seq=seq,
        naive=naive,
        fix=fix,
        best=best.mesh,
        before={k: getattr(before, k) for k in ("fits", "memory_bytes", "predicted_step_s")},
        after={k: getattr(after, k) for k in ("fits", "memory_bytes", "predicted_step_s")},
        best_step_s=best.predicted_step_s,
        before_times=before.times,
        after_times=after.times,
        before_bytes=before.bytes_by_axis,
        after_bytes=after.bytes_by_axis,
    )
    devices = f"{n}" if math.prod(naive.values()) == n else f"{math.prod(naive.values())} → {n}"
    rows.append(
        f"| {name} | {model}, {devices} H100, {batch}×{seq} | `{mesh_text(naive)}`: "
        f"{bottleneck(before)} | {remedy} | `{mesh_text(fix)}`: {'fits' if after.fits else 'no fit'}, "
        f"{after.predicted_step_s:.2f} s | `{mesh_text(best.mesh)}`: {best.predicted_step_s:.2f} s |"
    )

from IPython.display import Markdown, display

display(
    Markdown(
        "| case | model, devices, batch × seq | naive layout: the lab's bottleneck | texts' remedy "
        "| remedy's layout | search's best |\n|---|---|---|---|---|---|\n" + "\n".join(rows)
    )
)

# %% [markdown]
# How the remedies held up in the lab's numbers:
#
# - **Memory → FSDP** holds: plain data parallelism needs 16 bytes per parameter on every device (weights,
#   gradients, two Adam moments), over a terabyte for 70 B; FSDP over 64 divides it by 64 and fits.
# - But FSDP over all 64 devices is then **communication-bound**: its gathers cross InfiniBand, at a
#   ninth of NVLink's bandwidth in the `h100` profile printed above, and the compute of a batch of 64
#   sequences cannot hide them. Keeping an 8-way tensor axis inside the node and FSDP across nodes is
#   the search's best.
# - **TP across nodes** is the texts' warning made concrete: with tensor=16, every layer's all-reduces
#   cross InfiniBand and the step is several times slower than with tensor=8 inside the node.
# - **Long context → CP** holds in part. A batch of 8 sequences of 64k tokens does not fit on one node
#   with FSDP alone, and FSDP cannot use more devices than there are sequences; splitting each sequence
#   over 8 more devices makes it fit. But tensor parallelism, whose sequence parallelism splits the
#   activations too, does as well here (next cell), and the search's best mixes the two. Both need a
#   flash kernel: with jaxpar's default XLA attention a device holds one layer's scores, queries × heads
#   × 65,536 keys, and neither layout fits (the cell's last line).
# - **MoE → EP** holds: with whole experts placed on `expert`, FSDP no longer gathers the expert
#   weights across all 64 devices; its traffic over InfiniBand shrinks several-fold, for an all-to-all
#   of tokens that stays inside the node.
# - **Throughput → DP** holds, with losses: 8× the devices gives less than 8× the speed, because each
#   device's compute shrinks 8× and no longer hides its weight and gradient traffic (part of which now
#   crosses nodes).

# %%
LONG = ({"fsdp": 8, "sequence": 8}, {"fsdp": 8, "tensor": 8})
long = {mesh_text(m): candidate("llama3-8b", m, 8, 65536) for m in LONG}
for mesh, c in long.items():
    print(f"llama3-8b, 8 × 65,536 tokens, {mesh}: {c.memory_bytes / 1e9:.1f} GB, {c.predicted_step_s:.2f} s")
xla_attention = {mesh_text(m): candidate("llama3-8b", m, 8, 65536, attention_impl=None) for m in LONG}
print("with XLA's attention:", ", ".join(f"{m}: {c.memory_bytes / 1e9:,.0f} GB" for m, c in xla_attention.items()))

# %% [markdown]
# One claim does not hold as stated: "gradient sync slow → FSDP". FSDP sends *more* than data parallelism
# for the same parameters: it gathers the weights twice (forward and backward) and reduce-scatters the
# gradient, 3 × (n−1)/n passes over the parameters against the all-reduce's 2 × (n−1)/n. What FSDP buys is
# memory, not traffic. The lab's minimum bytes for Llama-3-8B on 8 devices, data=8 against fsdp=8:

# %%
dp8, fsdp8 = candidate("llama3-8b", {"data": 8}, 64, 2048), candidate("llama3-8b", {"fsdp": 8}, 64, 2048)
sync = {"data": dp8.bytes_by_axis["data"], "fsdp": fsdp8.bytes_by_axis["fsdp"]}
print(
    f"data=8 sends {sync['data'] / 1e9:.1f} GB per device per step, fsdp=8 {sync['fsdp'] / 1e9:.1f} GB "
    f"({sync['fsdp'] / sync['data']:.2f}×); "
    f"memory {dp8.memory_bytes / 1e9:.0f} GB against {fsdp8.memory_bytes / 1e9:.0f} GB"
)

# %% [markdown]
# ## Key numbers

# %%
key_numbers = {
    "devices": jax.device_count(),
    "mesh": dict(layout.mesh.shape),
    "batch": B,
    "seq": T,
    "params": [
        dict(
            path=p.path,
            shape=list(p.shape),
            spec=[e if e is None or isinstance(e, str) else list(e) for e in p.spec],
            shard=list(p.shard_shape),
        )
        for p in held.params
    ],
    "collectives": {g: {k: dict(sent=sent[g][k], runs=runs[g][k]) for k in KINDS if runs[g][k]} for g in groups},
    "a2a": dict(
        sent=a2a_sent,
        formula=a2a_formula,
        instructions=len(a2a),
        runs=sum(op.executions for op in a2a),
        moe_layers=cfg.num_moe_layers,
        experts=moe.num_experts,
        top_k=moe.top_k,
        capacity_factor=run.capacity_factor,
        embed_dim=cfg.embed_dim,
    ),
    "search": dict(
        model=MODEL,
        devices=N,
        estimated=len(ranked),
        refused=len(refused),
        fitting=len(fitting),
        best=fitting[0].mesh,
        best_memory=fitting[0].memory_bytes,
        best_step_s=fitting[0].predicted_step_s,
        data_only_memory=next(c.memory_bytes for c in ranked if c.mesh == {"data": N}),
    ),
    "cases": cases,
    "sync_bytes": sync,
    "long_context": {m: dict(memory=c.memory_bytes, step_s=c.predicted_step_s, fits=c.fits) for m, c in long.items()},
    "long_context_xla": {m: dict(memory=c.memory_bytes, fits=c.fits) for m, c in xla_attention.items()},
}
{k: v for k, v in key_numbers.items() if k not in ("params", "cases", "collectives")}
