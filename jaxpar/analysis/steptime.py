"""A training step's time from its mechanisms: what each device computes, reads and sends, layer by layer,
and which of it can run at the same time.

One transformer layer on one device, per step (T: tokens per tensor group, t: the tensor split):
    matmuls       q, k/v (MLA: through their latents), attention output, MLP in (2 matrices gated, 1 plain),
                  MLP out: [T, K] × [K, N] each at ``matmul_seconds`` (a roofline: the chip's matmul efficiency
                  on padded shapes, or the HBM traffic of the three operands, whichever is slower)
    attention     2·T·S·H/t·(qk + v) FLOPs forward (4·T·S·H/t·D_h without MLA), halved when causal (flash
                  kernels skip the masked blocks; ``Workload.attention_share`` under a sliding window or
                  context parallelism), at
                  the chip's attention efficiency; backward 2.5× forward (5 matmuls against 2)
                  (without a flash kernel, ``Workload.flash`` False: every score, causal or not, computed at the
                  GEMM share, and the [S] scores of each query and head written, soft-maxed, dropped out and
                  read back over HBM: ``SCORE_BYTES`` each)
    elementwise   norms, residual adds, rotary embedding and the MLP activation read and write
                  8·D/t + m·F/t + 2·(H+H_kv)·D_h/t values (m: MLP matrices) a token forward (``elementwise_values``),
                  twice that backward, over HBM (activations split over tensor as MaxText's and ours are)
    backward      2× the forward matmuls (input gradient + weight gradient), 2.5× attention, 2× elementwise
    recompute     the share of the forward each remat policy runs again (``RECOMPUTE``), under JAX without the
                  matmuls whose outputs no backward reads (``UNREAD``; torch's checkpointing reruns them)
Per step: L layers, the LM head (forward and backward, cross entropy in f32 over HBM), the optimizer
(Adam: 28 bytes of HBM traffic per local parameter element).

Mixture-of-experts layers (``Workload.experts``; ``expert`` e splits the batch outside them): the MLP is
replaced by the router, E/e experts per device running the E·C/S capacity slots a token pays for
(C = ⌈capacity_factor·S·k/E⌉ per expert and sequence, jaxpar's and GShard's rule), or k dropless, the
shared MLP, and with a capacity the one-hot dispatch and combine einsums, [E·C, S] × [S, D] a sequence
(the dispatch mask takes no gradient). The slots go to their experts and back by all-to-all over
``expert``: exposed in the forward, beside the experts' weight-gradient matmuls in the backward where the
platform overlaps (as tensor's). Expert weights split over expert and fsdp; the others are replicated
over expert (jaxpar: their gradients all-reduced over it) or split over it like fsdp (``expert_fsdp``:
MaxText). Dropless experts run as grouped matmuls at ``Calibration.grouped`` of the matmul share.

Context parallelism (``sequence`` n; ``context_seconds``): ring attention's K/V sends beside the blocks'
attention, Ulysses' all-to-alls, or GSPMD's gathered K/V, and the gradients' all-reduce over sequence.

Pipelines (``stage`` p > 1, m microbatches a step, v layer chunks a device): a device runs L/p layers
(an uneven split: its largest chunk, ``Workload.stage_layers``) on every microbatch, the last stage the LM
head as well (it sets the pace: the stages' busy time is the last one's; with Megatron's split,
``Workload.stage_split``, the last stage's fewer layers and the head, or the busiest stage's layers,
whichever is longer); each chunk boundary sends a
microbatch's [T, D] activations forward and their gradient back over the stage link, split over tensor
(Megatron's scatter/gather), exposed. The schedule idles (p − 1)/(v·m + p − 1) of the step (1F1B,
interleaved when v > 1; ``Workload.bubble`` where a schedule table gives its own), so the bubble adds
busy × bubble/(1 − bubble). jaxpar's own executor (``Workload.executor``) recomputes a chunk's forward in
its backward and runs the LM head (masked) in every chunk's backward on every stage; its sends on the
critical path are read from the compiled program (``Workload.stage_bytes``, ``jaxpar.analysis.plan``).

Communication, and what hides it (per mechanism; nothing is a global overlap share):
    fsdp       weights gathered forward and again backward, gradients reduce-scattered: a layer's gather
               is prefetched behind the previous layer's forward, the backward's gather and
               reduce-scatter behind the layer's backward (async collective fusion on TPU, the latency-
               hiding scheduler on GPU XLA, FSDP2's prefetch): exposed only what exceeds that compute
    data       (ICI) gradients all-reduced per layer behind the backward, like fsdp's reduce-scatter
    tensor     two all-reduces of [T, D] per forward (and per recomputed forward), two per backward. The
               forward's sit between dependent matmuls: exposed. The backward's can run beside the
               weight-gradient matmuls, which do not depend on them, where the platform overlaps them
               (``Hardware.tensor_overlap``: TPU async collective fusion; GPU: exposed, torch's async TP
               included, which gains torchtitan's 70B run 5.7% where hiding it all would gain 26%)
    dcn        the gradient all-reduce across slices or nodes, at the end of the step: exposed, or behind
               the last microbatch's backward where buckets overlap it (``Workload.dcn_overlap``: torch DDP)
Links (``jaxpar.analysis.links``): an ICI axis on a TPU torus uses both directions of every torus
dimension it spans; a GPU axis inside a node its NVLink/PCIe per direction, across nodes the NIC.
Collective efficiency (achieved share of a link) and the matmul peak share are the calibrated constants
(``Calibration``); everything else is a spec sheet or a count (``jaxpar.analysis.hardware``).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxpar.analysis.hardware import FA2_ATTENTION
from jaxpar.analysis.links import axis_links
from jaxpar.analysis.workload import RECOMPUTE, UNREAD, Workload

# HBM bytes per attention score in a forward without a flash kernel (fp16, Megatron-LM 2021): QKᵀ writes it
# (2), the fused scale-mask-softmax reads and writes it (4), dropout reads and writes it with a 1-byte
# mask (5), the AV matmul reads it (2)
SCORE_BYTES = 13


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The fitted constants (``jaxpar.analysis.calibration`` fits them on published runs): the share of
    peak a large well-shaped matmul reaches, and the share of a link's bandwidth a collective reaches,
    on the fast links and on DCN/IB. Keyed by the chip's family (``Hardware.family``). ``grouped``: the
    share of the matmul share that dropless experts' grouped matmuls reach, where runs measure it (else 1);
    ``fp8``: the share of the chip's FP8 peak that FP8 matmuls reach, where runs measure it (else ``matmul``);
    ``grouped_fp8``: ``grouped`` for FP8 grouped matmuls (else ``grouped``)."""

    matmul: dict
    collective: dict
    dcn: dict
    grouped: dict = dataclasses.field(default_factory=dict)
    fp8: dict = dataclasses.field(default_factory=dict)
    grouped_fp8: dict = dataclasses.field(default_factory=dict)

    def grouped_share(self, family: str, fp8: bool) -> float:
        bf16 = self.grouped.get(family, 1.0)
        return self.grouped_fp8.get(family, bf16) if fp8 else bf16


