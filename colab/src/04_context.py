# %% [markdown]
# # 04 · Context parallelism: ring attention, zig-zag balance, Ulysses
#
# Long sequences make attention the memory problem: one device computing causal attention over L
# tokens materialises L × L scores per head, and the activations of every layer grow with L.
# Context parallelism splits the *sequence* over a mesh axis (`sequence`) instead of the weights or
# the batch. Everything in a transformer layer except attention works on each position on its own,
# so only attention has to see other devices' tokens. jaxpar offers two ways to let it:
#
# * **ring attention** (`jaxpar/parallel/ring.py`): every device keeps its queries; the key/value
#   blocks travel around a ring of devices, one hop per step, and each device folds every visiting
#   block into an online softmax. No device ever holds more than its own share of K/V.
# * **Ulysses** (`jaxpar/parallel/ulysses.py`): an all-to-all swaps the split, from "every device
#   has L/n positions of all heads" to "every device has all L positions of N/n heads"; attention
#   runs locally per head, and a last all-to-all swaps back.
#
# This notebook follows the ring hop by hop, counts why the zig-zag token order balances causal
# work, reads per-device memory from compiled train steps against L, reads Ulysses' all-to-alls
# from the compiled program, and checks ring attention against plain dense attention.

# %%
from jaxpar.mesh import simulate_cpu_devices

simulate_cpu_devices(8)  # before any other JAX operation: the CPU shows up as 8 devices
import jax

print(jax.device_count(), "devices")

# %% [markdown]
# ## The ring, read from the compiled program
#
# The `cp` preset maps the logical axis `length` onto the mesh axis `sequence`, which takes all 8
# devices. We compile the forward pass of the `tiny` model with `execution.context_parallel=ring`
# (shapes only, nothing allocated) and read the compiled HLO: every K/V hop is a
# `collective-permute`, and its `source_target_pairs` say who sends to whom.

# %%
import re

import numpy as np
from flax import nnx

from jaxpar.analysis import analyze_compiled
from jaxpar.layout import make_layout
from jaxpar.meshes import PRESETS
from jaxpar.models import ExecutionConfig, build_model, get_model_preset

B, L = 2, 256


def compiled_forward(cfg, preset, execution, devices=None):
    """The model's forward (ids -> logits), run as ``execution`` says, under ``preset``, compiled from
    shapes only."""
    layout = make_layout(cfg, preset, batch=B, seq=L, devices=devices, execution=execution)
    with layout.activate():
        abstract = nnx.eval_shape(lambda: build_model(cfg, execution=execution, rngs=nnx.Rngs(0)))
        graphdef, state = nnx.split(abstract)
        state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
        forward = jax.jit(lambda s, x: nnx.merge(graphdef, s).forward(x).logits)
        ids = jax.ShapeDtypeStruct((B, L), np.int32, sharding=layout.sharding(("batch", "length")))
        compiled = forward.lower(state, ids).compile()
    return compiled, analyze_compiled(compiled, mesh=layout.mesh), layout


ring_cfg, ring_run = get_model_preset("tiny"), ExecutionConfig(context_parallel="ring")  # the model; how it runs
ring_program, ring_report, cp_layout = compiled_forward(ring_cfg, PRESETS["cp"], ring_run)
n = cp_layout.mesh.shape["sequence"]
hlo = ring_program.as_text()
PERMUTE = re.compile(r"collective-permute(?:-start)?\(.*?source_target_pairs=\{((?:\{\d+,\d+\},?)+)\}")
pair_lists = set(PERMUTE.findall(hlo))
assert len(pair_lists) == 1, pair_lists  # every hop of every layer uses the same ring
pairs = [tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}", pair_lists.pop())]
print(f"mesh {dict(cp_layout.mesh.shape)}; every collective-permute sends along {pairs}")

# %% [markdown]
# Device i sends to i + 1 (and the last back to the first). Partition i of this program runs on the
# device with `sequence` coordinate i, so following the pairs step by step tells which K/V block each
# device holds. Which *tokens* a block contains depends on the storage order. Split the sequence
# into 2n chunks of L/2n tokens:
#
# * **contiguous**: device d stores chunks 2d and 2d+1;
# * **zig-zag** (`execution.cp_order=zigzag`, the default): device d stores chunks d and 2n−1−d, one
#   early and one late. The model permutes the token ids once on entry
#   (`jaxpar.parallel.common.zigzag_order`) and the masks are built from each token's original index,
#   which travels with its K/V block.
#
# In the grids below a row is a device, a column a ring step (step 0: its own block), the label the
# chunks of the K/V block it holds, and the colour the share of that (query block × key block) tile
# that the causal mask leaves to compute (every query sees the keys at or before it).

