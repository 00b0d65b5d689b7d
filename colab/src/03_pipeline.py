# %% [markdown]
# # 03 · Pipeline parallelism: schedules, the bubble, and what a stage keeps
#
# Pipeline parallelism cuts the stack of layers into *stages*, one per device (or device group), and
# streams the batch through them in *microbatches*. A stage can only work on a microbatch once the
# stage before it has finished with it, so the pipeline fills at the start of a step and drains at
# the end, and during those phases some stages have nothing to do. That idle time is the *bubble*.
#
# In jaxpar a pipeline schedule is data: `jaxpar.pipeline.build(schedule, stages, microbatches)`
# returns a `Table` that says, for every tick and stage, which operation runs (F forward, B backward,
# W weight gradient) on which microbatch. The train step's executor runs any valid table. This
# notebook draws the four tables jaxpar ships, counts their bubbles cell by cell and sets them beside
# the closed forms, checks a number quoted in the background texts, reads the activation memory
# of the compiled pipelined train step for GPipe and 1F1B, and finishes by checking that a
# pipelined step computes the same loss as one device.

# %%
from jaxpar.mesh import simulate_cpu_devices

simulate_cpu_devices(8)  # before any other JAX operation: the CPU shows up as 8 devices
import jax

print(jax.device_count(), "devices")

# %% [markdown]
# ## Schedules are tables
#
# Notation: p stages, m microbatches, v model chunks per stage (interleaved only). Each cell of a
# table is one operation lasting one tick. `F3` is the forward of microbatch 3, `B3` its backward;
# zero-bubble splits the backward into `B3` (the gradient with respect to the stage's input, which
# the previous stage is waiting for) and `W3` (the gradient with respect to the stage's weights,
# which nobody is waiting for). Interleaved stages hold two model chunks each, marked `a` and `b`.
# Here is 1F1B for p = 4, m = 8 as the library prints it:

# %%
from jaxpar.pipeline import Op, build

P, M = 4, 8
tables = {
    "gpipe": build("gpipe", P, M),
    "1f1b": build("1f1b", P, M),
    "interleaved": build("interleaved", P, M, virtual_stages=2),
    "zero_bubble": build("zero_bubble", P, M),
}
print(tables["1f1b"].gantt())

# %% [markdown]
# The same four tables as Gantt charts: one row per stage, one column per tick, blue forwards, orange
# backwards, green weight gradients, white idle. The microbatch number is written in each cell
# (interleaved: chunk `b` drawn lighter).
#
# * **GPipe** runs every forward, then every backward. Simple, but each stage must keep the inputs of
#   all m microbatches until their backward comes.
# * **1F1B** starts the backward of a microbatch as soon as it can and then alternates one forward
#   with one backward. Same length as GPipe, but stage s never holds more than p − s microbatches.
# * **Interleaved** gives each stage v chunks of layers (stage s holds chunks s and s + p). A
#   microbatch crosses the devices v times, in pieces v times shorter, so the fill and the drain are
#   shorter relative to the work.
# * **Zero-bubble (ZB-H1)** defers the weight gradients W into the drain, where stages would
#   otherwise idle.

# %%
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

COLOURS = {Op.F: "tab:blue", Op.B: "tab:orange", Op.W: "tab:green"}


def draw(ax, table, title):
    for s in range(table.stages):
        for t in range(table.ticks):
            op = Op(int(table.op[t, s]))
            if op == Op.IDLE:
                continue
            light = table.virtual_stages > 1 and table.chunk[t, s] == 1
            ax.add_patch(
                plt.Rectangle((t, s), 1, 1, facecolor=COLOURS[op], alpha=0.45 if light else 1.0, edgecolor="white")
            )
            ax.text(t + 0.5, s + 0.5, str(table.mb[t, s]), ha="center", va="center", fontsize=6, color="black")
    ax.set_ylim(table.stages, 0)
    ax.set_yticks([s + 0.5 for s in range(table.stages)], [f"stage {s}" for s in range(table.stages)])
    idle = (table.op == Op.IDLE).mean()
    ax.set_title(f"{title}: {table.ticks} ticks, {idle:.1%} of the cells idle", fontsize=9, loc="left")


