# %% [markdown]
# # 05 · Experts: routing, capacity, the all-to-all, expert choice and dropless
#
# A mixture-of-experts (MoE) layer swaps the one dense MLP of a transformer block for E smaller MLPs,
# the *experts*, and a *router* that sends each token to k of them. The parameters grow with E while
# the work per token grows only with k. The catch is in moving tokens around: with the experts spread
# over devices (expert parallelism), every token travels to the devices of its experts and back, and
# an expert that many tokens want either overflows or makes everyone wait.
#
# This notebook measures each piece on jaxpar's MoE layer (`jaxpar.layers.MoE`) and on the `tiny-moe`
# model:
#
# 1. what a router does: top-k gates per token, and how many tokens each expert gets;
# 2. capacity: a fixed number of slots per expert, and the share of tokens dropped when a few experts
#    are *hot*, against the capacity factor;
# 3. the all-to-all of expert parallelism, read from the compiled program and compared with the formula;
# 4. token choice against expert choice: which one balances the experts, and what it costs;
# 5. dropless execution: no slot limit, and the same result as computing every expert densely.

# %%
from jaxpar.mesh import simulate_cpu_devices

simulate_cpu_devices(8)  # before any other JAX operation: the CPU shows up as 8 devices
import dataclasses

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx

from jaxpar.layers.moe import MoE, capacity
from jaxpar.models import get_execution_preset, get_model_preset

print(jax.device_count(), "devices")

# %% [markdown]
# ## 1 · What a router does
#
# The router is one matrix, `[D, E]`. Each token's vector `x` gives E logits `x @ router`; with the
# `softmax` router (Mixtral, Qwen3-MoE) the layer keeps the k experts with the highest probability and
# renormalises their k probabilities to sum to 1: these are the token's *gates*. The layer's output for
# the token is the gate-weighted sum of its k experts' outputs.
#
# We take `tiny-moe`'s MoE layer (width D = 64, expert MLP width 64, top-2) and widen it to 16 experts,
# then feed it 8 sequences of 256 random token vectors. To make some experts *hot* later on, one input
# feature is held at 1 and its router row adds `skew` nats to the logits of the first two experts:
# `skew = 0` is an unbiased random router.
#
# The next cell routes the tokens with a few lines of numpy (the rule above, written out) and checks
# that they agree with the per-expert counts the jaxpar layer reports (`MoEStats.expert_load`).

# %%
tiny = get_model_preset("tiny-moe")
tiny_run = get_execution_preset("tiny-moe")  # how it runs: capacity factor 2, the loss weights
D, E, K = tiny.embed_dim, 16, 2
B, T = 8, 256  # 8 sequences (capacity groups) of 256 tokens
HOT = 2  # experts 0 and 1 get the skew

x = np.random.default_rng(0).normal(size=(B, T, D)).astype(np.float32)
x[..., 0] = 1.0  # the constant feature the skew rides on
base_router = np.random.default_rng(1).normal(size=(D, E)).astype(np.float32) / np.sqrt(D - 1)
base_router[0] = 0.0