def elementwise_values(w: Workload, moe: bool = False) -> float:
    """Values read or written per token per layer forward, on one device (see the module docstring). A MoE
    layer: its experts' activations for each slot a token pays for, the shared MLP's, and the routing's
    own: the one-hot dispatch and combine masks (E·C/S values each per token), or the dropless sort and
    unsort of each token's k copies (4·k·D)."""
    t, D = w.size("tensor"), w.embed_dim
    attention = 8 * D + w.num_heads * (w.qk_dim + w.v_dim) + w.kv_width
    if not moe:
        return (attention + w.mlp_matrices * w.mlp_dim) / t
    mlp = w.mlp_matrices * (w.slots_per_token * w.expert_mlp_dim + w.shared_mlp_dim)
    routing = 4 * w.top_k * D if w.dropless else 2 * w.slots_per_token
    return (attention + mlp) / t + routing


def matmul_seconds(m, k, n, chip, efficiency, fp8: bool = False):
    """[m, k] × [k, n] in bf16 (``fp8``: at the chip's FP8 peak): padded to the chip's tile, at ``efficiency``
    × peak, or its bf16 operands over HBM, whichever is slower (``efficiency`` may be a numpy array: the
    calibration's grid)."""
    tile = chip.matmul_tile
    padded = math.prod(math.ceil(x / tile) * tile for x in (m, k, n))
    peak = (chip.peak_fp8_flops or chip.peak_bf16_flops) if fp8 else chip.peak_bf16_flops
    compute = 2.0 * padded / (peak * efficiency)
    return np.maximum(compute, 2.0 * (m * k + k * n + m * n) / chip.hbm_bandwidth)


