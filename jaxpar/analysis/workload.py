"""What a training step runs, as the step-time model (``jaxpar.analysis.steptime``) prices it: the model's
shape, the batch, the layout over data, fsdp, tensor, stage, expert and sequence (``dcn`` factors for the
slow links), the remat policy and what each policy recomputes, the experts, MLA and context parallelism;
and ``workload_of``, a jaxpar model config's workload. The module docstring of ``steptime`` says how each
field is priced."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxpar.analysis.costmodel import flash_attention
from jaxpar.errors import ConfigError
from jaxpar.mesh import AXES
from jaxpar.parallel.ring import ring_work

CONTEXT = ("ring", "ulysses", "allgather")

# what the backward runs again of the forward: (matmuls: a share of all, or a tuple naming the ones kept, the
# rest recomputed; attention; elementwise work). Matmul names: ``layer_forward``.
RECOMPUTE = {
    "none": (0.0, 0.0, 0.0),
    "dots": (0.0, 1.0, 1.0),  # matmul outputs kept (MaxText "minimal", jaxpar remat=dots)
    "full": (1.0, 1.0, 1.0),  # every layer recomputed from its input
    "dots_flash": (0.0, 0.0, 1.0),  # matmul and flash-attention outputs kept (MaxText "minimal_flash")
    "op_sac": (0.5, 0.0, 1.0),  # torchtitan selective op AC: every other matmul output and attention kept
    "half": (0.5, 0.5, 0.5),  # torchtitan selective layer AC (every second layer recomputed)
    # jaxpar remat=attn: q/k/v, the attention context and output kept, the MLP recomputed; attention
    # (None) reruns its scores' half for the probabilities its gradient reads (XLA's: QKᵀ and the
    # softmax; the context's AV product is kept), a flash kernel its whole forward for its statistics
    "attn": (("q", "kv", "out"), None, 1.0),
    # MaxText's custom policies: the named projections offloaded to host memory (the transfers run beside
    # compute) or kept on the device, attention (unless its output, "context", is kept) and the rest (the
    # MLP or the experts with their routing) recomputed
    "offload_qkv_out": (("q", "kv", "out"), 1.0, 1.0),
    "offload_qkv": (("q", "kv"), 1.0, 1.0),
    "keep_qkv_context": (("q", "kv"), 0.0, 1.0),
    "keep_qkv_context_mlpwo": (("q", "kv", "mlp_out"), 0.0, 1.0),
    "keep_kv_mlpwo": (("kv", "mlp_out"), 1.0, 1.0),
    "keep_mlpwo": (("mlp_out", "experts_out"), 1.0, 1.0),
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
    mlp_matrices: int  # 3 gated (SwiGLU), 2 plain (relu/gelu)
    num_layers: int
    vocab: int
    batch: int  # sequences per step, all devices
    seq: int
    mesh: dict
    dcn: dict = dataclasses.field(default_factory=dict)
    remat: str = "full"
    weight_bytes: int = 4  # as the FSDP gather moves weights (f32 params: 4; FSDP2 bf16: 2)
    grad_bytes: int = 4
    act_bytes: int = 2
    causal: bool = True
    window: int = 0  # a sliding window of this many keys (0: every earlier key) …
    window_layers: int = 0  # … on this many of the layers (0: all of them; gpt-oss alternates)
    tied: bool = True  # logits through the input embedding
    microbatch: int = 0  # sequences a microbatch holds (0: a replica's whole batch at once)
    virtual_stages: int = 1  # layer chunks per stage device (v > 1: the interleaved schedule)
    stage_split: tuple = ()  # the pipelined stack's layers on each stage where uneven (Megatron's first/last)
    bubble: float | None = None  # the schedule's idle share where a table gives it (default 1F1B's)
    flash: bool = True  # attention in a flash kernel (False: scores materialized in HBM)
    attention_kernel: str = ""  # "fa2": FlashAttention-2 (a GPU's own profile prices FA3/cuDNN's kernel)
    dcn_overlap: bool = False  # DCN gradient reduction behind the backward (torch DDP's buckets)
    executor: bool = False  # jaxpar's one-section-a-tick executor (stage recompute, the head in every chunk)
    stage_bytes: float | None = None  # stage sends on the step's critical path, where a program gives them
    gather_once: bool = False  # fsdp weights gathered once a step and kept (the executor's fsdp_gather=step)
    reduce_once: bool = False  # gradients reduced once a step, not per microbatch (grad_reduce=step)
    # mixture of experts (``experts`` > 0): the last num_layers − dense_layers layers route each token to
    # top_k of ``experts`` gated MLPs of width expert_mlp_dim, beside an always-on one of shared_mlp_dim
    experts: int = 0
    top_k: int = 0
    expert_mlp_dim: int = 0
    capacity_factor: float | None = None  # slots per expert per sequence (one-hot dispatch); None: dropless
    shared_mlp_dim: int = 0
    dense_layers: int = 0
    expert_fsdp: bool = False  # ``expert`` shards the other weights like fsdp (MaxText), not replicas
    # context parallelism (``sequence`` > 1): ring (K/V blocks around the ring, the sequence stored in
    # ``cp_order``), ulysses (all-to-all from positions to heads and back) or allgather (every device
    # gathers the full K/V, the sequence in its natural order: what GSPMD does for jaxpar's ``none``)
    context_parallel: str = "ring"
    cp_order: str = "zigzag"
    remat_dce: bool = True  # the recomputed forward skips ``UNREAD`` (JAX; torch checkpointing reruns all)
    # Multi-head Latent Attention (``kv_lora`` > 0, DeepSeek): head_dim is the no-RoPE query/key width,
    # qk_rope the RoPE one, v_head the value width; q through a q_lora latent (0: directly)
    fp8: bool = False  # the layers' weight matmuls in FP8, forward and backward (MaxText's fp8_full)
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
        gathered K/V in natural order, the last device's: (n − 1/2)/n (half where the order balances it).
        A sliding window of W < S keys: each query's min(p + 1, W) of them, (W/S)·(1 − W/2S) on average (the
        ring counts its live tiles under the window); on ``window_layers`` of the layers, the layers' mean."""
        if self.window and 0 < self.window_layers < self.num_layers:
            windowed = self.window_layers / self.num_layers
            full = dataclasses.replace(self, window=0, window_layers=0).attention_share
            return windowed * dataclasses.replace(self, window_layers=0).attention_share + (1 - windowed) * full
        n, W, S = self.size("sequence"), self.window, self.seq
        if not self.causal:
            return 1.0
        ring = n > 1 and self.context_parallel == "ring"
        if W and W < S and not ring:
            return W / S * (1 - W / (2 * S))
        if n == 1 or self.context_parallel == "ulysses":
            return 0.5
        if self.context_parallel == "allgather":  # zigzag: load-balanced as a ring's
            return (n - 0.5) / n if self.cp_order == "contiguous" else 0.5
        if W and W < S:  # the tiles that meet the window, at the real length
            return float(ring_work(S, n, self.cp_order, window=W).max()) / (4 * n)
        return float(ring_work(4 * n, n, self.cp_order).max()) / (4 * n)

    @property
    def stage_layers(self) -> int:
        """Layers on the busiest stage device: v chunks of ⌈L/(p·v)⌉ (an uneven split, as torchtitan's
        generate_split_points makes one, priced at its largest chunk), or with ``stage_split`` its
        largest stage and an even share of the layers before the stack (``dense_layers``)."""
        v, p = self.virtual_stages, self.size("stage")
        if self.stage_split:
            return max(self.stage_split) + -(-self.prefix_layers // p)
        return -(-self.num_layers // (p * v)) * v

    @property
    def last_stage_layers(self) -> int:
        """Layers on the last stage, which also runs the LM head."""
        if self.stage_split:
            return self.stage_split[-1] + -(-self.prefix_layers // self.size("stage"))
        return self.stage_layers

    @property
    def prefix_layers(self) -> int:
        """Dense layers before a MoE stack (DeepSeek's), which a pipeline runs outside its stack."""
        return self.dense_layers if self.experts else 0

    @property
    def moe_layers(self) -> int:
        return self.num_layers - self.dense_layers if self.experts else 0

    @property
    def dropless(self) -> bool:
        """Experts without a capacity: every assignment runs, as grouped matmuls over sorted tokens."""
        return bool(self.experts) and self.capacity_factor is None

    @property
    def slots_per_token(self) -> float:
        """Expert slots a token's place pays for: E·C/S with C = max(1, ceil(capacity_factor·S·k/E)) slots
        per expert and sequence, or top_k dropless."""
        if self.dropless:
            return self.top_k
        return self.experts * max(1, math.ceil(self.capacity_factor * self.seq * self.top_k / self.experts)) / self.seq

    def params(self, vocab_matrices: int | None = None, *, active: bool = False) -> int:
        """Weights of the matmuls: the layers and ``vocab_matrices`` [V, D] matrices (default: 1 tied, 2 not);
        ``active``: a MoE layer's top_k experts only (what one token meets, as MFU counts)."""
        vocab_matrices = (1 if self.tied else 2) if vocab_matrices is None else vocab_matrices
        moe = self.layer_params(True, active=active) if self.moe_layers else 0
        return (
            (self.num_layers - self.moe_layers) * self.layer_params()
            + self.moe_layers * moe
            + vocab_matrices * self.vocab * self.embed_dim
        )

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
            return dict(
                q=[(D, H * self.head_dim // t)], kv=[(D, self.kv_width // t)], out=[(H * self.head_dim // t, D)]
            )
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
        for axis, n in {**self.mesh, **{f"dcn.{a}": v for a, v in self.dcn.items()}}.items():
            if axis.removeprefix("dcn.") not in AXES or int(n) < 1:
                raise ConfigError(f"mesh: {axis}={n}: the step-time model takes {', '.join(AXES)} sizes ≥ 1")
        if self.remat not in RECOMPUTE:
            raise ConfigError(f"remat={self.remat!r}: known policies are {', '.join(RECOMPUTE)}")
        split = self.replicas * max(self.microbatch, 1)
        if self.batch % split:
            raise ConfigError(
                f"batch={self.batch}: not divisible by the {split} sequences of data × fsdp × "
                f"expert × microbatch={self.microbatch}"
            )
        e = self.size("expert")
        if self.experts % e or (e > 1 and not self.experts):
            raise ConfigError(f"experts={self.experts}: not divisible by expert={e}")
        if self.experts and not (1 <= self.top_k <= self.experts and 0 <= self.dense_layers < self.num_layers):
            raise ConfigError(
                f"top_k={self.top_k}, dense_layers={self.dense_layers}: need 1 ≤ top_k ≤ "
                f"experts={self.experts} and 0 ≤ dense_layers < num_layers={self.num_layers}"
            )
        if self.attention_kernel not in ("", "fa2"):
            raise ConfigError(f"attention_kernel={self.attention_kernel!r}: '' (the chip's own flash kernel) or 'fa2'")
        chunks = self.size("stage") * self.virtual_stages
        if self.num_layers < chunks:
            raise ConfigError(f"num_layers={self.num_layers}: fewer than stage × virtual_stages = {chunks} chunks")
        n = self.size("sequence")
        if n > 1 and (self.context_parallel not in CONTEXT or self.cp_order not in ("zigzag", "contiguous")):
            raise ConfigError(
                f"context_parallel={self.context_parallel!r}, cp_order={self.cp_order!r}: sequence={n} "
                f"takes {', '.join(CONTEXT)} (cp_order zigzag or contiguous)"
            )
        if n > 1 and self.context_parallel == "ulysses" and self.num_heads % (n * self.size("tensor")):
            raise ConfigError(
                f"num_heads={self.num_heads}: ulysses needs them divisible by sequence × tensor = "
                f"{n * self.size('tensor')}"
            )
        if self.seq % (2 * n if n > 1 and self.context_parallel == "ring" and self.cp_order == "zigzag" else n):
            raise ConfigError(f"seq={self.seq}: not divisible by the sequence={n} blocks (2 each, zigzag)")
        t = self.size("tensor")
        for name in ("num_heads", "mlp_dim", "vocab", "expert_mlp_dim", "shared_mlp_dim"):
            if getattr(self, name) % t:
                raise ConfigError(f"{name}={getattr(self, name)}: not divisible by tensor={t}")


def workload_of(
    cfg,
    execution,
    mesh: dict,
    *,
    batch: int,
    seq: int,
    dcn: dict | None = None,
    pipeline: dict | None = None,
    grad_accum: int = 1,
    grad_reduce: str = "slice",
) -> Workload | None:
    """The ``Workload`` of a jaxpar model config (any family: ``DenseConfig`` and the families that extend
    it) run as ``execution`` (a ``jaxpar.execution.ExecutionConfig``) says, under ``mesh`` (ICI axis
    sizes), or None where the step-time model does not describe it: expert-choice routing. A split
    sequence without ring or Ulysses attention is GSPMD's: the full K/V gathered on every device
    (``allgather``). ``pipeline`` (with ``stage`` > 1): microbatches, virtual_stages, bubble and
    stage_bytes of the executor. ``grad_accum`` k (no pipeline): the batch runs as k microbatches, each
    gathering and reducing the weights as jaxpar's accumulating step does, or with ``grad_reduce`` step
    gathering and reducing them once for all k."""
    if cfg.moe is not None and cfg.moe.router == "expert_choice":
        return None
    dcn = {a: int(n) for a, n in (dcn or {}).items() if int(n) > 1}
    sizes = {a: int(n) for a, n in mesh.items() if int(n) > 1}
    if set(sizes) - set(AXES) or set(dcn) - set(AXES):
        return None
    run = _execution_fields(execution, cfg.moe is not None)
    w = Workload(batch=batch, seq=seq, mesh=sizes, dcn=dcn, **_model_fields(cfg), **run)
    if pipeline and w.size("stage") > 1:
        w = dataclasses.replace(
            w,
            microbatch=batch // (w.replicas * pipeline["microbatches"]),
            executor=pipeline.get("executor") != "own actions",  # own actions: no recompute, one head
            gather_once="step" in (pipeline.get("fsdp_gather"), pipeline.get("grad_reduce")),
            reduce_once=pipeline.get("grad_reduce") == "step",
            stage_split=tuple(pipeline.get("stage_layers", ())),
            **{k: pipeline[k] for k in ("virtual_stages", "bubble", "stage_bytes")},
        )
    elif grad_accum > 1:
        once = grad_reduce == "step"
        w = dataclasses.replace(w, microbatch=batch // (w.replicas * grad_accum), gather_once=once, reduce_once=once)
    return w


def _model_fields(cfg) -> dict:
    """The ``Workload`` fields the model config states: its shape, its experts and its MLA."""
    out = dict(
        embed_dim=cfg.embed_dim,
        num_heads=cfg.num_heads,
        kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim if cfg.mla is None else cfg.mla.qk_nope_head_dim,
        mlp_dim=cfg.mlp_dim,
        mlp_matrices=3,
        num_layers=cfg.num_layers,
        vocab=cfg.padded_vocab,
        weight_bytes=np.dtype(str(cfg.param_dtype)).itemsize,
        grad_bytes=4,
        tied=cfg.tie_embeddings,
        window=cfg.sliding_window or 0,
    )
    if cfg.moe is not None:
        m = cfg.moe
        out |= dict(
            experts=m.num_experts,
            top_k=m.top_k,
            expert_mlp_dim=m.mlp_dim,
            shared_mlp_dim=m.num_shared_experts * m.shared_mlp_dim,
            dense_layers=cfg.first_dense_layers,
        )
    if cfg.mla is not None:
        m = cfg.mla
        out |= dict(kv_lora=m.kv_lora_rank, q_lora=m.q_lora_rank or 0, qk_rope=m.qk_rope_head_dim, v_head=m.v_head_dim)
    return out


def _execution_fields(execution, experts: bool) -> dict:
    """The ``Workload`` fields of how the model runs: remat, the compute dtype, the attention kernel and
    context parallelism, and with ``experts`` their capacity."""
    cp = str(execution.context_parallel)
    return dict(
        remat=execution.remat.value,
        act_bytes=np.dtype(str(execution.dtype)).itemsize,
        context_parallel="allgather" if cp == "none" else cp,
        cp_order=str(execution.cp_order) if cp == "ring" else "contiguous",
        flash=flash_attention(execution),
        capacity_factor=execution.capacity_factor if experts else None,
    )