def moe_layer(skew=0.0, capacity_factor=tiny_run.capacity_factor, **moe_fields):
    """tiny-moe's MoE layer with 16 experts (and any MoEConfig field changed) run at `capacity_factor` (an
    execution setting; None: dropless), router skewed by `skew` nats."""
    cfg = dataclasses.replace(tiny.moe, num_experts=E, top_k=K, **moe_fields)
    run = dataclasses.replace(tiny_run, capacity_factor=capacity_factor)
    layer = MoE(D, cfg, execution=run, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    router = base_router.copy()
    router[0, :HOT] = skew
    layer.router[...] = router
    return layer


run = nnx.jit(lambda layer, x: layer(x))  # compiles once per shape (capacity) and router kind


def route(router):
    """softmax top-k in numpy: expert ids [B, T, k] and gates [B, T, k] (renormalised over the k)."""
    logits = x @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    idx = np.argsort(-probs, axis=-1, kind="stable")[..., :K]
    gates = np.take_along_axis(probs, idx, -1)
    return idx, gates / gates.sum(-1, keepdims=True), probs


def counts_per_sequence(idx):
    """Assignments per (sequence, expert): the load capacity acts on."""
    return np.stack([np.bincount(idx[b].ravel(), minlength=E) for b in range(B)])


layer = moe_layer(0.0, capacity_factor=1.25)
_, stats = run(layer, x)
idx, gates, _ = route(np.asarray(layer.router[...]))
for t in range(4):
    print(f"token {t}: experts {idx[0, t].tolist()}  gates {[f'{g:.3f}' for g in gates[0, t]]}")
load = np.asarray(stats.expert_load)
print("assignments per expert (jaxpar):", load.astype(int).tolist())
assert np.array_equal(counts_per_sequence(idx).sum(0), load)  # numpy's routing = the layer's

# %% [markdown]
# Each of the B·T = 2,048 tokens makes k = 2 assignments, so a perfectly balanced router would give every
# expert 2,048·2/16 = 256. A random router is already uneven; with a skew of 1 nat, the two hot experts
# take several times their share. The red line is what each expert can take at capacity factor 1.25
# (next section): everything above it is dropped.

# %%
loads = {}
for skew in (0.0, 1.0):
    loads[skew] = counts_per_sequence(route(np.asarray(moe_layer(skew).router[...]))[0]).sum(0)
cap_125 = B * capacity(T, dataclasses.replace(tiny.moe, num_experts=E, top_k=K), 1.25)

fig, axes = plt.subplots(1, 2, figsize=(10, 3), sharey=True)
for ax, (skew, per_expert) in zip(axes, loads.items()):
    ax.bar(range(E), per_expert, color=["tab:red" if e < HOT and skew else "tab:blue" for e in range(E)])
    ax.axhline(B * T * K / E, color="k", ls=":", label="balanced: N·k/E")
    ax.axhline(cap_125, color="r", ls="--", label="capacity at cf 1.25 (all sequences)")
    ax.set_title(f"router skew {skew:g} nat: assignments per expert")
    ax.set_xlabel("expert")
axes[0].set_ylabel("assignments")
axes[0].legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 2 · Capacity factor against dropped tokens
#
# To keep shapes static (and the all-to-all of section 3 a fixed size), jaxpar's capacity mode gives each
# expert C = ⌈cf · T · k / E⌉ slots per sequence, cf being the *capacity factor*. Within a sequence,
# assignments fill the slots in priority order (every token's first choice in token order, then every
# second choice); an assignment that finds its expert full is *dropped*: it contributes zero (the gates
# that survive are not renormalised, and a token that loses all k passes on its residual connection
# alone). Nothing fails and no error is raised, which is why jaxpar logs `dropped_fraction` at every
# training step.
#
# How many drop follows from the per-sequence counts alone: an expert that receives n assignments in a
# sequence drops max(0, n − C) of them. Below, the layer runs for 6 capacity factors and 4 skews, and the
# dropped fraction it reports is compared with that count.

# %%
FACTORS = [1.0, 1.25, 1.5, 2.0, 3.0, 4.0]
SKEWS = [0.0, 0.5, 1.0, 2.0]
dropped, slots, per_sequence, hottest = {}, {}, {}, {}
for skew in SKEWS:
    per_sequence[skew] = counts_per_sequence(route(np.asarray(moe_layer(skew).router[...]))[0])
    hottest[skew] = per_sequence[skew].sum(0).max() / (B * T * K)
    for cf in FACTORS:
        layer = moe_layer(skew, capacity_factor=cf)
        _, stats = run(layer, x)
        dropped[skew, cf] = float(stats.dropped_fraction)
        slots[cf] = capacity(T, layer.cfg, layer.execution.capacity_factor)
        by_count = np.maximum(per_sequence[skew] - slots[cf], 0).sum() / (B * T * K)
        assert abs(dropped[skew, cf] - by_count) < 1e-6, (skew, cf, dropped[skew, cf], by_count)

print("cf     C  " + "".join(f"skew {s:<4g}" for s in SKEWS))
for cf in FACTORS:
    print(f"{cf:<5g}{slots[cf]:>4d}  " + "".join(f"{dropped[s, cf]:>9.1%}" for s in SKEWS))
print(
    "hottest expert's share of assignments:",
    {s: round(float(h), 3) for s, h in hottest.items()},
    f"(balanced: {1 / E:.4f})",
)

plt.figure(figsize=(6, 3.5))
for skew in SKEWS:
    plt.plot(
        FACTORS,
        [100 * dropped[skew, cf] for cf in FACTORS],
        "o-",
        label=f"skew {skew:g} nat (hottest expert {hottest[skew]:.0%})",
    )
plt.xlabel("capacity factor")
plt.ylabel("assignments dropped (%)")
plt.title("Dropped assignments, measured by the MoE layer")
plt.legend(fontsize=8)
plt.grid(alpha=0.3)
plt.tight_layout()
plt.show()

# %% [markdown]
# With an unbiased router a little headroom is enough: a few percent drop at cf 1.25 and nothing from
# cf 2. With hot experts the curve flattens: when one expert wants a third of all assignments, even cf 4
# cannot hold them, and most of what is lost comes back only when C reaches the hottest expert's load.
# Raising the capacity factor also raises the memory and the all-to-all bytes (section 3) for every
# expert, to serve the few hot ones. The remedies are balancing the router (jaxpar's auxiliary loss, or
# DeepSeek's selection bias, `bias_update_rate`), expert choice (section 4), or dropless execution
# (section 5).
#
# ## 3 · The all-to-all of expert parallelism
#
# Under a layout with an `expert` mesh axis, each device holds E/ep of the experts and a slice of the
# batch. The layer packs its tokens into a `[groups, E, C, D]` buffer; one all-to-all over `expert`
# splits the buffer by expert and gathers the groups, the local experts run, and the inverse all-to-all
# returns the results. Each all-to-all sends (ep−1)/ep of the local buffer. With the two transposes of
# the backward pass, one device sends, per MoE layer and step,
#
# $$4 \cdot \frac{ep-1}{ep} \cdot T_\text{dev} \cdot k \cdot cf \cdot D \cdot b$$
#
# bytes, with T_dev the tokens on a device, cf the effective capacity factor (E·C slots per sequence
# over T·k) and b the bytes per element (`jaxpar.parallel.moe.a2a_bytes_formula`). We compile the full
# training step of `tiny-moe` (2 MoE layers, E = 4, top-2, cf = 2) under `data=2,expert=4` from abstract
# inputs, and read its collectives from the compiled HLO (`jaxpar.analysis.analyze_compiled`).

# %%
import math

from jaxpar.analysis import analyze_compiled
from jaxpar.analysis.plan import compile_step
from jaxpar.layout import make_layout
from jaxpar.meshes import resolve_mesh_arg
from jaxpar.parallel.moe import a2a_bytes_formula

cfg, step_run = tiny, dataclasses.replace(tiny_run, remat="none")
STEP_B, STEP_T = 8, 32
layout = make_layout(cfg, resolve_mesh_arg("data=2,expert=4"), batch=STEP_B, seq=STEP_T, execution=step_run)
compiled = compile_step(cfg, layout, batch=STEP_B, seq=STEP_T, execution=step_run)
report = analyze_compiled(compiled, mesh=layout.mesh)
a2a = [op for op in report.ops if op.kind == "all-to-all"]
for op in a2a:
    print(f"{op.name:16s} over {op.axes}  result {op.bytes:,} B  shapes {op.shapes}  runs {op.executions}×")
step_sent = sum(op.sent_bytes * op.executions for op in a2a)
moe = cfg.moe
step_slots = moe.num_experts * math.ceil(step_run.capacity_factor * STEP_T * moe.top_k / moe.num_experts)
step_formula = cfg.num_moe_layers * a2a_bytes_formula(
    tokens_per_device=STEP_B * STEP_T // layout.mesh.size,
    top_k=moe.top_k,
    capacity_factor=step_slots / (STEP_T * moe.top_k),
    embed_dim=cfg.embed_dim,
    ep=4,
    bytes_per_element=4,
)
print(f"all-to-all bytes sent per device per step: {step_sent:,.0f} (compiled)  {step_formula:,.0f} (formula)")

# %% [markdown]
# Every all-to-all runs over the `expert` axis alone, four per MoE layer (dispatch and combine, forward
# and backward; each instruction runs twice, once per layer of the scanned stack), and the bytes are the
# formula's. The factor (ep−1)/ep is the share of the buffer that leaves the device: it grows towards 1
# as the expert axis widens. The expert layer alone (`jaxpar.parallel.moe.experts_apply`, forward and
# gradient, 16 groups of 8 experts × 32 slots × D = 64) on 8 devices split as `data=8/ep, expert=ep`:

# %%
from jaxpar.mesh import build_mesh
from jaxpar.parallel.moe import experts_apply
from jaxpar.rules import use_layout

G, EL, C, F = 16, 8, 32, tiny.moe.mlp_dim
abstract = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
ep_sent = {}
for ep in (2, 4, 8):
    preset = resolve_mesh_arg(f"data={8 // ep},expert={ep}" if ep < 8 else "expert=8")
    mesh, rules = build_mesh(preset.mesh), preset.rules
    spec = lambda *names, mesh=mesh, rules=rules: jax.sharding.NamedSharding(mesh, rules.spec(names))
    shardings = (
        spec("batch", None, None, "act_embed"),
        spec("experts", "embed", None, "mlp"),
        spec("experts", "mlp", "embed"),
    )
    with use_layout(mesh, rules):
        fn = jax.jit(
            jax.value_and_grad(lambda b, g, d: jnp.sum(experts_apply(b, g, d)), argnums=(0, 1, 2)),
            in_shardings=shardings,
        )
        ops = analyze_compiled(
            fn.lower(abstract(G, EL, C, D), abstract(EL, D, 2, F), abstract(EL, F, D)).compile(), mesh=mesh
        ).ops
    ep_sent[ep] = sum(op.sent_bytes * op.executions for op in ops if op.kind == "all-to-all")

rows_per_device = G // 8 * EL * C  # slots a device holds: T_dev · k · cf
formula = lambda ep: a2a_bytes_formula(
    tokens_per_device=rows_per_device, top_k=1, capacity_factor=1.0, embed_dim=D, ep=ep, bytes_per_element=4
)
for ep, sent in ep_sent.items():
    print(f"ep={ep}: {sent:,.0f} bytes sent (compiled), formula {formula(ep):,.0f}")

eps = np.linspace(1, 8, 50)
plt.figure(figsize=(5.5, 3.2))
plt.plot(eps, [formula(e) / 1e3 for e in eps], "k-", label="4·(ep−1)/ep · rows · D · 4 B")
plt.plot(list(ep_sent), [v / 1e3 for v in ep_sent.values()], "o", ms=9, label="compiled (experts_apply)")
plt.xlabel("expert-parallel degree ep")
plt.ylabel("kB sent per device")
plt.title("All-to-all bytes: compiled program vs formula")
plt.legend(fontsize=8)
plt.grid(alpha=0.3)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 4 · Token choice against expert choice
#
# Everything so far is *token choice*: each token picks its k experts, and the experts take what comes.
# *Expert choice* (Zhou et al., 2022) turns it around: each expert picks the C tokens of a sequence that
# score it highest. Every expert then does exactly C tokens of work, by construction, and nothing
# overflows; the price moves to the tokens, which get anywhere from 0 to E experts. jaxpar implements it
# as a router of the same layer (`MoEConfig(router="expert_choice")`). Its `dropped_fraction` is the
# share of tokens that no expert took.
#
# We compare the two at the same compute: cf = 1 for both, so both fill at most E·C = T·k slots per
# sequence, on the router with a 1-nat skew. For token choice, numpy replays the slot rule of section 2
# to see which assignments survive; for expert choice, numpy picks each expert's top C tokens, and the
# share of tokens left with none is checked against the layer's report.

# %%
SKEW = 1.0
tc_layer, ec_layer = moe_layer(SKEW, capacity_factor=1.0), moe_layer(SKEW, capacity_factor=1.0, router="expert_choice")
(_, tc_stats), (_, ec_stats) = run(tc_layer, x), run(ec_layer, x)
c1 = capacity(T, tc_layer.cfg, 1.0)
assert capacity(T, ec_layer.cfg, 1.0) == c1 and E * c1 == T * K  # same slots, same compute

idx, _, probs = route(np.asarray(tc_layer.router[...]))
choice_major = idx.transpose(0, 2, 1).reshape(B, K * T)  # all 1st choices, then all 2nd
hot = np.eye(E, dtype=int)[choice_major]  # [B, k·T, E]
slot = ((np.cumsum(hot, axis=1) * hot).sum(-1) - 1).reshape(B, K, T).transpose(0, 2, 1)
tc_kept = (slot < c1).sum(-1)  # experts each token keeps: 0..k
tc_load = np.bincount(idx[slot < c1], minlength=E)  # assignments each expert runs

ec_pick = np.argsort(-probs, axis=1, kind="stable")[:, :c1, :]  # [B, C, E]: each expert's C tokens
ec_experts = np.zeros((B, T), int)
for b in range(B):
    np.add.at(ec_experts[b], ec_pick[b].ravel(), 1)  # experts each token got: 0..E
ec_load = np.full(E, B * c1)

assert abs((1 - tc_kept.sum() / (B * T * K)) - float(tc_stats.dropped_fraction)) < 1e-6
assert abs(np.mean(ec_experts == 0) - float(ec_stats.dropped_fraction)) < 1e-6
balance = {
    "token choice": dict(
        max_over_mean_demand=float(loads[SKEW].max() / loads[SKEW].mean()),
        slots_used=float(tc_load.sum() / (E * B * c1)),
        tokens_without_expert=float(np.mean(tc_kept == 0)),
    ),
    "expert choice": dict(
        max_over_mean_demand=float(ec_load.max() / ec_load.mean()),
        slots_used=float(ec_load.sum() / (E * B * c1)),
        tokens_without_expert=float(ec_stats.dropped_fraction),
    ),
}
for name, v in balance.items():
    print(
        f"{name:14s} busiest expert / mean {v['max_over_mean_demand']:.2f}   slots used {v['slots_used']:.1%}"
        f"   tokens with no expert {v['tokens_without_expert']:.1%}"
    )

fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.2))
left.bar(np.arange(E) - 0.2, loads[SKEW], 0.4, label="token choice: wanted")
left.bar(np.arange(E) + 0.2, ec_load, 0.4, label="expert choice: taken")
left.axhline(B * c1, color="r", ls="--", label="capacity (cf 1)")
left.set_xlabel("expert")
left.set_ylabel("tokens")
left.set_title("Load per expert, skew 1 nat")
left.legend(fontsize=8)
n = ec_experts.max() + 1
right.bar(np.arange(n) - 0.2, np.bincount(tc_kept.ravel(), minlength=n), 0.4, label="token choice: experts kept")
right.bar(
    np.arange(n) + 0.2, np.bincount(ec_experts.ravel(), minlength=n), 0.4, label="expert choice: experts received"
)
right.set_xlabel("experts per token")
right.set_ylabel("tokens")
right.legend(fontsize=8)
right.set_title("What each token gets")
plt.tight_layout()
plt.show()