def layer_forward(w: Workload, chip, eta, tokens: float, moe: bool = False, grouped=1.0, eta_fp8=None) -> tuple:
    """One layer's forward on ``tokens`` tokens of one tensor group, in seconds: (the matmuls by name,
    attention, elementwise work); ``eta`` the matmul share of peak. A MoE layer (``moe``) replaces the MLP
    with the router, the experts on their slots (each device runs E/e experts on E·C/S·T slots in all, the
    e − 1 other devices' tokens included) and the shared MLP; with a capacity, the one-hot dispatch and
    combine einsums ([E·C, S] × [S, D] per sequence); dropless, the experts as grouped matmuls at ``grouped``
    × the share. ``Workload.fp8``: the weight matmuls at the FP8 peak and ``eta_fp8`` (the router, the
    one-hot einsums, attention and the LM head stay in bf16)."""
    t, D = w.size("tensor"), w.embed_dim
    share = eta_fp8 if w.fp8 and eta_fp8 is not None else eta

    def weights(m, k, n, scale=1.0):  # a weight matmul, in FP8 under ``Workload.fp8``
        return matmul_seconds(m, k, n, chip, share * scale, fp8=w.fp8)

    mm = {name: sum(weights(tokens, k, n) for k, n in shapes) for name, shapes in w.attention_shapes(t).items()}
    if not moe:
        mm |= dict(
            mlp_in=weights(tokens, D, (w.mlp_matrices - 1) * w.mlp_dim // t), mlp_out=weights(tokens, w.mlp_dim // t, D)
        )
    else:
        local, slots = w.experts // w.size("expert"), w.slots_per_token * tokens
        each = slots / local  # slots of one local expert
        g = grouped if w.dropless else 1.0
        mm |= dict(
            router=matmul_seconds(tokens, D, w.experts, chip, eta),
            experts_in=local * weights(each, D, (w.mlp_matrices - 1) * w.expert_mlp_dim // t, g),
            experts_out=local * weights(each, w.expert_mlp_dim // t, D, g),
        )
        if not w.dropless:
            mm["dispatch"] = mm["combine"] = matmul_seconds(slots, w.seq, D // t, chip, eta)
        if w.shared_mlp_dim:
            mm |= dict(
                shared_in=weights(tokens, D, (w.mlp_matrices - 1) * w.shared_mlp_dim // t),
                shared_out=weights(tokens, w.shared_mlp_dim // t, D),
            )
    att_flops = 2.0 * tokens * w.seq * w.num_heads / t * (w.qk_dim + w.v_dim)
    if w.flash:
        kernel = FA2_ATTENTION if w.attention_kernel == "fa2" else chip.attention_efficiency
        att = att_flops * w.attention_share / (chip.peak_bf16_flops * eta * kernel)
    else:
        att = (
            att_flops / (chip.peak_bf16_flops * eta)
            + tokens * w.seq * w.num_heads / t * SCORE_BYTES / chip.hbm_bandwidth
        )
    return mm, att, elementwise_values(w, moe) * tokens * w.act_bytes / chip.hbm_bandwidth


def bubble_of(w: Workload) -> float:
    """The pipeline's idle share: the schedule table's where given, else 1F1B's (p − 1)/(v·m + p − 1)."""
    p = w.size("stage")
    return w.bubble if w.bubble is not None else (p - 1) / (w.virtual_stages * w.microbatches + p - 1)


def layer_seconds(w: Workload, chip, cal: Calibration, bw: dict, tokens: float, moe: bool = False) -> dict:
    """One layer (``moe``: a MoE one) on one microbatch of ``tokens`` tokens per tensor group, forward,
    recompute and backward: its compute and exposed communication in seconds, and ``hides_s``, the
    backward and recompute that gradient traffic can hide behind. ``bw``: per axis, the bandwidth a
    collective reaches."""
    t, e = w.size("tensor"), w.size("expert")
    fam = chip.family
    by_name, att, ew = layer_forward(
        w, chip, cal.matmul[fam], tokens, moe, cal.grouped_share(fam, w.fp8), cal.fp8.get(fam)
    )
    mm = sum(by_name.values())
    r_mm, r_att, r_ew, r_x = recompute_shares(w, by_name, mm)
    fwd = mm + att + ew
    recompute = r_mm * mm + r_att * att + r_ew * ew
    mm_bwd = 2 * mm - by_name.get("dispatch", 0.0)  # input and weight gradients; the dispatch mask has none
    bwd = mm_bwd + 2.5 * att + 2 * ew
    gather, scatter, reduce = weight_traffic_seconds(w, bw, moe)
    tp = 2 * 2 * (t - 1) / t * tokens * w.embed_dim * w.act_bytes / bw["tensor"] if t > 1 else 0.0
    tp_bwd = np.maximum(0.0, tp - mm) if chip.tensor_overlap else tp  # beside the weight-gradient matmuls
    # a layer's gather behind the previous forward; the backward's gather, scatter and reduce behind it
    # (gathered once a step and kept, ``Workload.gather_once``: one gather over the step's microbatches;
    # reduced once a step, ``Workload.reduce_once``: one reduction over them)
    if w.reduce_once:
        scatter, reduce = scatter / w.microbatches, reduce / w.microbatches
    if w.gather_once:
        fsdp = np.maximum(0.0, gather / w.microbatches - fwd) + np.maximum(0.0, scatter + reduce - recompute - bwd)
    else:
        fsdp = np.maximum(0.0, gather - fwd) + np.maximum(0.0, gather + scatter + reduce - recompute - bwd)
    # expert all-to-all: the slots out to their experts and back (dispatch, combine); in the forward between
    # dependent matmuls, in the backward beside the experts' weight-gradient matmuls where the platform
    # overlaps them, as tensor's
    a2a = (
        2 * (e - 1) / e * w.slots_per_token * tokens * w.embed_dim / t * w.act_bytes / bw["expert"]
        if moe and e > 1
        else 0.0
    )
    experts_mm = by_name.get("experts_in", 0.0) + by_name.get("experts_out", 0.0)
    a2a_bwd = np.maximum(0.0, a2a - experts_mm) if chip.tensor_overlap else a2a
    cp = context_seconds(w, chip, bw, tokens, att) if w.size("sequence") > 1 else (0.0, 0.0)
    return dict(
        matmul_s=(1 + r_mm) * mm + mm_bwd,
        attention_s=(3.5 + r_att) * att,
        elementwise_s=(3 + r_ew) * ew,
        tensor_exposed_s=(1 + r_mm) * tp + tp_bwd,
        fsdp_exposed_s=fsdp,
        expert_exposed_s=(1 + r_x) * a2a + a2a_bwd,
        sequence_exposed_s=(1 + r_att) * cp[0] + cp[1],
        hides_s=bwd + recompute,
    )


def recompute_shares(w: Workload, by_name: dict, mm: float) -> tuple:
    """(matmul, attention, elementwise, experts): the share of each part of a layer's forward that runs
    again before its backward, under ``w.remat`` (``by_name``: the forward's matmul seconds by name, ``mm``
    their sum); a pipeline's executor adds one whole forward."""
    r_mm, r_att, r_ew = RECOMPUTE[w.remat]
    if r_att is None:  # the scores' half, or a flash kernel's whole forward
        r_att = 1.0 if w.flash else 0.5
    r_x = r_mm  # the experts' share (their all-to-all runs again too)
    unread = UNREAD if w.remat_dce else ()
    if isinstance(r_mm, tuple):  # the named matmuls kept, the others recomputed
        r_x = float("experts_in" not in r_mm)
        r_mm = sum(v for name, v in by_name.items() if name not in r_mm + unread) / mm
    else:
        r_mm = r_mm * sum(v for name, v in by_name.items() if name not in unread) / mm
    if w.executor and w.size("stage") > 1:  # each backward recomputes its chunk's forward
        r_mm, r_att, r_ew, r_x = r_mm + 1, r_att + 1, r_ew + 1, r_x + 1
    return r_mm, r_att, r_ew, r_x


def weight_traffic_seconds(w: Workload, bw: dict, moe: bool) -> tuple:
    """(gather, scatter, reduce): one layer's seconds of fsdp weight gathers, fsdp gradient
    reduce-scatters, and gradient all-reduces over the axes that replicate its weights (data, expert where
    the experts alone split over it, sequence)."""
    t, f, d, e = w.size("tensor"), int(w.mesh.get("fsdp", 1)), int(w.mesh.get("data", 1)), w.size("expert")
    # weights per tensor shard: the experts split over expert and fsdp, the rest over fsdp (and expert)
    experts = w.expert_params / t if moe else 0.0
    rest = w.layer_params(moe) / t - experts
    g = f * e if w.expert_fsdp else f
    gathered = (g - 1) / g * rest + (f - 1) / f * experts / e
    gather, scatter = gathered * w.weight_bytes / bw["fsdp"], gathered * w.grad_bytes / bw["fsdp"]
    held = rest / g + experts / (e * f)
    reduce = 2 * (d - 1) / d * held * w.grad_bytes / bw["data"]
    if e > 1 and not w.expert_fsdp:  # the rest's replicas over expert reduce their gradients
        reduce = reduce + 2 * (e - 1) / e * rest / f * w.grad_bytes / bw["expert"]
    n = w.size("sequence")
    if n > 1:  # every weight is replicated over sequence
        reduce = reduce + 2 * (n - 1) / n * held * w.grad_bytes / bw["sequence"]
    return gather, scatter, reduce


def context_seconds(w: Workload, chip, bw: dict, tokens: float, att: float) -> tuple:
    """Exposed context-parallel traffic of one layer's (forward, backward); ``att`` its forward attention.
    Ring: n − 1 sends of the local K/V to the next device, each beside a block's attention, exposed only
    what exceeds the layer's attention; backward, the K/V with their float32 dK/dV accumulators (one more
    send brings those home), beside the attention backward. A ring sends one way to one neighbour: on a
    torus one ICI link's direction, on a GPU the per-direction link. Ulysses: q, k, v to head-split and
    the output back, all-to-alls between dependent ops: exposed, forward and backward alike. Allgather:
    the other devices' K/V gathered before attention, their gradients reduce-scattered after it: exposed."""
    n, t = w.size("sequence"), w.size("tensor")
    kv = tokens * w.kv_width / t
    if w.context_parallel == "ulysses":
        qkvo = w.num_heads * (w.qk_dim + w.v_dim) + w.kv_width
        a2a = (n - 1) / n * tokens * qkvo / t * w.act_bytes / bw["sequence"]
        return a2a, a2a
    if w.context_parallel == "allgather":
        return (n - 1) * kv * w.act_bytes / bw["sequence"], (n - 1) * kv * w.act_bytes / bw["sequence"]
    link = bw["sequence"] * (chip.ici_link / axis_links(w, chip)["sequence"] if chip.torus_dims else 1.0)
    fwd = (n - 1) * kv * w.act_bytes / link
    bwd = ((n - 1) * kv * (w.act_bytes + 4) + kv * 4) / link
    return np.maximum(0.0, fwd - att), np.maximum(0.0, bwd - 2.5 * att)


def step_seconds(w: Workload, chip, cal: Calibration) -> dict:
    """The step's parts in seconds and their sum ``step_s`` (arrays when ``cal`` holds arrays)."""
    eps, eps_dcn = cal.collective[chip.family], cal.dcn[chip.family]
    t, d, p = w.size("tensor"), int(w.mesh.get("data", 1)), w.size("stage")
    m, v = w.microbatches, w.virtual_stages
    tokens = w.batch * w.seq / (w.replicas * w.size("sequence") * m)  # per tensor group and microbatch
    bw = {a: b * (eps_dcn if slow else eps) for a, (b, slow) in axis_links(w, chip, with_class=True).items()}
    layers = {}  # a stage's layers; the last stage's LM head on top
    for moe, n in ((False, w.num_layers - w.moe_layers), (True, w.moe_layers)):
        for k, x in layer_seconds(w, chip, cal, bw, tokens, moe).items() if n else ():
            layers[k] = layers.get(k, 0.0) + n * w.stage_layers / w.num_layers * x
    hides = layers.pop("hides_s")
    stage_bw = bw["stage"] if int(w.mesh.get("stage", 1)) > 1 else chip.slow_link * eps_dcn
    send = 2 * v * tokens * w.embed_dim * w.act_bytes / t / stage_bw if p > 1 and w.stage_bytes is None else 0.0
    head = (
        3 * matmul_seconds(tokens, w.embed_dim, w.vocab // t, chip, cal.matmul[chip.family])
        + 16 * tokens * w.vocab / t / chip.hbm_bandwidth
    )
    if w.executor and p > 1:  # and runs the head (masked) on every stage
        head = head * v
    if w.stage_split and p > 1:  # Megatron's split: the last stage's layers and head, or the busiest's layers
        layers, head = _paced_by(layers, head, w.stage_layers, w.last_stage_layers)
    parts = {k: m * x for k, x in dict(layers, head_s=head, stage_exposed_s=send).items()}
    busy = sum(parts.values())
    bubble = bubble_of(w)
    local = w.local_params()
    n_dcn = math.prod(int(w.dcn.get(a, 1)) for a in ("data", "fsdp"))
    dcn = 2 * (n_dcn - 1) / n_dcn * local / d * w.grad_bytes / (chip.slow_link * eps_dcn) if n_dcn > 1 else 0.0
    if w.dcn_overlap:  # buckets reduced behind the last microbatch's backward
        dcn = np.maximum(0.0, dcn - hides)
    if w.stage_bytes is not None:  # counted over every tick already: not stretched
        parts["stage_exposed_s"] = w.stage_bytes / stage_bw
    parts |= dict(bubble_s=busy * bubble / (1 - bubble), optimizer_s=28 * local / chip.hbm_bandwidth, dcn_exposed_s=dcn)
    return parts | dict(step_s=sum(parts.values()))


def _paced_by(layers: dict, head, busiest: int, last: int) -> tuple[dict, object]:
    """A stage's ``layers`` parts (for the ``busiest`` stage's layers) and the ``head``, for the stage that
    sets the pace: the last one (its ``last`` layers and the head) where that takes longer, else the
    busiest one without the head."""
    per_layer = sum(x for k, x in layers.items() if k != "hides_s") / busiest
    last_paces = last * per_layer + head >= busiest * per_layer
    scale = np.where(last_paces, last / busiest, 1.0)
    return {k: x * scale for k, x in layers.items()}, np.where(last_paces, head, 0.0)


def model_flops(
    w: Workload, *, causal_attention: bool = True, count_embedding: bool = False, recomputed_forward: bool = False
) -> float:
    """Per device per step, as MFU counts them: 6 per weight per token plus attention, 12·L·H·D_h·S per
    token, halved when ``causal_attention``. The vocabulary matrix of the logits is a weight; an untied
    input embedding is a lookup and counts only with ``count_embedding`` (MaxText counts every parameter).
    ``recomputed_forward``: the layers' forward once more (Megatron-LM's Eq. 3 counts full recompute)."""
    params = w.params(2 if count_embedding and not w.tied else 1, active=True)
    tokens = w.batch * w.seq / w.devices
    att = 6 * w.num_layers * w.num_heads * (w.qk_dim + w.v_dim) * w.seq * (0.5 if causal_attention else 1.0)
    extra = (2 * w.params(0, active=True) + att / 3) if recomputed_forward else 0.0
    return tokens * (6 * params + att + extra)


def mechanism_times(w: Workload, chip, cal: Calibration) -> dict:
    """``step_seconds`` under ``cal`` (the published one: ``jaxpar.analysis.calibration.CALIBRATED``), in
    the keys ``jaxpar.analysis.prediction.predict`` reports: compute (matmuls, attention, LM head), memory
    (elementwise work and the optimizer over HBM), exposed communication per kind, the stages' busy time
    with its bubble (``pipelined_s``), and the parts."""
    parts = {k: float(v) for k, v in step_seconds(w, chip, cal).items()}
    exposed = {k.removesuffix("_exposed_s"): v for k, v in parts.items() if k.endswith("_exposed_s")}
    after = parts["optimizer_s"] + parts["dcn_exposed_s"] + (exposed["stage"] if w.stage_bytes is not None else 0.0)
    return dict(
        compute_s=parts["matmul_s"] + parts["attention_s"] + parts["head_s"],
        memory_s=parts["elementwise_s"] + parts["optimizer_s"],
        bubble_fraction=bubble_of(w),
        pipelined_s=parts["step_s"] - after,  # the stages, bubble in
        communication_s=exposed,
        exposed_communication_s=sum(exposed.values()),
        step_s=parts["step_s"],
        parts=parts,
        calibration=dict(
            matmul=cal.matmul[chip.family],
            collective=cal.collective[chip.family],
            grouped=cal.grouped_share(chip.family, w.fp8),
            fp8=cal.fp8.get(chip.family, cal.matmul[chip.family]),
            dcn=cal.dcn[chip.family],
        ),
    )