fig, axes = plt.subplots(4, 1, figsize=(11, 7.5), sharex=True)
for ax, (name, table) in zip(axes, tables.items()):
    draw(ax, table, name)
axes[-1].set_xlim(0, max(t.ticks for t in tables.values()))
axes[-1].set_xlabel("tick")
fig.legend(handles=[Patch(color=c, label=op.name) for op, c in COLOURS.items()], loc="upper right", ncol=3)
plt.tight_layout(rect=(0, 0, 1, 0.96))
plt.show()

# %% [markdown]
# ## The bubble, counted and by formula
#
# If every operation lasts one tick, the bubble is simply the share of idle cells in the table.
# The closed forms (as `jaxpar.pipeline.bubble_formula` gives them, and the module docstring derives
# them) are:
#
# | schedule | bubble |
# |---|---|
# | GPipe, 1F1B | (p−1)/(m+p−1) |
# | interleaved, v chunks per stage | (p−1)/(v·m+p−1) |
# | zero-bubble (ZB-H1), F = B = W | (p−1)/(3m+p−1) |
#
# GPipe and 1F1B have the same bubble: 1F1B reorders the work but cannot shorten the fill and drain.
# Interleaving divides the fill and drain by v. Zero-bubble keeps the fill, but the deferred W's fill
# two thirds of the drain. Below, the idle share is counted directly from the table arrays and set
# beside the formula, for p = 4 and several m (m a multiple of p, as interleaved requires).

# %%
import numpy as np

from jaxpar.pipeline import bubble_formula

MS = [4, 8, 12, 16, 24, 32]
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zero_bubble": 1}  # name: chunks per stage
counted, formula = {}, {}
print(f"{'m':>3} " + " ".join(f"{name + ' counted / formula':>34}" for name in SCHEDULES))
for m in MS:
    row = []
    for name, v in SCHEDULES.items():
        table = build(name, P, m, virtual_stages=v)
        counted[name, m] = float((table.op == Op.IDLE).mean())  # idle cells / all cells
        formula[name, m] = float(bubble_formula(name, P, m, virtual_stages=v))
        row.append(f"{counted[name, m]:>16.4f} / {formula[name, m]:<15.4f}")
    print(f"{m:>3} " + " ".join(row))
worst = max(abs(counted[k] - formula[k]) for k in counted)
print(f"largest |counted - formula| over the grid: {worst:.1e}")

# %%
plt.figure(figsize=(7, 3.6))
styles = {
    "gpipe": ("tab:blue", "o"),
    "1f1b": ("tab:orange", "x"),
    "interleaved": ("tab:purple", "s"),
    "zero_bubble": ("tab:green", "^"),
}
dense_m = np.arange(4, 33)
for name, v in SCHEDULES.items():
    colour, marker = styles[name]
    plt.plot(MS, [counted[name, m] for m in MS], marker, color=colour, label=f"{name} (counted)")
    line_m = [int(m) for m in dense_m if v == 1 or m % P == 0]  # interleaved: multiples of p only
    plt.plot(line_m, [bubble_formula(name, P, m, virtual_stages=v) for m in line_m], "-", color=colour, lw=0.8)
plt.xlabel("microbatches m")
plt.ylabel("bubble (idle share)")
plt.ylim(0, 0.5)
plt.title("p = 4 stages: bubble against m (markers counted from tables, lines the closed forms)", fontsize=9)
plt.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# Equal durations are the simplest case. `Table.bubble_fraction` replays a table with real durations,
# each operation starting as soon as its stage is free and its input has arrived. With a backward
# twice as long as a forward (the usual rule of thumb), GPipe, 1F1B and interleaved keep the same
# bubble: fill and drain scale with F + B exactly as the work does. For zero-bubble the bubble
# depends on the durations; at F = B = W it is the (p−1)/(3m+p−1) above.

# %%
for name, v in SCHEDULES.items():
    table = build(name, P, 8, virtual_stages=v)
    times = dict(t_f=1, t_b=1, t_w=1) if table.split_backward else dict(t_f=1, t_b=2)
    print(
        f"{name:12s} m = 8, {times}: replayed {table.bubble_fraction(**times):.4f}, "
        f"formula {bubble_formula(name, P, 8, virtual_stages=v, **times):.4f}"
    )

