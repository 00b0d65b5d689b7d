"""The physical minimum of what a layout sends, per mesh-axis group, and a roofline step time.

Keys are mesh-axis groups: ``"fsdp"``, or ``"data+expert"`` when one collective spans both (the axes
in mesh order), as ``jaxpar.analysis`` labels the collectives it reads from the compiled program.
Bytes are what one device sends in one training step, with ring algorithms (all-reduce 2(n−1)/n of
the buffer, all-gather and reduce-scatter (n−1)/n of the full buffer, all-to-all (n−1)/n).

Weights and gradients, per parameter p with shard axes S (those of size > 1), token axes A (the axes
that split the batch or the positions) and E (the axis that holds whole experts, never gathered):
    G = (S ∩ A) − E    FSDP-style: all-gathered forward and again backward, gradient reduce-scattered:
                       (n−1)/n · (2·b_w + b_g) · |p| / |S − G|
    R = A − S − E(p)   gradient all-reduced over the token axes that do not shard p:
                       2(n−1)/n · b_g · |p| / |S|
Activations (b_a: compute dtype bytes; T_g = B·L / |A| tokens per device group):
    tensor    per layer 2 all-reduces forward, 2 backward of T_g·D, plus the embedding's and the LM
              head's input: (4·layers + 2) · 2(t−1)/t · T_g·D·b_a (sequence parallelism turns each into
              an all-gather + reduce-scatter pair of the same volume)
    sequence  ring: each device receives the other (n−1)/n of K and V per layer forward, twice that
              backward: 3 · (n−1)/n · 2·(B/|batch|)·L·H_kv/t·D_h·b_a per layer (GSPMD gather: 2×;
              Ulysses: 4 all-to-alls of the local q, k, v, o forward and backward)
    expert    dispatch and combine forward and backward: 4·(e−1)/e · T·k·cf·D·b_a per MoE layer
              (T tokens per device; cf the effective capacity factor; dropless: cf = 1)
    stage     pipeline (p stages, m microbatches, v virtual stages): per microbatch one stage input
              [B/m, T, D] forward and its gradient back over each of the p·v − 1 chunk boundaries,
              2·m·(p·v − 1) sends of R = (B/m)·T·D·b_a / (the axes splitting the executor's buffer:
              batch, length) over the whole ring; per device (the mean over the p stages, the same
              count the lab reads from the compiled program): 2·m·(p·v − 1)/p · R. Plus the gradient
              of every parameter not split over stage (embedding, final norm, head: each stage holds
              them whole) all-reduced over stage, as for the token axes: 2(p−1)/p · b_g · |p| / |S|.
              A device holds L/p of the layers, so the per-layer terms above count L/p layers.
Remat recomputation, optimizer work and scalar reductions are not part of the minimum: a measured ratio
above 1 names what the configuration adds (with full remat: 6 tensor all-reduces per layer, not 4).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict

import numpy as np

from jaxpar.mesh import AXES  # the physical order: outermost (slowest links) to innermost
from jaxpar.pipeline.schedules import build
from jaxpar.pipeline.timing import executor_bubble_fraction, own_action_bubble_fraction, own_action_times
from jaxpar.rules import axes_of


def group_key(axes) -> str:
    return "+".join(a for a in AXES if a in set(axes))


def weight_bytes(report, mesh: dict, token_axes: set[str], *, grad_bytes: int = 4) -> dict[str, float]:
    """The weight and gradient traffic per axis group (see the module docstring); ``report`` is a
    ``jaxpar.shardings.ShardingReport`` of the model under the layout."""
    out: dict[str, float] = defaultdict(float)
    size = lambda axes: math.prod(mesh[a] for a in axes)
    stages = mesh.get("stage", 1)
    for p in report.params:
        held_by = {a for e in p.spec for a in axes_of(e) if mesh[a] > 1}
        experts = {a for e, name in zip(p.spec, p.names) if name == "experts" for a in axes_of(e)}
        gather = (held_by & token_axes) - experts
        reduce = token_axes - held_by - experts
        b_w = np.dtype(p.dtype).itemsize
        if gather:
            n = size(gather)
            out[group_key(gather)] += (n - 1) / n * (2 * b_w + grad_bytes) * p.size / size(held_by - gather)
        if reduce:
            n = size(reduce)
            out[group_key(reduce)] += 2 * (n - 1) / n * grad_bytes * p.size / size(held_by)
        if stages > 1 and "stage" not in held_by:  # held whole by every stage: gradient all-reduced
            out["stage"] += 2 * (stages - 1) / stages * grad_bytes * p.size / size(held_by)
    return dict(out)


@dataclasses.dataclass(frozen=True)
class Activations:
    """What the activation formulas need of a model and a step."""

    batch: int
    seq: int
    embed_dim: int
    num_layers: int
    kv_heads: int
    head_dim: int
    num_heads: int
    act_bytes: int
    context_parallel: str = "none"
    moe_layers: int = 0
    top_k: int = 0
    capacity_slots: int | None = None  # per sequence, all experts (None: dropless)
    schedule: str | None = None  # the pipeline's (mesh stage > 1; jaxpar.pipeline.Schedule)
    microbatches: int = 1  # pipeline microbatches per step
    grad_accum: int = 1  # gradient-accumulation slices per step (no pipeline): one slice's activations live
    fsdp_gather: str = "section"  # the pipeline executor's (``jaxpar.pipeline.FsdpGather``)
    grad_reduce: str = "slice"  # accumulated gradients reduced per slice or once (``jaxpar.train.accumulate``)
    virtual_stages: int = 1  # model chunks per stage
    stage_split: tuple = ()  # the stack's layers on each stage, where the split is uneven (Megatron's)


def activation_bytes(a: Activations, mesh: dict, rules) -> dict[str, float]:
    size = lambda axes: math.prod(mesh[x] for x in axes)
    batch_axes = [x for x in rules["batch"] if mesh[x] > 1]
    seq_axes = [x for x in rules["inner_length"] if mesh[x] > 1]
    tokens_per_group = a.batch * a.seq / (size(batch_axes) * size(seq_axes))
    out = {}
    t, p = mesh.get("tensor", 1), mesh.get("stage", 1)  # a device runs L/p layers (and 1/p of the
    if t > 1:  # embeddings and heads, on average)
        out["tensor"] = (4 * a.num_layers + 2) / p * 2 * (t - 1) / t * tokens_per_group * a.embed_dim * a.act_bytes
    s = size(seq_axes)
    if s > 1:
        kv_heads = a.kv_heads / t if a.kv_heads % t == 0 else a.kv_heads
        sequences = a.batch / size(batch_axes)
        kv = (s - 1) / s * 2 * sequences * a.seq * kv_heads * a.head_dim * a.act_bytes
        if a.context_parallel == "ulysses":
            local = sequences * a.seq / s * a.head_dim * a.act_bytes
            per_layer = 2 * (s - 1) / s * local * (2 * a.num_heads + 2 * a.kv_heads) / t
        else:
            per_layer = kv * (3 if a.context_parallel == "ring" else 2)
        out[group_key(seq_axes)] = a.num_layers / p * per_layer
    e = mesh.get("expert", 1)
    if e > 1 and a.moe_layers:
        per_device_rows = (a.batch / size(batch_axes)) * (a.capacity_slots or a.seq * a.top_k) / s
        out["expert"] = a.moe_layers / p * 4 * (e - 1) / e * per_device_rows * a.embed_dim * a.act_bytes
    if p > 1:
        out["stage"] = stage_sends(a, p) / p * stage_input_bytes(a, mesh, rules)
    return out


def stage_sends(a: Activations, stages: int) -> int:
    """Stage inputs sent over the whole ring per step: per microbatch, one activation forward and one
    gradient back over each of the p·v − 1 chunk boundaries."""
    return 2 * a.microbatches * (stages * a.virtual_stages - 1)


def stage_input_bytes(a: Activations, mesh: dict, rules) -> float:
    """One send on one device: a microbatch's stage input [B/m, T, D] as the executor's buffers split it
    (over the axes of ``batch``, ``length`` and ``act_embed``)."""
    axes = {x for name in ("batch", "length", "act_embed") for x in rules[name] if mesh[x] > 1}
    return a.batch / a.microbatches * a.seq * a.embed_dim * a.act_bytes / math.prod(mesh[x] for x in axes)


def minimum_bytes(report, activations: Activations, mesh: dict, rules) -> dict[str, float]:
    """Weights, gradients and activations together, per axis group."""
    token_axes = {x for x in (*rules["batch"], *rules["inner_length"]) if mesh[x] > 1}
    out = defaultdict(float, weight_bytes(report, mesh, token_axes))
    for key, value in activation_bytes(activations, mesh, rules).items():
        out[key] += value
    return dict(out)


def hbm_bytes(report, a: Activations, mesh: dict, token_axes: set[str]) -> float:
    """HBM traffic of one step per device, estimated: the weights a device computes with (gathered over
    the token axes, float32) read 3 times (forward, remat recompute, backward) per gradient-accumulation
    slice, the optimizer reading and
    writing its shard (parameter, gradient, two moments: 28 bytes per element), and about 20 reads or
    writes of a [tokens, D] activation per layer it runs (L/p of them under a pipeline)."""
    size = lambda axes: math.prod(mesh[x] for x in axes)
    used = local = 0.0
    for p in report.params:
        held_by = {x for e in p.spec for x in axes_of(e) if mesh[x] > 1}
        used += p.size / size(held_by - token_axes) * np.dtype(p.dtype).itemsize
        local += math.prod(p.shard_shape)
    tokens = a.batch * a.seq / size(token_axes)
    layers = a.num_layers / mesh.get("stage", 1)
    return 3 * a.grad_accum * used + 28 * local + 20 * layers * tokens * a.embed_dim * a.act_bytes


def _widths(cfg) -> tuple[float, float, float, float]:
    """A layer's widths per token: (q, k and v, the attention's context, the MLP's hidden). A MoE layer's
    MLP width is its top-k experts' and the shared ones'; MLA's widths are its heads' (the latents are
    left out): both approximate."""
    mla, moe, n = cfg.mla, cfg.moe, cfg.num_heads
    if mla is not None:
        qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        q, kv, out = n * qk, n * (qk + mla.v_head_dim), n * mla.v_head_dim
    else:
        q, kv, out = n * cfg.head_dim, 2 * cfg.num_kv_heads * cfg.head_dim, n * cfg.head_dim
    f = cfg.mlp_dim
    if moe is not None:
        routed = moe.top_k * moe.mlp_dim + moe.num_shared_experts * moe.shared_mlp_dim
        f = (cfg.first_dense_layers * cfg.mlp_dim + cfg.num_moe_layers * routed) / cfg.num_layers
    return q, kv, out, f


def handoff_bytes(cfg, b: int, t: int) -> float:
    """Bytes one layer's B hands its W per token in a split schedule (``jaxpar.pipeline.wgrad``), in
    compute dtype bytes ``b``, split over tensor ``t``: the cotangent of every matmul's output (q, k, v,
    the attention projection's, the MLP's two F-wide and its D-wide) and, in float32, the two norms'
    (their scales' gradients read them)."""
    q, kv, _, f = _widths(cfg)
    return ((2 * cfg.embed_dim + q + kv + 2 * f) * b + 8 * cfg.embed_dim) / t


def kept_bytes(cfg, execution, b: int, t: int) -> float:
    """Bytes one layer keeps per token for the backward under ``execution.remat``, in compute dtype bytes ``b``,
    split over tensor ``t`` (heads and MLP columns by t, the D-wide values by tensor's sequence
    parallelism). What jax saves of a jaxpar block (``tests/test_plan.py`` reads it from the program's
    saved residuals): ``full`` the input; ``attn`` the input, q, k, v, the attention's context and the
    attention block's output (``jaxpar.execution.ATTN_NAMES``); ``dots``
    the input, q, k, v, the attention projection's output and the MLP's input products (its output no
    backward reads); ``none`` also the attention output, six F-wide products, two D-wide values, the
    norms' float32 internals (6·D·4 + 16 B) and the softmax's float32 max and sum (8·N B) (its scores:
    ``score_bytes``). A MoE layer's MLP width is its top-k experts' and the shared ones'; MLA's widths
    are its heads' (the latents are left out): both approximate."""
    n, d = cfg.num_heads, cfg.embed_dim
    q, kv, out, f = _widths(cfg)
    named = out if cfg.mla is not None else q + kv + out  # what remat=attn names (MLA: its context)
    kept = {
        "full": d * b,
        "attn": (2 * d + named) * b,
        "dots": (2 * d + q + kv + 2 * f) * b,
        "none": (2 * d + q + kv + out + 6 * f) * b + 6 * d * 4 + 16 + 8 * n,
    }[str(execution.remat)]
    return kept / t


FLASH_KERNELS = ("cudnn", "splash")  # the ``execution.attention_impl`` values that run blockwise


def flash_attention(execution) -> bool:
    """Whether jaxpar's attention run as ``execution`` (a ``jaxpar.execution.ExecutionConfig``) says runs
    blockwise, never holding a [S, S] score matrix: cuDNN's kernel (GPUs), Pallas splash (TPUs), or the
    ring's blocks.
    ``jax.nn.dot_product_attention`` without an implementation is XLA's, which materializes every score
    (causal or not) of a layer."""
    return str(execution.attention_impl) in FLASH_KERNELS or str(execution.context_parallel) == "ring"


def score_bytes(cfg, execution, acts: Activations, tokens: float, t: int) -> tuple[float, float]:
    """(kept by all layers, one layer's working set) of non-flash attention's scores per device: a query's
    S scores per head (N/t heads), kept under remat none as the float32 softmax output its gradient reads
    and the probabilities in the compute dtype (4 + b_a bytes each), worked on as those and the float32
    logits (8 + b_a). Nothing under a flash kernel."""
    if flash_attention(execution):
        return 0.0, 0.0
    scores = tokens * cfg.num_heads / t * acts.seq
    kept = (4 + acts.act_bytes) * scores if str(execution.remat) == "none" else 0.0
    return kept, (8 + acts.act_bytes) * scores


def memory_parts(cfg, execution, report, acts: Activations, mesh: dict, token_axes: set) -> dict[str, float]:
    """Bytes per device: ``state``, 16 per local parameter element (float32 parameter, gradient, two Adam moments;
    under a pipeline a stage holds L/p of the layers and the embedding, norm and head whole); ``activations``:
    what the layers keep for the backward (layers × tokens × ``kept_bytes``, and under remat none non-flash
    attention's scores, ``score_bytes``, and the layers' weights cast to the compute dtype where it differs from
    theirs), one layer's working set (16 × tokens × max(D, F/t) × b_a, and the scores without a flash kernel),
    and float32 logits with their gradient (8 × tokens × V/t, one of ``execution.loss_chunks`` pieces at a
    time). Under a pipeline (``pipeline_memory``) the tokens are one microbatch's, the layers one chunk's (when
    every stage runs its own action, ``runs_own_actions``: times the act slots, each holding a microbatch's
    residuals, and in a split schedule what its B hands its W, ``handoff_bytes``), plus the executor's stage-
    input buffers (and with ``fsdp_gather`` step the stage's weights whole over fsdp, ``gathered``). With
    gradient accumulation (``grad_accum`` k) the tokens are one slice's, and the state holds a float32 gradient
    sum beside the slice's gradient (4 more bytes per element); reduced once a step (``grad_reduce`` step), the
    weights and that sum are whole over fsdp (``gathered``: both)."""
    local = sum(math.prod(p.shard_shape) for p in report.params)
    t, stages = mesh.get("tensor", 1), mesh.get("stage", 1)
    tokens = acts.batch * acts.seq / math.prod(mesh[a] for a in token_axes)
    layers, buffers = acts.num_layers, 0.0
    if stages > 1:
        layers, buffers, tokens = pipeline_memory(acts, stages, tokens, t)
    tokens /= acts.grad_accum  # one slice's activations at a time
    width = max(cfg.embed_dim, cfg.mlp_dim / t)
    kept_scores, scores = score_bytes(cfg, execution, acts, tokens, t)
    kept = layers * (tokens * kept_bytes(cfg, execution, acts.act_bytes, t) + kept_scores)
    if stages > 1 and runs_own_actions(cfg, acts, mesh):  # residuals kept per microbatch in flight
        table = schedule_table(acts.schedule, stages, acts.microbatches, acts.virtual_stages)
        kept *= table.act_slots
        buffers += table.act_slots * tokens * cfg.embed_dim * acts.act_bytes / t  # the last chunk's output grads
        if table.split_backward:  # what each microbatch's B hands its W, per act slot
            kept += table.act_slots * layers * tokens * handoff_bytes(cfg, acts.act_bytes, t)
    cast = str(execution.dtype) != str(cfg.param_dtype)
    if str(execution.remat) == "none" and cast:  # the layers' weights, cast
        kept += acts.act_bytes * sum(
            math.prod(p.shard_shape) for p in report.params if p.names[:1] in (("layers",), ("prefix_layers",))
        )
    logits = 8 * tokens * cfg.padded_vocab / t / execution.loss_chunks  # a piece of the tokens at a time
    working = 16 * tokens * width * acts.act_bytes + scores + logits
    state = (16 + (4 if acts.grad_accum > 1 else 0)) * local  # accumulating: a float32 sum beside the slice's
    whole = gathered_weight_bytes(report, mesh) if stages > 1 and acts.fsdp_gather == "step" else 0.0
    if (acts.grad_accum > 1 or stages > 1) and acts.grad_reduce == "step":  # the weights and the f32 sum
        whole = 2 * gathered_weight_bytes(report, mesh)
    return dict(
        state=state, activations=buffers + kept + working + whole, kept=kept, stage_buffers=buffers, gathered=whole
    )


def gathered_weight_bytes(report, mesh: dict) -> float:
    """Bytes per device of the weights a pipeline gathers over ``fsdp`` once a step and keeps whole."""
    f = mesh.get("fsdp", 1)
    split = [p for p in report.params if any("fsdp" in axes_of(e) for e in p.spec)]
    return float(sum(math.prod(p.shard_shape) * f * np.dtype(p.dtype).itemsize for p in split)) if f > 1 else 0.0


def memory_estimate(cfg, execution, report, acts: Activations, mesh: dict, token_axes: set) -> float:
    """Bytes per device (``memory_parts``: state and activations)."""
    parts = memory_parts(cfg, execution, report, acts, mesh, token_axes)
    return parts["state"] + parts["activations"]


# ---------------------------------------------------------------------------------------- pipeline
@functools.lru_cache(maxsize=512)
def schedule_table(schedule: str, stages: int, microbatches: int, virtual_stages: int = 1):
    """``jaxpar.pipeline.build``'s table (cached: the search asks for the same few many times)."""
    return build(schedule, stages, microbatches, virtual_stages)


def pipeline_memory(a: Activations, stages: int, tokens: float, t: int) -> tuple[float, float, float]:
    """(layers of one chunk, bytes of the executor's stage-input buffers, tokens of one microbatch) per
    device: the executor keeps ``act_slots`` + ``grad_slots`` microbatch inputs and cotangents [b, T, D]
    (each with one spare slot), at least the table's peak in flight; it runs one chunk at a time (the
    largest, where the split is uneven)."""
    table = schedule_table(a.schedule, stages, a.microbatches, a.virtual_stages)
    micro = tokens / a.microbatches
    slots = table.act_slots + table.grad_slots + 2
    chunk = max(a.stage_split) / a.virtual_stages if a.stage_split else a.num_layers / (stages * a.virtual_stages)
    return chunk, slots * micro * a.embed_dim * a.act_bytes / t, micro


def executor_durations(split: bool, head: float, remat_full: bool) -> tuple[float, float, float | None]:
    """(F, B, W) of jaxpar's executor in forwards of one model chunk (W None without a split backward).
    F runs the chunk. B recomputes the chunk's forward from its stage input (remat at stage granularity),
    under full remat each layer's forward once more, then the backward (2 forwards; 1 when it is the
    input gradient alone), and the LM head's forward and backward on every stage (masked; ``head`` = its
    forward over the chunk's): 3 + r + 3h, split 2 + r + 2h. W: 1 + r + 2 (the weight gradient still
    needs the input gradient inside the chunk) + 3h."""
    r = 1.0 if remat_full else 0.0
    if split:
        return 1.0, 2 + r + 2 * head, 3 + r + 3 * head
    return 1.0, 3 + r + 3 * head, None


def own_action_durations(split: bool, head: float, remat_full: bool) -> tuple[float, float, float | None, float]:
    """(F, B, W, head) when every stage runs its own action (``jaxpar.pipeline.actions``), in forwards
    of one model chunk. F runs the chunk once and keeps its residuals; B runs the backward from them
    (2; under full remat each layer's forward once more: r = 1); split, B is the input gradient (1 + r)
    and W the weight gradient from the cotangents B hands it (1 + r: ``jaxpar.pipeline.wgrad``). The LM
    head's forward and backward (3h) run with the last chunk's F only."""
    r = 1.0 if remat_full else 0.0
    if split:
        return 1.0, 1 + r, 1 + r, 3 * head
    return 1.0, 2 + r, None, 3 * head


def runs_own_actions(cfg, a: Activations, mesh: dict) -> bool:
    """Whether the executor runs each stage's own action for this layout (``jaxpar.pipeline.executor.
    own_actions``): gradients reduced once a step, no expert split, no ring over a sequence split, no
    dense prefix."""
    ring = a.context_parallel == "ring" and mesh.get("sequence", 1) > 1
    return a.grad_reduce == "step" and mesh.get("expert", 1) == 1 and not ring and not cfg.first_dense_layers


def pipeline_costs(cfg, a: Activations, mesh: dict, *, remat_full: bool) -> dict:
    """The schedule's measures for ``Plan.pipeline``, in jaxpar's executor's durations. Bubbles (idle
    share of stage time): ``bubble_fraction`` as the schedule's papers draw it (every op starts when its
    inputs are there), ``lockstep_bubble_fraction`` when every tick lasts as long as its slowest op, and
    ``executor_bubble_fraction``, what jaxpar's executor runs: every stage runs one section per tick, the
    one its most expensive action needs (forward, input-gradient vjp, full vjp; module docstring of
    ``jaxpar.pipeline.executor``). ``flops_per_device``: the work the stages do (recomputation and the
    head included), without the masked sections; the step's compute is that over 1 − executor bubble."""
    p, m, v, n = mesh["stage"], a.microbatches, a.virtual_stages, math.prod(mesh.values())
    table = schedule_table(a.schedule, p, m, v)
    head = 2.0 * cfg.padded_vocab * cfg.embed_dim  # forward FLOPs per token
    chunk = (cfg.flops_per_token(a.seq) / 3 - head) / (p * v)
    own, t_h, scale = runs_own_actions(cfg, a, mesh), 0.0, None
    if a.stage_split:  # uneven: the unit is the largest chunk; where each stage runs its own action, a
        rows = max(a.stage_split) / v  # stage's ops last its own chunks' share of it (padding skipped)
        chunk, scale = chunk * p * v / a.num_layers * rows, [n / v / rows for n in a.stage_split]
    if own:
        t_f, t_b, t_w, t_h = own_action_durations(table.split_backward, head / chunk, remat_full)
        busy = float(own_action_times(table, t_f, t_b, t_w, t_h, scale).sum())
        executor = own_action_bubble_fraction(table, t_f, t_b, t_w, t_h, scale)
    else:
        t_f, t_b, t_w = executor_durations(table.split_backward, head / chunk, remat_full)
        busy = table.busy_time(t_f, t_b, t_w)
        executor = executor_bubble_fraction(table, t_f, t_b, t_w)
    fwd, bwd = table.fwd_recv_slot >= 0, table.bwd_recv_slot >= 0
    return dict(
        schedule=str(table.schedule),
        stages=p,
        microbatches=m,
        virtual_stages=v,
        ticks=table.ticks,
        durations=dict(F=t_f, B=t_b) | ({} if t_w is None else dict(W=t_w)) | (dict(head=t_h) if own else {}),
        bubble_fraction=table.bubble_fraction(t_f, t_b, t_w),
        lockstep_bubble_fraction=table.lockstep_bubble_fraction(t_f, t_b, t_w),
        executor_bubble_fraction=executor,
        bubble_used="executor_bubble_fraction",
        executor="own actions" if own else "one section a tick",
        peak_in_flight=int(table.peak_in_flight.max()),
        act_slots=table.act_slots,
        grad_slots=table.grad_slots,
        sends=int(fwd.sum() + bwd.sum()),
        send_ticks=int(fwd.any(axis=1).sum() + bwd.any(axis=1).sum()),
        flops_per_device=busy / p * chunk * a.batch * a.seq / m / (n / p),
        fsdp_gather=a.fsdp_gather,
        grad_reduce=a.grad_reduce,
    ) | (dict(stage_layers=list(a.stage_split)) if a.stage_split else {})


ACTIVATION_AXES = {"tensor", "sequence", "expert"}


def measured_bytes(ops, *, activation_scale: float = 1.0) -> dict[str, float]:
    """Sent bytes per axis group of the collectives read from a compiled program; a group with an
    activation axis is scaled by ``activation_scale`` (XLA:CPU moves bf16 activations as f32: 0.5)."""
    out: dict[str, float] = defaultdict(float)
    for op in ops:
        if op.axes:
            scale = activation_scale if set(op.axes) & ACTIVATION_AXES else 1.0
            out[group_key(op.axes)] += op.sent_bytes * op.executions * scale
    return dict(out)