# %% [markdown]
# Expert choice is perfectly balanced, which is what the "better load balancing than top-k" claim means:
# every slot is used and the busiest expert does the mean's work, so under expert parallelism no device
# waits for a hot one. But the imbalance does not vanish, it moves: tokens that rank high for several
# experts get several, and a share of tokens gets none. Token choice at the same compute leaves some
# slots empty (the cold experts') and drops assignments at the hot ones; run dropless under expert
# parallelism, the device of its busiest expert would do the printed busiest-over-mean multiple of the
# mean's work while the others wait. Expert choice has its own limit: which experts a token gets depends on
# the other tokens of its sequence, later ones included, so it does not carry over as it is to
# generating one token at a time.
#
# ## 5 · Dropless: no slot limit, the dense result
#
# With `capacity_factor=None` the layer runs every assignment: it sorts the N·k assignments by expert and
# runs the two matmuls of the SwiGLU as *grouped* matmuls (`jax.lax.ragged_dot`), one group per expert,
# sized by the counts. Under expert parallelism the groups travel by a ragged all-to-all whose slices
# have the sizes the router produced (on CPU, a padded stand-in; see `jaxpar/parallel/dropless.py`).
#
# What dropless computes is easy to state densely: run *every* expert on *every* token and weigh each
# output by the token's gate for that expert (zero for the experts it did not choose). The cell does
# that in numpy, with the layer's own weights, and compares it with the dropless layer and with the
# capacity layer at cf = 1 on the skewed router.