# %% [markdown]
# ### Checking a claim: "PP = 4 with 4 microbatches wastes 43%"
#
# One of the background texts (about serving, so forward passes only) states that a 4-stage
# pipeline fed 4 microbatches still idles 43% of the time, and that a single request (m = 1) leaves
# 3 of 4 devices idle (75%). The forward half of a GPipe table is exactly such a pipeline, and the
# whole training table idles in the same proportion. Count both:

# %%
claim = build("gpipe", 4, 4)
single = build("gpipe", 4, 1)
forward_ticks = claim.op[: 4 + 4 - 1]  # until the last forward is done
assert (forward_ticks != Op.B).all()
idle_4x4 = int((claim.op == Op.IDLE).sum())
idle_forward = int((forward_ticks == Op.IDLE).sum())
print(claim.gantt())
print(
    f"p = 4, m = 4, forward half: {idle_forward} idle cells of {forward_ticks.size} = "
    f"{idle_forward / forward_ticks.size:.1%}"
)
print(f"p = 4, m = 4, whole step:   {idle_4x4} idle cells of {claim.op.size} = {idle_4x4 / claim.op.size:.1%}")
print(f"p = 4, m = 1: {(single.op == Op.IDLE).mean():.1%} idle")

bubble = lambda m: float((build("gpipe", 4, m).op == Op.IDLE).mean())
halving_m = next(m for m in range(4, 64) if bubble(m) <= bubble(4) / 2 + 1e-12)
print(
    f"doubling m: 4 -> 8 takes the bubble from {bubble(4):.1%} to {bubble(8):.1%}; "
    f"16 -> 32 from {bubble(16):.1%} to {bubble(32):.1%}"
)
print(f"the fewest microbatches that halve the m = 4 bubble: m = {halving_m} ({bubble(halving_m):.1%})")

# %% [markdown]
# Both numbers hold: 12 of 28 cells idle in the forward pipeline and 24 of 56 in the whole step, 3/7 =
# 42.9%, which the text rounds to 43%; with one microbatch, 75%. The same text says that halving the
# bubble at p = 4 takes "roughly double" the microbatches, and so twice the activations held. Not
# from m = 4: doubling to 8 leaves the bubble well above half, and it takes m = 11. The rule holds
# for large m, where (p−1)/(m+p−1) ≈ (p−1)/m and doubling m nearly halves the bubble. The memory
# half of the claim holds for GPipe only. The tables also count what each stage holds, the
# microbatches whose forward has run and whose backward has not:

# %%
for name, v in SCHEDULES.items():
    peaks = {m: build(name, P, m, virtual_stages=v).peak_in_flight.tolist() for m in (4, 8, 16)}
    print(f"{name:12s} most microbatch inputs held per stage, m = 4 / 8 / 16: {peaks}")

# %% [markdown]
# GPipe holds all m. 1F1B holds at most p − s on stage s, whatever m is, and zero-bubble at most p.
# Interleaved counts (microbatch, chunk) pairs, each half a stage's size. So under 1F1B more
# microbatches shrink the bubble without costing activation memory. The next section reads the same
# difference from the compiled program.
#
# ### In jaxpar's executor
#
# The bubbles above are the papers' ideal: every stage starts an operation the moment its input is
# there. jaxpar's executor runs all stages in lockstep, one program section per tick (it has to: a
# collective of another mesh axis inside a stage would hang if some stages skipped it), so a tick
# lasts as long as its slowest operation. With B = 2F, a 1F1B tick that mixes forwards and backwards
# costs a backward. The count below does this by hand from the table (the sum over ticks of the
# slowest operation, against the work) beside the library's `lockstep_bubble_fraction`, and adds
# `executor_bubble_fraction`, which also charges what the executor really runs in a tick with a W:
# a full backward, B + W.

# %%
from jaxpar.pipeline.executor import executor_bubble_fraction


def lockstep(table, cost):
    ticks = sum(max(cost[Op(int(o))] for o in row) for row in table.op)
    return 1 - sum(cost[Op(int(o))] for o in table.op.flat) / (table.stages * ticks)