# %%
import matplotlib.pyplot as plt

from jaxpar.parallel.common import zigzag_order


def held_blocks(pairs, n):
    """[step, device] -> index of the K/V block the device holds, following the sends step by step."""
    holder = np.arange(n)
    steps = [holder.copy()]
    for _ in range(n - 1):
        nxt = np.empty_like(holder)
        for src, dst in pairs:
            nxt[dst] = holder[src]
        holder = nxt
        steps.append(holder.copy())
    return np.array(steps)


def unmasked_share(q_tokens, k_tokens):
    """Share of (query, key) pairs of two token sets that causal attention computes (key <= query)."""
    return float((k_tokens[None, :] <= q_tokens[:, None]).mean())


held = held_blocks(pairs, n)
orders = {"contiguous": np.arange(L), "zig-zag": zigzag_order(L, n)}
chunk = L // (2 * n)
fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
share = {}
for ax, (name, order) in zip(axes, orders.items()):
    blocks = order.reshape(n, L // n)  # tokens stored on each device
    share[name] = np.array([[unmasked_share(blocks[d], blocks[held[s, d]]) for s in range(n)] for d in range(n)])
    image = ax.imshow(share[name], cmap="Blues", vmin=0, vmax=1)
    for d in range(n):
        for s in range(n):
            chunks = sorted(set(blocks[held[s, d]] // chunk))
            ax.text(
                s,
                d,
                ",".join(map(str, chunks)),
                ha="center",
                va="center",
                fontsize=7,
                color="white" if share[name][d, s] > 0.6 else "black",
            )
    ax.set_xticks(range(n))
    ax.set_yticks(range(n), [f"dev {d}" for d in range(n)])
    ax.set_xlabel("ring step")
    ax.set_title(f"{name}: chunks of the K/V block held", fontsize=9)
fig.colorbar(image, ax=axes, shrink=0.8, label="share of the tile left by the causal mask")
plt.show()

# %% [markdown]
# Under the contiguous order device 0 (the first tokens) has nothing to compute in the blocks that
# visit it: every key they carry comes after all of its queries. Device 7 computes every visiting
# tile in full. Under zig-zag each device holds one early and one late chunk, and every visiting
# block is exactly half live: its early chunk lies before the device's late chunk, its late chunk
# never before the device's early chunk, and of the two remaining quarters (early with early, late
# with late) exactly one is live. Only the device's own block, at step 0, differs a little, by its
# diagonal.
#
# ## Work per device, counted
#
# Two counts per device: the (query, key) score entries the causal mask leaves, counted exactly from
# the token indices above; and the (query-half, key-half) tile pairs the kernel actually computes,
# from `jaxpar.parallel.ring.ring_work`, which applies the kernel's own skip rule (a pair is skipped
# only when its mask is entirely empty).

# %%
from jaxpar.parallel.ring import ring_work

entries = {name: share[name].sum(axis=1) * (L // n) ** 2 for name in orders}  # unmasked entries per device
pairs_computed = {"contiguous": ring_work(L, n, "contiguous"), "zig-zag": ring_work(L, n, "zigzag")}
for name in orders:
    print(
        f"{name:10s} unmasked entries per device {entries[name].astype(int).tolist()}  "
        f"max/mean {entries[name].max() / entries[name].mean():.3f}"
    )
    print(
        f"{'':10s} half-block pairs computed   {pairs_computed[name].tolist()}  "
        f"max/mean {pairs_computed[name].max() / pairs_computed[name].mean():.3f}"
    )
print(f"total unmasked entries {int(entries['contiguous'].sum())} = L(L+1)/2 = {L * (L + 1) // 2}")

fig, axes = plt.subplots(1, 2, figsize=(11, 3.2))
width = 0.4
for ax, (what, data) in zip(axes, (("unmasked score entries", entries), ("half-block pairs computed", pairs_computed))):
    for i, name in enumerate(orders):
        ax.bar(np.arange(n) + (i - 0.5) * width, data[name], width, label=name)
    ax.set_xticks(range(n), [f"dev {d}" for d in range(n)], fontsize=8)
    ax.set_title(f"causal attention, L = {L}, n = {n}: {what}", fontsize=9)
axes[0].legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# A ring step takes as long as its slowest device, so the step time follows the maximum. Under the
# contiguous order device d holds chunks 2d and 2d+1, and a kv half is live for a query half when it
# does not come after it: (2d+1) + (2d+2) = 4d+3 half-pairs, a max/mean of (4n−1)/(2n+1), 1.82 at
# n = 8, close to the 2 of the exact entry count. Under zig-zag device d holds chunks d and 2n−1−d:
# (d+1) + (2n−d) = 2n+1 half-pairs on every device, a max/mean of exactly 1, with the same total.
# The unmasked entries tell the same story: the total is the causal triangle L(L+1)/2 in both orders,
# and zig-zag spreads it evenly.
#
# ## Memory per device against L, from the compiled train step
#
# Now the full train step (forward, backward, AdamW update) of `tiny`, batch 1, compiled from shapes
# for three sequence lengths: on one device without context parallelism, and under `cp` with ring
# attention over 8 devices. `memory_analysis()` gives each device's planned temporary memory; the
# arguments (weights and optimizer state, the same in both) are listed apart.

# %%
import dataclasses
import functools
import time

from jaxpar.mesh import MeshConfig
from jaxpar.train.optim import OptimizerConfig, make_optimizer
from jaxpar.train.step import TrainState, batch_sharding, init_program, make_train_step

LENGTHS = [1024, 2048, 4096]
ONE_DEVICE = dataclasses.replace(PRESETS["dp"], mesh=MeshConfig())


def step_memory(cfg, preset, length, devices=None, execution=None):
    layout = make_layout(cfg, preset, batch=1, seq=length, devices=devices, execution=execution)
    program = init_program(
        lambda r: build_model(cfg, execution=execution, rngs=r),
        functools.partial(make_optimizer, OptimizerConfig()),
        layout,
    )
    state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), program.abstract, program.shardings
    )
    data = {k: jax.ShapeDtypeStruct((1, length), np.int32, sharding=s) for k, s in batch_sharding(layout).items()}
    step = make_train_step(TrainState(program.graphdef, state, program.shardings), layout)
    stats = step.lower(state, data).compile().memory_analysis()
    return stats.temp_size_in_bytes, stats.argument_size_in_bytes


start = time.perf_counter()
memory = {}
for length in LENGTHS:
    memory["one device", length] = step_memory(get_model_preset("tiny"), ONE_DEVICE, length, jax.devices()[:1])
    memory["cp ring", length] = step_memory(ring_cfg, PRESETS["cp"], length, execution=ring_run)
print(f"{len(memory)} compiles in {time.perf_counter() - start:.0f} s")
cfg = ring_cfg
for length in LENGTHS:
    one, ring = memory["one device", length][0], memory["cp ring", length][0]
    scores = cfg.num_heads * length**2 * 4  # one fp32 [N, L, L] score matrix
    tile = cfg.num_heads * (length // (2 * n)) ** 2 * 4  # one fp32 score tile of a half pair
    print(
        f"L = {length:5d}: temp one device {one / 2**20:8.1f} MiB ({one / scores:.1f} score matrices)   "
        f"cp ring {ring / 2**20:6.2f} MiB per device ({ring / tile:.1f} half-pair tiles)   ratio {one / ring:.0f}x"
    )
print(
    f"arguments (weights + AdamW state): one device {memory['one device', LENGTHS[0]][1] / 2**20:.2f} MiB, "
    f"cp ring {memory['cp ring', LENGTHS[0]][1] / 2**20:.2f} MiB per device"
)

# %%
plt.figure(figsize=(6.5, 3.6))
for name, colour in (("one device", "tab:red"), ("cp ring", "tab:blue")):
    plt.loglog(
        LENGTHS,
        [memory[name, length][0] / 2**20 for length in LENGTHS],
        "o-",
        color=colour,
        label=f"{name} (compiled temp)" + (f", per device of {n}" if name == "cp ring" else ""),
    )
plt.loglog(
    LENGTHS, [cfg.num_heads * length**2 * 4 / 2**20 for length in LENGTHS], "k:", label="one fp32 N·L² score matrix"
)
plt.loglog(
    LENGTHS,
    [cfg.num_heads * (length // (2 * n)) ** 2 * 4 / 2**20 for length in LENGTHS],
    ":",
    color="tab:blue",
    label="one fp32 N·(L/2n)² tile (one half pair)",
)
plt.xticks(LENGTHS, [str(x) for x in LENGTHS])
plt.minorticks_off()
plt.xlabel("sequence length L")
plt.ylabel("MiB per device")
plt.title("tiny train step, batch 1: temporary memory per device", fontsize=9)
plt.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# On one device the step's temporary memory is a few L × L score matrices and grows four-fold with
# every doubling of L. Under the ring each device holds its L/n share of the activations plus the
# scores of one (query-half, key-half) tile at a time, (L/2n)² per head: 4n² = 256 times smaller than
# the full matrix, though still quadratic in L (the kernel does not split its local block further,
# flash-style). The per-device memory falls by far more than n here because attention scores
# dominate this small model; with wide layers the O(L/n) activations would dominate instead, and
# the saving would tend towards n.
#
# ### Checking a claim: "linear scaling with context size"
#
# The background texts credit ring attention and Ulysses with linear scaling in the context length.
# Read from the same compiled steps, per doubling of L:

# %%
for name in ("one device", "cp ring"):
    growth = [memory[name, b][0] / memory[name, a][0] for a, b in zip(LENGTHS, LENGTHS[1:])]
    print(f"{name:10s} temp per device grows x{' then x'.join(f'{g:.2f}' for g in growth)} per doubling of L")

# %% [markdown]
# At a fixed number of devices the ring's temporary memory grows faster than L (a linear cost would
# double): the O(L/n) part doubles, the (L/2n)² tiles quadruple, and at L = 4096 the tiles already
# dominate. So the claim holds for what the ring moves and stores per token (its K/V blocks, its
# traffic) and for memory when n grows with L (L/n fixed), not for this kernel's scratch at fixed n.
# A kernel that also splits its local block into fixed-size tiles, as flash attention does, would
# make it linear.
#
# ## Ulysses: four all-to-alls per layer
#
# Ulysses needs the heads to divide over the sequence axis: each device takes N/n query heads and
# K/n kv heads. `tiny` has N = 8 query heads; with K = 4 kv heads it can run on a ring of 4, so this
# uses the `cp` preset on 4 devices. In the forward pass each layer should show four all-to-alls,
# for Q, K, V (sequence-split to head-split) and the output (back). An all-to-all leaves each device
# with as many bytes as it had: per device, per layer, B·(L/n)·N·H·4 bytes for Q and for the output and
# B·(L/n)·K·H·4 for K and for V.

# %%
uly_cfg = get_model_preset("tiny", num_kv_heads=4)
ulysses = ExecutionConfig(context_parallel="ulysses")
_, uly_report, uly_layout = compiled_forward(uly_cfg, PRESETS["cp"], ulysses, devices=jax.devices()[:4])
un = uly_layout.mesh.shape["sequence"]
for c in uly_report.ops:
    print(f"{c.kind:14s} axes {c.axes}  {c.bytes:6d} bytes  x{c.executions}")
a2a_count = uly_report.collectives.count("all-to-all")
a2a_bytes = uly_report.collectives.bytes("all-to-all")
H = uly_cfg.head_dim
per_layer = B * (L // un) * H * 4 * (2 * uly_cfg.num_heads + 2 * uly_cfg.num_kv_heads)
print(
    f"all-to-alls: {a2a_count} (formula 4 x {uly_cfg.num_layers} layers = {4 * uly_cfg.num_layers}), "
    f"{a2a_bytes} bytes (formula {uly_cfg.num_layers} x {per_layer} = {uly_cfg.num_layers * per_layer})"
)

# %% [markdown]
# Count and bytes are the formula's. The one all-gather is the int32 token indices (each device needs
# every token's original position to build the causal mask over the whole sequence); it is the same
# for every layer, so the compiler computes it once. For comparison, the ring's forward above moves
# K/V blocks in n − 1 hops per layer (in halves, so that empty causal halves can be skipped), with
# their int32 token indices:

# %%
ring_bytes = ring_report.collectives.bytes("collective-permute")
kv_formula = ring_cfg.num_layers * (n - 1) * 2 * B * (L // n) * ring_cfg.num_kv_heads * ring_cfg.head_dim * 4
idx_formula = ring_cfg.num_layers * (n - 1) * B * (L // n) * 4
print(
    f"ring: {ring_report.collectives.count('collective-permute')} collective-permutes, {ring_bytes} bytes; "
    f"formula: K/V {kv_formula} + indices {idx_formula} = {kv_formula + idx_formula}"
)

# %% [markdown]
# The trade: Ulysses moves each device's Q, K, V and output once per layer, in collectives that span
# the whole `sequence` group, and needs the heads to divide by n; the ring moves only K/V, in n − 1
# neighbour-to-neighbour hops that can overlap with the block computations, and works for any head
# count.
#
# ## Ring attention equals dense attention
#
# Last, the kernel itself on a small case: batch 2, L = 64, 8 query heads over 2 kv heads (GQA),
# split over a ring of 4 devices in zig-zag order. The reference is `jax.nn.dot_product_attention`
# with a causal mask, on one device, in natural order; the gradients with respect to q, k and v are
# compared too (the ring's backward is a second ring).

# %%
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxpar.parallel.ring import ring_attention

rn, Ls, N, K, Hd = 4, 64, 8, 2, 8
rng = np.random.default_rng(0)
q, cot = (rng.standard_normal((2, Ls, N, Hd), np.float32) for _ in range(2))
k, v = (rng.standard_normal((2, Ls, K, Hd), np.float32) for _ in range(2))
ring_mesh = jax.make_mesh((rn,), ("sequence",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:rn])
order = zigzag_order(Ls, rn)  # stored position p holds token order[p]
index = np.broadcast_to(order.astype(np.int32), (2, Ls))
seq, idx = PartitionSpec(None, "sequence", None, None), PartitionSpec(None, "sequence")
ring_fn = jax.shard_map(
    lambda q, k, v, i: ring_attention(q, k, v, i, i, axis_name="sequence"),
    mesh=ring_mesh,
    in_specs=(seq, seq, seq, idx),
    out_specs=seq,
)


@jax.jit
def ring_natural(q, k, v):
    """Store in zig-zag order, run the ring, return the output in natural order."""
    out = ring_fn(q[:, order], k[:, order], v[:, order], index)
    return out[:, np.argsort(order)]


dense = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))
errors = {}
for name, fn in (("ring", ring_natural), ("dense", dense)):
    out, vjp = jax.vjp(fn, q, k, v)
    errors[name] = (out, *vjp(cot))
ring_error = {what: float(jnp.abs(a - b).max()) for what, a, b in zip(("out", "dq", "dk", "dv"), *errors.values())}
print("largest |ring - dense|:", {w: f"{e:.1e}" for w, e in ring_error.items()})

# %%
key_numbers = {
    "n": n,
    "L": L,
    "ring_pairs": pairs,
    "held": held.tolist(),
    "unmasked_entries": {name: entries[name].astype(int).tolist() for name in orders},
    "pairs_computed": {name: pairs_computed[name].tolist() for name in orders},
    "temp_bytes": {f"{name}/L={length}": memory[name, length][0] for name, length in memory},
    "ring_permute_bytes": int(ring_bytes),
    "ring_permute_count": ring_report.collectives.count("collective-permute"),
    "ulysses": {
        "n": un,
        "all_to_all_count": a2a_count,
        "all_to_all_bytes": int(a2a_bytes),
        "batch": B,
        "length": L,
        "heads": uly_cfg.num_heads,
        "kv_heads": uly_cfg.num_kv_heads,
        "head_dim": H,
        "layers": uly_cfg.num_layers,
    },
    "model": {
        "heads": ring_cfg.num_heads,
        "kv_heads": ring_cfg.num_kv_heads,
        "head_dim": ring_cfg.head_dim,
        "layers": ring_cfg.num_layers,
    },
    "ring_vs_dense_max_error": ring_error,
}
key_numbers