# %%
def silu(v):
    return v / (1 + np.exp(-v))


def dense_moe(layer):
    """Every expert on every token, weighted by the token's gates (zero for unchosen experts)."""
    gate_up, down = np.asarray(layer.gate_up[...]), np.asarray(layer.down[...])  # [E, D, 2, F], [E, F, D]
    idx, gates, _ = route(np.asarray(layer.router[...]))
    weight = np.zeros((B, T, E), np.float32)
    np.put_along_axis(weight, idx, gates, -1)
    h = np.einsum("btd,edkf->btekf", x, gate_up)
    out = np.einsum("btef,efd->bted", silu(h[..., 0, :]) * h[..., 1, :], down)
    return np.einsum("bte,bted->btd", weight, out)


dropless = moe_layer(SKEW, capacity_factor=None)
y_dropless, dropless_stats = run(dropless, x)
y_capacity, capacity_stats = run(tc_layer, x)  # cf = 1, the same weights (same seed):
assert np.array_equal(np.asarray(tc_layer.gate_up[...]), np.asarray(dropless.gate_up[...]))
want = dense_moe(dropless)
scale = np.abs(want).max()
err = {
    "dropless": float(np.abs(np.asarray(y_dropless) - want).max() / scale),
    "capacity cf=1": float(np.abs(np.asarray(y_capacity) - want).max() / scale),
}
changed = float(np.mean(np.abs(np.asarray(y_capacity) - want).max(-1) > 1e-5 * scale))
print(
    f"dropless:      dropped {float(dropless_stats.dropped_fraction):.1%}, "
    f"max |y − dense| / max |dense| = {err['dropless']:.1e}"
)
print(
    f"capacity cf=1: dropped {float(capacity_stats.dropped_fraction):.1%}, "
    f"max |y − dense| / max |dense| = {err['capacity cf=1']:.2f}; {changed:.1%} of tokens differ"
)