executor = {}
for name, v in SCHEDULES.items():
    table = build(name, P, 8, virtual_stages=v)
    times = dict(t_f=1, t_b=1, t_w=1) if table.split_backward else dict(t_f=1, t_b=2)
    cost = {Op.IDLE: 0, Op.F: times["t_f"], Op.B: times["t_b"], Op.W: times.get("t_w", 0)}
    vjp = (1, 1, 2) if table.split_backward else (1, 2)  # the executor's sections: F, [B,] B + W
    executor[name] = executor_bubble_fraction(table, *vjp)
    print(
        f"{name:12s} p = 4, m = 8: ideal {table.bubble_fraction(**times):.1%}   lockstep "
        f"{lockstep(table, cost):.1%} counted, {table.lockstep_bubble_fraction(**times):.1%} library   "
        f"executor {executor[name]:.1%}"
    )

# %% [markdown]
# GPipe loses nothing to lockstep (its ticks are all forwards or all backwards). 1F1B's bubble rises
# from 27% to 40%, and interleaved's from 16% to 29%; zero-bubble keeps its 11% in lockstep but pays
# for its W ticks with a full backward in this executor (30%). In this executor GPipe has the
# smallest bubble of the four, at the price of holding all m stage inputs: the next section measures
# that price. docs/pipeline.md ("Benchmark") has the step times.
#
# ## Activation memory, read from the compiled train step
#
# Now the real program. The `pp` preset puts the `layers` axis of the stacked weights on the mesh
# axis `stage`; on 4 devices that is p = 4. The model is `tiny` with 4 layers (one per stage). Each
# microbatch has a fixed size (2 sequences of 64 tokens), so more microbatches means a bigger batch.
# The train step is compiled once per (schedule, m) from abstract shapes (nothing is allocated), and
# `memory_analysis()` gives the temporary memory XLA plans per device.
#
# What a stage keeps per microbatch in flight is its input, one [rows, tokens, embed] float32 array
# (the backward recomputes the stage's forward from it). GPipe should grow by one such array per extra
# microbatch; 1F1B should not grow.

# %%
import dataclasses
import functools
import time

from jaxpar.layout import make_layout
from jaxpar.meshes import PRESETS
from jaxpar.models import build_model, get_model_preset
from jaxpar.train.optim import OptimizerConfig, make_optimizer
from jaxpar.train.step import TrainState, batch_sharding, init_program, make_train_step

cfg = dataclasses.replace(get_model_preset("tiny"), num_layers=4)
ROWS, SEQ = 2, 64
stage_input = ROWS * SEQ * cfg.embed_dim * 4  # bytes of one float32 stage input
make_model = lambda r: build_model(cfg, rngs=r)
make_tx = functools.partial(make_optimizer, OptimizerConfig())


def compiled_step(schedule, m):
    """The pipelined train step for batch ROWS·m, compiled from shapes only."""
    layout = make_layout(cfg, PRESETS["pp"], batch=ROWS * m, seq=SEQ, devices=jax.devices()[:P])
    program = init_program(make_model, make_tx, layout)
    state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), program.abstract, program.shardings
    )
    ts = TrainState(program.graphdef, state, program.shardings)
    data = {k: jax.ShapeDtypeStruct((ROWS * m, SEQ), np.int32, sharding=s) for k, s in batch_sharding(layout).items()}
    return make_train_step(ts, layout, pipeline=build(schedule, P, m)).lower(state, data).compile(), layout


start = time.perf_counter()
MEM_MS = [4, 8, 16]
temp, steps = {}, {}
for schedule in ("gpipe", "1f1b"):
    for m in MEM_MS:
        steps[schedule, m], layout = compiled_step(schedule, m)
        temp[schedule, m] = steps[schedule, m].memory_analysis().temp_size_in_bytes
