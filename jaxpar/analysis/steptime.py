"""A training step's time from its mechanisms: what each device computes, reads and sends, layer by layer,
and which of it can run at the same time.

One transformer layer on one device, per step (T: tokens per tensor group, t: the tensor split):
    matmuls       q, k/v (MLA: through their latents), attention output, MLP in (2 matrices gated, 1 plain),
                  MLP out: [T, K] × [K, N] each at ``matmul_seconds`` (a roofline: the chip's matmul efficiency
                  on padded shapes, or the HBM traffic of the three operands, whichever is slower)
    attention     2·T·S·H/t·(qk + v) FLOPs forward (4·T·S·H/t·D_h without MLA), halved when causal (flash
                  kernels skip the masked blocks; ``Workload.attention_share`` under context parallelism), at
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

Pipelines (``stage`` p > 1, m microbatches a step, v layer chunks a device): a device runs L/p layers on
every microbatch, the last stage the LM head as well (it sets the pace: the stages' busy time is the last
one's); each chunk boundary sends a microbatch's [T, D] activations forward and their gradient back over
the stage link, split over tensor (Megatron's scatter/gather), exposed. The schedule idles
(p − 1)/(v·m + p − 1) of the step (1F1B, interleaved when v > 1; ``Workload.bubble`` where a schedule
table gives its own), so the bubble adds busy × bubble/(1 − bubble). jaxpar's own executor
(``Workload.executor``) recomputes a chunk's forward in its backward and runs the LM head (masked) in
every chunk's backward on every stage; its sends on the critical path are read from the compiled program
(``Workload.stage_bytes``, ``jaxpar.analysis.plan``).

Communication, and what hides it (the mechanisms the issue names; nothing is a global overlap share):
    fsdp       weights gathered forward and again backward, gradients reduce-scattered: a layer's gather
               is prefetched behind the previous layer's forward, the backward's gather and
               reduce-scatter behind the layer's backward (async collective fusion on TPU, the latency-
               hiding scheduler on GPU XLA, FSDP2's prefetch): exposed only what exceeds that compute
    data       (ICI) gradients all-reduced per layer behind the backward, like fsdp's reduce-scatter
    tensor     two all-reduces of [T, D] per forward (and per recomputed forward), two per backward. The
               forward's sit between dependent matmuls: exposed. The backward's can run beside the
               weight-gradient matmuls, which do not depend on them, where the platform overlaps them
               (``Hardware.tensor_overlap``: TPU async collective fusion; GPU without async TP: exposed)
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

from jaxpar.analysis.links import axis_links

# HBM bytes per attention score in a forward without a flash kernel (fp16, Megatron-LM 2021): QKᵀ writes it
# (2), the fused scale-mask-softmax reads and writes it (4), dropout reads and writes it with a 1-byte
# mask (5), the AV matmul reads it (2)
SCORE_BYTES = 13
AXES = ("data", "fsdp", "tensor", "stage", "expert", "sequence")
CONTEXT = ("ring", "ulysses", "allgather")

# what the backward runs again of the forward: (matmuls: a share of all, or a tuple naming the ones kept, the
# rest recomputed; attention; elementwise work). Matmul names: ``layer_forward``.
RECOMPUTE = {
    "none": (0.0, 0.0, 0.0),
    "dots": (0.0, 1.0, 1.0),         # matmul outputs kept (MaxText "minimal", jaxpar remat=dots)
    "full": (1.0, 1.0, 1.0),         # every layer recomputed from its input
    "dots_flash": (0.0, 0.0, 1.0),   # matmul and flash-attention outputs kept (MaxText "minimal_flash")
    "op_sac": (0.5, 0.0, 1.0),       # torchtitan selective op AC: every other matmul output and attention kept
    "half": (0.5, 0.5, 0.5),         # torchtitan selective layer AC (every second layer recomputed)
    "attn": (("q", "kv", "out"), 0.0, 1.0),  # jaxpar remat=attn: q/k/v and attention output kept, the MLP recomputed
    # MaxText's custom policies: the named projections offloaded to host memory (the transfers run beside
    # compute) or kept on the device, attention (unless its output, "context", is kept) and the rest (the
    # MLP or the experts with their routing) recomputed
    "offload_qkv_out": (("q", "kv", "out"), 1.0, 1.0),
    "offload_qkv": (("q", "kv"), 1.0, 1.0),
    "keep_qkv_context": (("q", "kv"), 0.0, 1.0),
    "keep_qkv_context_mlpwo": (("q", "kv", "mlp_out"), 0.0, 1.0),
    "keep_kv_mlpwo": (("kv", "mlp_out"), 1.0, 1.0),
}
# matmuls whose outputs no backward reads (a matmul's gradient needs its input, not its output, and these
# feed the residual stream only): JAX's remat leaves them out of the recomputed forward (``remat_dce``)
UNREAD = ("mlp_out", "combine", "shared_out")


@dataclasses.dataclass(frozen=True)
class Workload:
    """A dense decoder-only transformer's step: the model's shape, the batch, the layout, the remat policy.
    ``mesh``: ICI sizes of data, fsdp, tensor (1 when absent); ``dcn``: across-slice (or across-node) sizes."""
    embed_dim: int
    num_heads: int
    kv_heads: int
    head_dim: int
    mlp_dim: int
    mlp_matrices: int                # 3 gated (SwiGLU), 2 plain (relu/gelu)
    num_layers: int
    vocab: int
    batch: int                       # sequences per step, all devices
    seq: int
    mesh: dict
    dcn: dict = dataclasses.field(default_factory=dict)
    remat: str = "full"
    weight_bytes: int = 4            # as the FSDP gather moves weights (f32 params: 4; FSDP2 bf16: 2)
    grad_bytes: int = 4
    act_bytes: int = 2
    causal: bool = True
    tied: bool = True                # logits through the input embedding
    microbatch: int = 0              # sequences a microbatch holds (0: a replica's whole batch at once)
    virtual_stages: int = 1          # layer chunks per stage device (v > 1: the interleaved schedule)
    bubble: float | None = None      # the schedule's idle share where a table gives it (default 1F1B's)
    flash: bool = True               # attention in a flash kernel (False: scores materialized in HBM)
    dcn_overlap: bool = False        # DCN gradient reduction behind the backward (torch DDP's buckets)
    executor: bool = False           # jaxpar's pipeline executor (stage recompute, the head in every chunk)
    stage_bytes: float | None = None  # stage sends on the step's critical path, where a program gives them
    # mixture of experts (``experts`` > 0): the last num_layers − dense_layers layers route each token to
    # top_k of ``experts`` gated MLPs of width expert_mlp_dim, beside an always-on one of shared_mlp_dim
    experts: int = 0
    top_k: int = 0
    expert_mlp_dim: int = 0
    capacity_factor: float | None = None  # slots per expert per sequence (one-hot dispatch); None: dropless
    shared_mlp_dim: int = 0
    dense_layers: int = 0
    expert_fsdp: bool = False        # ``expert`` shards the other weights like fsdp (MaxText), not replicas
    # context parallelism (``sequence`` > 1): ring (K/V blocks around the ring, the sequence stored in
    # ``cp_order``), ulysses (all-to-all from positions to heads and back) or allgather (every device
    # gathers the full K/V, the sequence in its natural order: what GSPMD does for jaxpar's ``none``)
    context_parallel: str = "ring"
    cp_order: str = "zigzag"
    remat_dce: bool = True           # the recomputed forward skips ``UNREAD`` (JAX; torch checkpointing reruns all)
    # Multi-head Latent Attention (``kv_lora`` > 0, DeepSeek): head_dim is the no-RoPE query/key width,
    # qk_rope the RoPE one, v_head the value width; q through a q_lora latent (0: directly)
    kv_lora: int = 0
    q_lora: int = 0
    qk_rope: int = 0
    v_head: int = 0

    def size(self, axis: str) -> int:
        return int(self.mesh.get(axis, 1)) * int(self.dcn.get(axis, 1))

    @property
    def devices(self) -> int:
        return math.prod(self.size(a) for a in set(self.mesh) | set(self.dcn))

    @property
    def replicas(self) -> int:
        """The ways the batch splits: data × fsdp × expert (outside MoE layers ``expert`` splits it too)."""
        return self.size("data") * self.size("fsdp") * self.size("expert")

    @property
    def microbatches(self) -> int:
        seqs = self.batch // self.replicas
        return seqs // self.microbatch if self.microbatch else 1

    @property
    def attention_share(self) -> float:
        """The share of its queries' full attention over all S keys a device computes: half when causal
        (flash kernels skip masked blocks); under ring attention the busiest device's live tiles of its
        4n (query half, key half) pairs, by the kernel's own rule (``jaxpar.parallel.ring.ring_work``);
        gathered K/V in natural order, the last device's: (n − 1/2)/n (half where the order balances it)."""
        n = self.size("sequence")
        if not self.causal:
            return 1.0
        if n == 1 or self.context_parallel == "ulysses":
            return 0.5
        if self.context_parallel == "allgather":            # zigzag: load-balanced as a ring's
            return (n - 0.5) / n if self.cp_order == "contiguous" else 0.5
        from jaxpar.parallel.ring import ring_work
        return float(ring_work(4 * n, n, self.cp_order).max()) / (4 * n)

    @property
    def moe_layers(self) -> int:
        return self.num_layers - self.dense_layers if self.experts else 0

    @property
    def slots_per_token(self) -> float:
        """Expert slots a token's place pays for: E·C/S with C = max(1, ceil(capacity_factor·S·k/E)) slots
        per expert and sequence, or top_k dropless."""
        if self.capacity_factor is None:
            return self.top_k
        return self.experts * max(1, math.ceil(self.capacity_factor * self.seq * self.top_k / self.experts)) / self.seq

    def params(self, vocab_matrices: int | None = None, *, active: bool = False) -> int:
        """Weights of the matmuls: the layers and ``vocab_matrices`` [V, D] matrices (default: 1 tied, 2 not);
        ``active``: a MoE layer's top_k experts only (what one token meets, as MFU counts)."""
        vocab_matrices = (1 if self.tied else 2) if vocab_matrices is None else vocab_matrices
        moe = self.layer_params(True, active=active) if self.moe_layers else 0
        return ((self.num_layers - self.moe_layers) * self.layer_params() + self.moe_layers * moe
                + vocab_matrices * self.vocab * self.embed_dim)

    @property
    def qk_dim(self) -> int:
        return self.head_dim + self.qk_rope

    @property
    def v_dim(self) -> int:
        return self.v_head or self.head_dim

    @property
    def kv_width(self) -> int:
        """Key and value values a token holds for attention: 2·H_kv·D_h, or MLA's expanded H·(qk + v)."""
        return self.num_heads * (self.qk_dim + self.v_dim) if self.kv_lora else 2 * self.kv_heads * self.head_dim

    def attention_shapes(self, t: int = 1) -> dict:
        """The attention's matmuls, {name: [(K, N), ...]}, on one of ``t`` tensor shards: q, kv, out. MLA's
        latent down-projections are not split over tensor; their up-projections are."""
        D, H = self.embed_dim, self.num_heads
        if not self.kv_lora:
            return dict(q=[(D, H * self.head_dim // t)], kv=[(D, self.kv_width // t)], out=[(H * self.head_dim // t, D)])
        q_out = H * self.qk_dim // t
        q = [(D, self.q_lora), (self.q_lora, q_out)] if self.q_lora else [(D, q_out)]
        kv = [(D, self.kv_lora + self.qk_rope), (self.kv_lora, H * (self.head_dim + self.v_dim) // t)]
        return dict(q=q, kv=kv, out=[(H * self.v_dim // t, D)])

    def layer_params(self, moe: bool = False, *, active: bool = False) -> int:
        """One layer's weights: attention and MLP, or (``moe``) attention, router, shared MLP and the
        experts (``expert_params``; top_k of them when ``active``)."""
        d, m = self.embed_dim, self.mlp_matrices
        attention = sum(k * n for shapes in self.attention_shapes().values() for k, n in shapes)
        if not moe:
            return attention + m * d * self.mlp_dim
        experts = self.expert_params * (self.top_k / self.experts if active else 1)
        return int(attention + d * self.experts + m * d * self.shared_mlp_dim + experts)

    @property
    def expert_params(self) -> int:
        return self.experts * self.mlp_matrices * self.embed_dim * self.expert_mlp_dim

    def local_params(self) -> float:
        """The weights one device holds: split over tensor, fsdp and stage; the experts over ``expert``
        as well, the rest too where ``expert_fsdp``."""
        e, experts = self.size("expert"), self.moe_layers * self.expert_params
        split = self.size("tensor") * self.size("fsdp") * self.size("stage")
        return (self.params() - experts) / (split * (e if self.expert_fsdp else 1)) + experts / (split * e)

    def check(self) -> None:
        from jaxpar.errors import ConfigError
        for axis, n in {**self.mesh, **{f"dcn.{a}": v for a, v in self.dcn.items()}}.items():
            if axis.removeprefix("dcn.") not in AXES or int(n) < 1:
                raise ConfigError(f"mesh: {axis}={n}: the step-time model takes {', '.join(AXES)} sizes ≥ 1")
        if self.remat not in RECOMPUTE:
            raise ConfigError(f"remat={self.remat!r}: known policies are {', '.join(RECOMPUTE)}")
        split = self.replicas * max(self.microbatch, 1)
        if self.batch % split:
            raise ConfigError(f"batch={self.batch}: not divisible by the {split} sequences of data × fsdp × "
                              f"expert × microbatch={self.microbatch}")
        e = self.size("expert")
        if self.experts % e or (e > 1 and not self.experts):
            raise ConfigError(f"experts={self.experts}: not divisible by expert={e}")
        if self.experts and not (1 <= self.top_k <= self.experts and 0 <= self.dense_layers < self.num_layers):
            raise ConfigError(f"top_k={self.top_k}, dense_layers={self.dense_layers}: need 1 ≤ top_k ≤ "
                              f"experts={self.experts} and 0 ≤ dense_layers < num_layers={self.num_layers}")
        chunks = self.size("stage") * self.virtual_stages
        if self.num_layers % chunks:
            raise ConfigError(f"num_layers={self.num_layers}: not divisible by stage × virtual_stages = {chunks}")
        n = self.size("sequence")
        if n > 1 and (self.context_parallel not in CONTEXT or self.cp_order not in ("zigzag", "contiguous")):
            raise ConfigError(f"context_parallel={self.context_parallel!r}, cp_order={self.cp_order!r}: sequence={n} "
                              f"takes {', '.join(CONTEXT)} (cp_order zigzag or contiguous)")
        if n > 1 and self.context_parallel == "ulysses" and self.num_heads % (n * self.size("tensor")):
            raise ConfigError(f"num_heads={self.num_heads}: ulysses needs them divisible by sequence × tensor = "
                              f"{n * self.size('tensor')}")
        if self.seq % (2 * n if n > 1 and self.context_parallel == "ring" and self.cp_order == "zigzag" else n):
            raise ConfigError(f"seq={self.seq}: not divisible by the sequence={n} blocks (2 each, zigzag)")
        t = self.size("tensor")
        for name in ("num_heads", "mlp_dim", "vocab", "expert_mlp_dim", "shared_mlp_dim"):
            if getattr(self, name) % t:
                raise ConfigError(f"{name}={getattr(self, name)}: not divisible by tensor={t}")


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The fitted constants (``jaxpar.analysis.calibration`` fits them on published runs): the share of
    peak a large well-shaped matmul reaches, and the share of a link's bandwidth a collective reaches,
    on the fast links and on DCN/IB. Keyed by the chip's family (``Hardware.family``). ``grouped``: the
    share of the matmul share that dropless experts' grouped matmuls reach, where runs measure it (else 1)."""
    matmul: dict
    collective: dict
    dcn: dict
    grouped: dict = dataclasses.field(default_factory=dict)


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
    routing = 4 * w.top_k * D if w.capacity_factor is None else 2 * w.slots_per_token
    return (attention + mlp) / t + routing


def matmul_seconds(m, k, n, chip, efficiency):
    """[m, k] × [k, n] in bf16: padded to the chip's tile, at ``efficiency`` × peak, or its operands over
    HBM, whichever is slower (``efficiency`` may be a numpy array: the calibration's grid)."""
    tile = chip.matmul_tile
    padded = math.prod(math.ceil(x / tile) * tile for x in (m, k, n))
    compute = 2.0 * padded / (chip.peak_bf16_flops * efficiency)
    return np.maximum(compute, 2.0 * (m * k + k * n + m * n) / chip.hbm_bandwidth)


def layer_forward(w: Workload, chip, eta, tokens: float, moe: bool = False, grouped=1.0) -> tuple:
    """One layer's forward on ``tokens`` tokens of one tensor group, in seconds: (the matmuls by name,
    attention, elementwise work); ``eta`` the matmul share of peak. A MoE layer (``moe``) replaces the MLP
    with the router, the experts on their slots (each device runs E/e experts on E·C/S·T slots in all, the
    e − 1 other devices' tokens included) and the shared MLP; with a capacity, the one-hot dispatch and
    combine einsums ([E·C, S] × [S, D] per sequence); dropless, the experts as grouped matmuls at ``grouped``
    × ``eta``."""
    t, D = w.size("tensor"), w.embed_dim
    mm = {name: sum(matmul_seconds(tokens, k, n, chip, eta) for k, n in shapes)
          for name, shapes in w.attention_shapes(t).items()}
    if not moe:
        mm |= dict(mlp_in=matmul_seconds(tokens, D, (w.mlp_matrices - 1) * w.mlp_dim // t, chip, eta),
                   mlp_out=matmul_seconds(tokens, w.mlp_dim // t, D, chip, eta))
    else:
        local, slots = w.experts // w.size("expert"), w.slots_per_token * tokens
        each = slots / local                              # slots of one local expert
        eta_x = eta * (grouped if w.capacity_factor is None else 1.0)
        mm |= dict(router=matmul_seconds(tokens, D, w.experts, chip, eta),
                   experts_in=local * matmul_seconds(each, D, (w.mlp_matrices - 1) * w.expert_mlp_dim // t, chip, eta_x),
                   experts_out=local * matmul_seconds(each, w.expert_mlp_dim // t, D, chip, eta_x))
        if w.capacity_factor is not None:
            mm["dispatch"] = mm["combine"] = matmul_seconds(slots, w.seq, D // t, chip, eta)
        if w.shared_mlp_dim:
            mm |= dict(shared_in=matmul_seconds(tokens, D, (w.mlp_matrices - 1) * w.shared_mlp_dim // t, chip, eta),
                       shared_out=matmul_seconds(tokens, w.shared_mlp_dim // t, D, chip, eta))
    att_flops = 2.0 * tokens * w.seq * w.num_heads / t * (w.qk_dim + w.v_dim)
    if w.flash:
        att = att_flops * w.attention_share / (chip.peak_bf16_flops * eta * chip.attention_efficiency)
    else:
        att = (att_flops / (chip.peak_bf16_flops * eta)
               + tokens * w.seq * w.num_heads / t * SCORE_BYTES / chip.hbm_bandwidth)
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
    t, f, d, e = w.size("tensor"), int(w.mesh.get("fsdp", 1)), int(w.mesh.get("data", 1)), w.size("expert")
    by_name, att, ew = layer_forward(w, chip, cal.matmul[chip.family], tokens, moe, cal.grouped.get(chip.family, 1.0))
    mm = sum(by_name.values())
    r_mm, r_att, r_ew = RECOMPUTE[w.remat]
    r_x = r_mm                                         # the experts' share (their all-to-all runs again too)
    unread = UNREAD if w.remat_dce else ()
    if isinstance(r_mm, tuple):                        # the named matmuls kept, the others recomputed
        r_x = float("experts_in" not in r_mm)
        r_mm = sum(v for name, v in by_name.items() if name not in r_mm + unread) / mm
    else:
        r_mm = r_mm * sum(v for name, v in by_name.items() if name not in unread) / mm
    if w.executor and w.size("stage") > 1:             # each backward recomputes its chunk's forward
        r_mm, r_att, r_ew, r_x = r_mm + 1, r_att + 1, r_ew + 1, r_x + 1
    fwd = mm + att + ew
    recompute = r_mm * mm + r_att * att + r_ew * ew
    mm_bwd = 2 * mm - by_name.get("dispatch", 0.0)   # input and weight gradients; the dispatch mask has none
    bwd = mm_bwd + 2.5 * att + 2 * ew

    # weights per tensor shard: the experts split over expert and fsdp, the rest over fsdp (and expert)
    experts = w.expert_params / t if moe else 0.0
    rest = w.layer_params(moe) / t - experts
    g = f * e if w.expert_fsdp else f
    gathered = (g - 1) / g * rest + (f - 1) / f * experts / e
    gather, scatter = gathered * w.weight_bytes / bw["fsdp"], gathered * w.grad_bytes / bw["fsdp"]
    held = rest / g + experts / (e * f)
    reduce = 2 * (d - 1) / d * held * w.grad_bytes / bw["data"]
    if e > 1 and not w.expert_fsdp:                    # the rest's replicas over expert reduce their gradients
        reduce = reduce + 2 * (e - 1) / e * rest / f * w.grad_bytes / bw["expert"]
    n = w.size("sequence")
    if n > 1:                                          # every weight is replicated over sequence
        reduce = reduce + 2 * (n - 1) / n * held * w.grad_bytes / bw["sequence"]
    tp = 2 * 2 * (t - 1) / t * tokens * w.embed_dim * w.act_bytes / bw["tensor"] if t > 1 else 0.0
    tp_bwd = np.maximum(0.0, tp - mm) if chip.tensor_overlap else tp      # beside the weight-gradient matmuls
    # a layer's gather behind the previous forward; the backward's gather, scatter and reduce behind it
    fsdp = np.maximum(0.0, gather - fwd) + np.maximum(0.0, gather + scatter + reduce - recompute - bwd)
    # expert all-to-all: the slots out to their experts and back (dispatch, combine); in the forward between
    # dependent matmuls, in the backward beside the experts' weight-gradient matmuls where the platform
    # overlaps them, as tensor's
    a2a = (2 * (e - 1) / e * w.slots_per_token * tokens * w.embed_dim / t * w.act_bytes / bw["expert"]
           if moe and e > 1 else 0.0)
    experts_mm = by_name.get("experts_in", 0.0) + by_name.get("experts_out", 0.0)
    a2a_bwd = np.maximum(0.0, a2a - experts_mm) if chip.tensor_overlap else a2a
    cp = context_seconds(w, chip, bw, tokens, att) if n > 1 else (0.0, 0.0)
    return dict(matmul_s=(1 + r_mm) * mm + mm_bwd, attention_s=(3.5 + r_att) * att, elementwise_s=(3 + r_ew) * ew,
                tensor_exposed_s=(1 + r_mm) * tp + tp_bwd, fsdp_exposed_s=fsdp, expert_exposed_s=(1 + r_x) * a2a + a2a_bwd,
                sequence_exposed_s=(1 + r_att) * cp[0] + cp[1], hides_s=bwd + recompute)


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
    tokens = w.batch * w.seq / (w.replicas * w.size("sequence") * m)   # per tensor group and microbatch
    bw = {a: b * (eps_dcn if slow else eps) for a, (b, slow) in axis_links(w, chip, with_class=True).items()}
    layers = {}                                        # a stage's layers; the last stage's LM head on top
    for moe, n in ((False, w.num_layers - w.moe_layers), (True, w.moe_layers)):
        for k, x in (layer_seconds(w, chip, cal, bw, tokens, moe).items() if n else ()):
            layers[k] = layers.get(k, 0.0) + n / p * x
    hides = layers.pop("hides_s")
    stage_bw = bw["stage"] if int(w.mesh.get("stage", 1)) > 1 else chip.slow_link * eps_dcn
    send = 2 * v * tokens * w.embed_dim * w.act_bytes / t / stage_bw if p > 1 and w.stage_bytes is None else 0.0
    head = (3 * matmul_seconds(tokens, w.embed_dim, w.vocab // t, chip, cal.matmul[chip.family])
            + 16 * tokens * w.vocab / t / chip.hbm_bandwidth)
    if w.executor and p > 1:                           # and runs the head (masked) on every stage
        head = head * v
    parts = {k: m * x for k, x in dict(layers, head_s=head, stage_exposed_s=send).items()}
    busy = sum(parts.values())
    bubble = bubble_of(w)
    local = w.local_params()
    n_dcn = math.prod(int(w.dcn.get(a, 1)) for a in ("data", "fsdp"))
    dcn = 2 * (n_dcn - 1) / n_dcn * local / d * w.grad_bytes / (chip.slow_link * eps_dcn) if n_dcn > 1 else 0.0
    if w.dcn_overlap:                                  # buckets reduced behind the last microbatch's backward
        dcn = np.maximum(0.0, dcn - hides)
    if w.stage_bytes is not None:                      # counted over every tick already: not stretched
        parts["stage_exposed_s"] = w.stage_bytes / stage_bw
    parts |= dict(bubble_s=busy * bubble / (1 - bubble), optimizer_s=28 * local / chip.hbm_bandwidth, dcn_exposed_s=dcn)
    return parts | dict(step_s=sum(parts.values()))


def model_flops(w: Workload, *, causal_attention: bool = True, count_embedding: bool = False,
                recomputed_forward: bool = False) -> float:
    """Per device per step, as MFU counts them: 6 per weight per token plus attention, 12·L·H·D_h·S per
    token, halved when ``causal_attention``. The vocabulary matrix of the logits is a weight; an untied
    input embedding is a lookup and counts only with ``count_embedding`` (MaxText counts every parameter).
    ``recomputed_forward``: the layers' forward once more (Megatron-LM's Eq. 3 counts full recompute)."""
    params = w.params(2 if count_embedding and not w.tied else 1, active=True)
    tokens = w.batch * w.seq / w.devices
    att = 6 * w.num_layers * w.num_heads * (w.qk_dim + w.v_dim) * w.seq * (0.5 if causal_attention else 1.0)
    extra = (2 * w.params(0, active=True) + att / 3) if recomputed_forward else 0.0
    return tokens * (6 * params + att + extra)


def workload_of(cfg, mesh: dict, *, batch: int, seq: int, dcn: dict | None = None,
                pipeline: dict | None = None) -> Workload | None:
    """The ``Workload`` of a jaxpar model under ``mesh`` (ICI axis sizes), or None where the model does not
    describe it: expert-choice routing. A split sequence without ring or Ulysses attention
    is GSPMD's: the full K/V gathered on every device (``allgather``).
    ``pipeline`` (with ``stage`` > 1): microbatches, virtual_stages, bubble and stage_bytes of the executor."""
    moe = getattr(cfg, "moe", None)
    if moe is not None and moe.router == "expert_choice":
        return None
    dcn = {a: int(n) for a, n in (dcn or {}).items() if int(n) > 1}
    sizes = {a: int(n) for a, n in mesh.items() if int(n) > 1}
    cp = str(getattr(cfg, "context_parallel", "none"))
    if set(sizes) - set(AXES) or set(dcn) - set(AXES):
        return None
    pipe, experts, mla = {}, {}, {}
    if pipeline and sizes.get("stage", 1) * dcn.get("stage", 1) > 1:
        replicas = math.prod(sizes.get(a, 1) * dcn.get(a, 1) for a in ("data", "fsdp", "expert"))
        pipe = dict(microbatch=batch // (replicas * pipeline["microbatches"]), executor=True,
                    **{k: pipeline[k] for k in ("virtual_stages", "bubble", "stage_bytes")})
    if moe is not None:
        experts = dict(experts=moe.num_experts, top_k=moe.top_k, expert_mlp_dim=moe.mlp_dim,
                       capacity_factor=moe.capacity_factor, shared_mlp_dim=moe.num_shared_experts * moe.shared_mlp_dim,
                       dense_layers=cfg.first_dense_layers)
    if getattr(cfg, "mla", None) is not None:
        m = cfg.mla
        mla = dict(kv_lora=m.kv_lora_rank, q_lora=m.q_lora_rank or 0, qk_rope=m.qk_rope_head_dim, v_head=m.v_head_dim)
    head_dim = cfg.mla.qk_nope_head_dim if mla else cfg.head_dim
    return Workload(embed_dim=cfg.embed_dim, num_heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=head_dim,
                    mlp_dim=cfg.mlp_dim, mlp_matrices=3, num_layers=cfg.num_layers, vocab=cfg.padded_vocab, batch=batch,
                    seq=seq, mesh=sizes, dcn=dcn, remat=cfg.remat.value,
                    weight_bytes=np.dtype(str(cfg.param_dtype)).itemsize, grad_bytes=4,
                    act_bytes=np.dtype(str(cfg.dtype)).itemsize, tied=cfg.tie_embeddings,
                    causal=cfg.sliding_window is None, context_parallel="allgather" if cp == "none" else cp,
                    cp_order="contiguous" if cp != "ring" else str(getattr(cfg, "cp_order", "zigzag")), **pipe, **experts,
                    **mla)


def mechanism_times(w: Workload, chip, cal: Calibration | None = None) -> dict:
    """``step_seconds`` under the published calibration (``jaxpar.analysis.calibration.CALIBRATED``), in
    the keys ``jaxpar.analysis.plan.predict`` reports: compute (matmuls, attention, LM head), memory
    (elementwise work and the optimizer over HBM), exposed communication per kind, the stages' busy time
    with its bubble (``pipelined_s``), and the parts."""
    from jaxpar.analysis.calibration import CALIBRATED

    cal = cal or CALIBRATED
    parts = {k: float(v) for k, v in step_seconds(w, chip, cal).items()}
    exposed = {k.removesuffix("_exposed_s"): v for k, v in parts.items() if k.endswith("_exposed_s")}
    after = parts["optimizer_s"] + parts["dcn_exposed_s"] + (exposed["stage"] if w.stage_bytes is not None else 0.0)
    return dict(compute_s=parts["matmul_s"] + parts["attention_s"] + parts["head_s"],
                memory_s=parts["elementwise_s"] + parts["optimizer_s"],
                bubble_fraction=bubble_of(w), pipelined_s=parts["step_s"] - after,   # the stages, bubble in
                communication_s=exposed, exposed_communication_s=sum(exposed.values()), step_s=parts["step_s"],
                parts=parts, calibration=dict(matmul=cal.matmul[chip.family], collective=cal.collective[chip.family],
                                              grouped=cal.grouped.get(chip.family, 1.0),
                                              dcn=cal.dcn[chip.family]))