# %% [markdown]
# The dropless layer agrees with the dense computation to float32 rounding, with the hot experts running
# every token they were sent; the capacity layer does not, for every token that lost an assignment. What
# dropless costs instead is a shape that depends on the router: on one device the grouped matmul handles
# it, and under expert parallelism the receive buffer must hold the worst case (every assignment of the
# ep devices sent to one device's experts), ep times the local assignments, and the busiest device sets
# the step time.
#
# ## Key numbers

# %%
key_numbers = {
    "experts": E,
    "top_k": K,
    "batch": B,
    "seq": T,
    "capacity_slots": {str(cf): int(slots[cf]) for cf in FACTORS},
    "dropped": {f"{s:g}/{cf:g}": dropped[s, cf] for s in SKEWS for cf in FACTORS},
    "counts_per_sequence": {f"{s:g}": per_sequence[s].tolist() for s in SKEWS},
    "hottest_share": {f"{s:g}": float(hottest[s]) for s in SKEWS},
    "step_all_to_all": {
        "sent_bytes": float(step_sent),
        "count": report.collectives.count("all-to-all"),
        "axes": sorted({"+".join(op.axes) for op in a2a}),
        "batch": STEP_B,
        "seq": STEP_T,
        "ep": 4,
        "devices": layout.mesh.size,
        "experts": moe.num_experts,
        "top_k": moe.top_k,
        "capacity_factor": step_run.capacity_factor,
        "embed_dim": cfg.embed_dim,
        "moe_layers": cfg.num_moe_layers,
    },
    "layer_all_to_all": {
        "sent_bytes": {str(ep): float(v) for ep, v in ep_sent.items()},
        "groups": G,
        "experts": EL,
        "slots": C,
        "embed_dim": D,
    },
    "balance": balance,
    "expert_choice_experts_per_token": np.bincount(ec_experts.ravel()).tolist(),
    "dropless_error": err["dropless"],
    "capacity_error": err["capacity cf=1"],
    "dropless_dropped": float(dropless_stats.dropped_fraction),
    "capacity_cf1_dropped": float(capacity_stats.dropped_fraction),
}
{k: v for k, v in key_numbers.items() if k != "counts_per_sequence"}  # (the 4 × 8 × 16 counts left out)