print(
    f"mesh {dict(layout.mesh.shape)}; one stage input = {stage_input / 1024:.0f} KiB; "
    f"{len(temp)} compiles in {time.perf_counter() - start:.0f} s"
)
for schedule in ("gpipe", "1f1b"):
    row = "  ".join(f"m={m}: {temp[schedule, m] / 2**20:.3f} MiB" for m in MEM_MS)
    growth = (temp[schedule, MEM_MS[-1]] - temp[schedule, MEM_MS[0]]) / (MEM_MS[-1] - MEM_MS[0])
    print(f"{schedule:6s} temp per device  {row}   growth {growth / stage_input:.3f} stage inputs per microbatch")

# %%
plt.figure(figsize=(6.5, 3.4))
for schedule, colour in (("gpipe", "tab:blue"), ("1f1b", "tab:orange")):
    plt.plot(MEM_MS, [temp[schedule, m] / 2**20 for m in MEM_MS], "o-", color=colour, label=f"{schedule} (compiled)")
base = temp["1f1b", MEM_MS[0]]
plt.plot(
    MEM_MS,
    [(base + (m - MEM_MS[0]) * stage_input) / 2**20 for m in MEM_MS],
    "k:",
    label="m=4 value + one stage input per extra microbatch",
)
plt.xlabel("microbatches m")
plt.ylabel("temp MiB per device")
plt.title("tiny, 4 stages, 2 × 64 tokens per microbatch: compiled temp memory", fontsize=9)
plt.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# GPipe's temporary memory grows by about one stage input per extra microbatch (a little more: the
# microbatch's token ids come along); 1F1B's barely moves (what it gains is the token ids of the
# larger batch). For this tiny model the stage inputs are small next to the rest of the step; for a
# large model at long sequence, m stage inputs is what decides whether GPipe fits.
#
# ## A pipelined step computes the same loss
#
# The pipeline changes where and when the work runs, not what is computed. Take the GPipe step at
# m = 4 compiled above, give it real parameters, and compare its loss with the same parameters'
# loss on one device over the same batch (a mean over equal microbatches is the mean over the batch).

# %%
from flax import nnx

from jaxpar.train.step import init_train_state, next_token_loss

m = 4
layout = make_layout(cfg, PRESETS["pp"], batch=ROWS * m, seq=SEQ, devices=jax.devices()[:P])
ts = init_train_state(make_model, make_tx, layout)
model, _ = nnx.merge(ts.graphdef, ts.state)
graphdef, weights = nnx.split(model)
weights = jax.tree.map(np.asarray, weights)  # a host copy: the step donates its state
tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (ROWS * m, SEQ + 1), dtype=np.int32)
batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
placed = {k: jax.device_put(v, s) for k, v, s in zip(batch, batch.values(), batch_sharding(layout).values())}
_, metrics = steps["gpipe", m](ts.state, placed)
pipelined = float(metrics.loss)

plain_model = nnx.merge(graphdef, weights)  # the same weights, as plain host arrays
unpipelined = float(nnx.jit(lambda model, b: next_token_loss(model, b)[0])(plain_model, batch))
print(
    f"pipelined (4 stages, GPipe, m = 4): {pipelined:.6f}   one device: {unpipelined:.6f}   "
    f"relative difference {abs(pipelined - unpipelined) / unpipelined:.1e}"
)

# %%
key_numbers = {
    "p": P,
    "bubble_counted": {f"{name}/m={m}": counted[name, m] for name, m in counted},
    "bubble_formula": {f"{name}/m={m}": formula[name, m] for name, m in formula},
    "claim_idle_cells": idle_4x4,
    "claim_cells": int(claim.op.size),
    "claim_forward_idle_cells": idle_forward,
    "claim_forward_cells": int(forward_ticks.size),
    "halving_m": halving_m,
    "single_microbatch_bubble": float((single.op == Op.IDLE).mean()),
    "peak_in_flight": {
        f"{name}/m={m}": build(name, P, m, virtual_stages=v).peak_in_flight.tolist()
        for name, v in SCHEDULES.items()
        for m in (4, 8, 16)
    },
    "stage_input_bytes": stage_input,
    "temp_bytes": {f"{schedule}/m={m}": temp[schedule, m] for schedule, m in temp},
    "executor_bubble": executor,
    "loss_pipelined": pipelined,
    "loss_one_device": unpipelined,
}
key_numbers
