"""Dense decoder-only transformer: Llama 3/3.1, Mistral, Qwen2, Qwen3 in one family.

Legend: B batch, T positions, D embed_dim, N num_heads, K num_kv_heads, H head_dim, F mlp_dim,
V vocab (padded), L num_layers.

    ids [B, T] -> Embed -> L × Block -> RMSNorm -> LM head (or tied embedding) -> logits [B, T, V] (float32)
    Block: x + Attention(RMSNorm(x)); x + SwiGLU(RMSNorm(x))

The L blocks are created once with ``nnx.vmap`` (every parameter gains a leading ``layers`` axis) and run
with ``nnx.scan``, so compile time does not grow with depth. Generation runs them unrolled instead, one
block and one cache per layer (``layers``, ``_cached``): a model unstacked once for inference
(``jaxpar.inference.unstack``) holds each layer's arrays apart, so a decode step copies no weight.

``DenseConfig`` is what the model is; how it runs (remat, the compute dtype, the attention kernel, context
parallelism) is the ``ExecutionConfig`` it is built with (``jaxpar.execution``), kept as
``model.execution``. Only logical axis names appear here; the mesh presets decide what they mean.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.config import DType, WeightFormat, check_choices
from jaxpar.errors import ConfigError
from jaxpar.execution import ATTN_NAMES, ExecutionConfig, Remat  # noqa: F401  (ATTN_NAMES, Remat: re-exported)
from jaxpar.layers import Attention, AttentionConfig, Embed, RMSNorm, RopeScaling, SwiGLU, YarnScaling
from jaxpar.layers.common import param
from jaxpar.layers.kvcache import DECODE, PREFILL, KVCache, LatentCache, PagedKVCache, PagedLatentCache, Step
from jaxpar.layers.lora import SPECS, LoraConfig
from jaxpar.layers.mla import mla_targets
from jaxpar.model_api import ForwardOutput
from jaxpar.models.stacks import scan_blocks, split_stack, stacked
from jaxpar.models.stored import mlp_weights, with_stored_groups
from jaxpar.parallel.attention import storage_order
from jaxpar.parallel.common import inverse_order
from jaxpar.rules import Dim, constrain

# Sizes that must be positive: the config divides by several of them (num_kv_heads, vocab_multiple).
SIZE_FIELDS = (
    "vocab_size",
    "embed_dim",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "mlp_dim",
    "vocab_multiple",
    "max_seq_len",
)


@dataclasses.dataclass(frozen=True)
class DenseConfig:
    vocab_size: int
    embed_dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | YarnScaling | None = None  # YaRN: MLA attention only
    norm_eps: float = 1e-5
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    tie_embeddings: bool = False
    param_dtype: DType = DType.FLOAT32  # storage dtype of parameters (and so of optimizer state)
    vocab_multiple: int = 128  # the embedding is padded to a multiple of this (shardable vocab)
    max_seq_len: int = 2048  # longest sequence the model is meant for (HF max_position_embeddings)
    lora: LoraConfig = LoraConfig()  # adapters on named projections (rank 0: none; jaxpar.layers.lora)
    quantize: WeightFormat = WeightFormat.NONE  # the projections stored int8, int4 or fp8 (jaxpar.layers.quant)

    # The parts other families add, as every family answers them (plain class attributes, not fields:
    # the dense config's data holds none of them). ``MoEModelConfig`` declares them as fields.
    moe = None  # the MoE layers' MoEConfig
    mla = None  # DeepSeek's Multi-head Latent Attention (an MLAConfig) instead of GQA
    first_dense_layers = 0  # layers before the MoE stack that keep a dense SwiGLU

    def __post_init__(self):
        check_choices(self, "model")
        for name in SIZE_FIELDS:  # before any division by them
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name}={getattr(self, name)} must be ≥ 1")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.num_heads={self.num_heads} is not a multiple of model.num_kv_heads={self.num_kv_heads}"
            )
        if not (self.norm_eps > 0 and self.rope_theta > 0):  # also refuses NaN
            raise ConfigError(f"model.norm_eps={self.norm_eps} and model.rope_theta={self.rope_theta} must be > 0")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"model.sliding_window={self.sliding_window} must be ≥ 1 (or None: full attention)")
        if isinstance(self.rope_scaling, YarnScaling) and not self.uses_mla:
            raise ConfigError("model.rope_scaling: YaRN is implemented for MLA attention (DeepSeek) only")
        if self.quantize != "none" and isinstance(self.lora, LoraConfig) and self.lora.quantize != "none":
            raise ConfigError(
                f"model.quantize={self.quantize} and model.lora.quantize={self.lora.quantize}: the base is stored "
                "one way; QLoRA's setting is model.lora.quantize"
            )
        names = self.lora.names if isinstance(self.lora, LoraConfig) else ()
        missing = [t for t in names if t not in self.adapter_targets]
        if missing:
            raise ConfigError(
                f"model.lora.targets={self.lora.targets!r}: {missing[0]} is not a projection of this model; its "
                f"{'MLA' if self.uses_mla else 'GQA'} attention and dense MLPs take {', '.join(self.adapter_targets)}"
            )

    @property
    def adapter_targets(self) -> tuple[str, ...]:
        """The LoRA targets this model has (``model.lora.targets``): its attention's projections and the
        dense MLPs' (``jaxpar.layers.lora``)."""
        attention = mla_targets(self.mla) if self.uses_mla else ("q", "k", "v", "o")
        return (*attention, "gate_up", "down")

    @property
    def stored_as(self) -> str:
        """The projections' stored format: QLoRA's base (``model.lora.quantize``) or ``model.quantize``."""
        return self.lora.quantize if self.lora.quantize != "none" else str(self.quantize)

    @property
    def uses_mla(self) -> bool:
        """Whether the attention is DeepSeek's Multi-head Latent Attention."""
        return self.mla is not None

    @property
    def num_moe_layers(self) -> int:
        """Layers whose feed-forward is a mixture of experts (0 for a dense model)."""
        return 0 if self.moe is None else self.num_layers - self.first_dense_layers

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    def attention(self, execution: ExecutionConfig) -> AttentionConfig:
        """The attention layers' config: this model's shape, ``execution``'s kernel and context parallelism."""
        return AttentionConfig(
            self.embed_dim,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            qkv_bias=self.qkv_bias,
            qk_norm=self.qk_norm,
            norm_eps=self.norm_eps,
            sliding_window=self.sliding_window,
            implementation=execution.attention_impl,
            context_parallel=execution.context_parallel,
            lora=self.lora,
            quantize=self.stored_as,
        )

    def attention_module(self, execution: ExecutionConfig, *, rngs: nnx.Rngs) -> nnx.Module:
        """The attention layer of a block (families with another attention override this)."""
        return Attention(self.attention(execution), rngs=rngs, dtype=execution.dtype, param_dtype=self.param_dtype)

    def logical_dims(self) -> dict[str, Dim]:
        """Sizes of the dimensions each logical axis governs, for the layout check."""
        d = dict(
            vocab=Dim(self.padded_vocab, "model.vocab_size (padded)"),
            embed=Dim(self.embed_dim, "model.embed_dim"),
            heads=Dim(self.num_heads, "model.num_heads"),
            kv_heads=Dim(self.num_kv_heads, "model.num_kv_heads"),
            head_dim=Dim(self.head_dim, "model.head_dim"),
            mlp=Dim(self.mlp_dim, "model.mlp_dim"),
            layers=Dim(self.num_layers, "model.num_layers"),
            norm=Dim(self.embed_dim, "model.embed_dim"),
        )
        acts = dict(act_embed="embed", act_heads="heads", act_kv_heads="kv_heads", act_mlp="mlp", act_vocab="vocab")
        return with_stored_groups(self, d | {a: d[p] for a, p in acts.items()})

    def quantized_weights(self) -> list[tuple[tuple[int, ...], tuple, tuple, str]]:
        """The weights stored quantized (``stored_as``), one matrix each (no layer or expert dimension):
        (shape, logical names, the config field of each dimension, the einsum that reads it); the layout
        check of their groups is ``jaxpar.models.stored``'s."""
        d, n, k, h, f = self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim, self.mlp_dim
        heads = (("embed", "heads", "head_dim"), ("embed_dim", "num_heads", "head_dim"))
        kv = (("embed", "kv_heads", "head_dim"), ("embed_dim", "num_kv_heads", "head_dim"))
        out = (("heads", "head_dim", "embed"), ("num_heads", "head_dim", "embed_dim"))
        attention = [((d, n, h), *heads, SPECS["q"]), ((d, k, h), *kv, SPECS["k"]), ((d, k, h), *kv, SPECS["v"])]
        return [*attention, ((n, h, d), *out, SPECS["o"]), *mlp_weights(d, f, "mlp_dim")]

    def flops_per_token(self, seq: int) -> float:
        """Model FLOPs of one training token (forward + backward = 3 × forward, no remat recompute):
        6 per weight of every matmul (the LM head is one, the embedding lookup is not) plus causal
        attention, whose score and value products cost 12·L·N·H·T per token and half of that is masked."""
        d, h, n, k = self.embed_dim, self.head_dim, self.num_heads, self.num_kv_heads
        matmul = self.num_layers * (d * h * (2 * n + 2 * k) + 3 * d * self.mlp_dim) + self.padded_vocab * d
        return 6.0 * matmul + 6.0 * self.num_layers * self.num_heads * self.head_dim * seq

    def num_params(self, *, padded: bool = False) -> int:
        """Exact parameter count (unpadded vocab by default, as published)."""
        v, d, f, h = (self.padded_vocab if padded else self.vocab_size), self.embed_dim, self.mlp_dim, self.head_dim
        n, k = self.num_heads, self.num_kv_heads
        attn = d * h * (2 * n + 2 * k) + (h * (n + 2 * k) if self.qkv_bias else 0) + (2 * h if self.qk_norm else 0)
        block = attn + 3 * d * f + 2 * d
        return self.num_layers * block + v * d * (1 if self.tie_embeddings else 2) + d


class Block(nnx.Module):
    def __init__(self, cfg: DenseConfig, execution: ExecutionConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.embed_dim, eps=cfg.norm_eps, param_dtype=cfg.param_dtype)
        self.attn = cfg.attention_module(execution, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.embed_dim, eps=cfg.norm_eps, param_dtype=cfg.param_dtype)
        self._init_feed_forward(cfg, execution, rngs)

    def _init_feed_forward(self, cfg, execution: ExecutionConfig, rngs: nnx.Rngs) -> None:
        """The block's second half (families with another feed-forward override this)."""
        kw = dict(dtype=execution.dtype, param_dtype=cfg.param_dtype)
        self.mlp = SwiGLU(cfg.embed_dim, cfg.mlp_dim, rngs=rngs, lora=cfg.lora, quantize=cfg.stored_as, **kw)

    def _attend(self, x: jax.Array, positions: jax.Array, index: jax.Array, cache=None, step=None, segments=None):
        """x plus attention; (x, cache) with a KV cache (generation)."""
        h = self.attn(self.attn_norm(x), positions, index, cache=cache, step=step, segments=segments)
        if cache is not None:
            h, cache = h
        return x + checkpoint_name(h, "attn_out"), cache

    def _feed_forward(self, x: jax.Array, index: jax.Array):
        """x plus the feed-forward half: what the block returns (MoE blocks add their statistics)."""
        return constrain(x + self.mlp(self.mlp_norm(x)), ("batch", "length", "act_embed"))

    def __call__(self, x: jax.Array, positions: jax.Array, index: jax.Array, cache=None, step=None, segments=None):
        """x [B, T, D] -> the block's output; with a KV ``cache`` (``jaxpar.layers.kvcache``) the pair
        (output, updated cache); ``segments``: packed documents (``DenseLM.forward``)."""
        x, cache = self._attend(x, positions, index, cache, step, segments)
        out = self._feed_forward(x, index)
        return out if cache is None else (out, cache)


class DenseLM(nnx.Module):
    """The dense family's ``jaxpar.model_api.LanguageModel``."""

    def __init__(self, cfg: DenseConfig, *, execution: ExecutionConfig | None = None, rngs: nnx.Rngs):
        self.cfg, self.execution = cfg, ExecutionConfig() if execution is None else execution
        self._init_io(cfg, rngs)
        self.blocks = stacked(cfg.num_layers, lambda r: Block(cfg, self.execution, rngs=r), rngs)

    def _init_io(self, cfg, rngs: nnx.Rngs) -> None:
        """Embedding, final norm and LM head: the parts every family shares."""
        dtype = self.execution.dtype
        self.embed = Embed(cfg.padded_vocab, cfg.embed_dim, dtype=dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.final_norm = RMSNorm(cfg.embed_dim, eps=cfg.norm_eps, param_dtype=cfg.param_dtype)
        if not cfg.tie_embeddings:
            self.lm_head = param(rngs, (cfg.embed_dim, cfg.padded_vocab), ("embed", "vocab"), dtype=cfg.param_dtype)

    # The stacked layers a pipeline splits over `stage` (jaxpar.pipeline), by attribute name.
    pipeline_stack = "blocks"
    prefix_stack = None  # the stacked layers ``prefix`` runs, by attribute name (or None)

    def run_stack(self, blocks, x, positions, index, active=None, segments=None) -> tuple[jax.Array, jax.Array, object]:
        """``blocks`` (this model's pipelined stack, or a chunk of its layers) over x:
        (x, weighted auxiliary loss, statistics stacked over the layers); ``active``: see ``scan_blocks``."""
        x = scan_blocks(blocks, x, positions, index, self.execution.remat, active=active, segments=segments)
        return x, jnp.zeros((), jnp.float32), None

    def prefix(self, x, positions, index, segments=None) -> jax.Array:
        """The layers before the pipelined stack (none here; see ``MoELM``)."""
        return x

    def _blocks(self, x, positions, index, segments=None) -> tuple[jax.Array, jax.Array, object]:
        """The layers: (x, weighted auxiliary loss, statistics)."""
        x = self.prefix(x, positions, index, segments)
        return self.run_stack(getattr(self, self.pipeline_stack), x, positions, index, segments=segments)

    def update_router_bias(self, expert_load: jax.Array) -> None:
        """No routers: nothing to balance (``MoELM`` balances its own)."""

    def storage_order(self, length: int) -> np.ndarray | None:
        """How the current layout stores a sequence: position p holds token ``order[p]`` (None: natural)."""
        return storage_order(length, self.execution.context_parallel, self.execution.cp_order)

    def inputs(self, ids: jax.Array, positions: jax.Array | None = None, *, stored: bool = False):
        """What the layers see of ``ids`` [B, T]: ``(ids, positions, index, order)`` in the layout's storage
        order (``order``: position p holds token ``order[p]``; None = natural), for ``embed``. ``stored``:
        ``ids`` are in storage order already (the pipeline permutes them once, outside its stages)."""
        order = self.storage_order(ids.shape[1])
        natural = np.arange(ids.shape[1], dtype=np.int32) if order is None else order.astype(np.int32)
        index = jnp.broadcast_to(jnp.asarray(natural), ids.shape)  # zig-zag: RoPE positions follow the tokens
        if order is not None and not stored:
            ids = ids[:, order]
            positions = None if positions is None else positions[:, order]
        return ids, index if positions is None else positions, index, order

    def head(self, x: jax.Array) -> jax.Array:
        """Final norm and LM head: x [B, T, D] -> float32 logits [B, T, V_padded], padding masked."""
        cfg = self.cfg
        x = self.final_norm(x)
        if cfg.tie_embeddings:
            logits = self.embed.attend(x)
        else:
            logits = jnp.einsum("btd,dv->btv", x, self.lm_head[...].astype(self.execution.dtype))
        logits = constrain(logits.astype(jnp.float32), ("batch", "inner_length", "act_vocab"))
        if cfg.padded_vocab != cfg.vocab_size:
            logits = jnp.where(jnp.arange(cfg.padded_vocab) < cfg.vocab_size, logits, -1e9)
        return logits

    def __call__(self, ids: jax.Array, positions: jax.Array | None = None, segments: jax.Array | None = None):
        """ids [B, T] int32 -> logits [B, T, V] float32, in natural order (``forward`` keeps the padded
        vocabulary and the layout's storage order, for the training loss)."""
        out = self.forward(ids, positions, segments)
        logits = out.logits if out.order is None else out.logits[:, inverse_order(out.order)]
        return logits[..., : self.cfg.vocab_size]

    def forward(
        self, ids: jax.Array, positions: jax.Array | None = None, segments: jax.Array | None = None, *, head=True
    ) -> ForwardOutput:
        """Logits in the order the layout stores tokens in (see ``ForwardOutput``): a loss can permute
        its targets by ``order`` instead of paying to put the logits back (zig-zag context parallelism).
        ``head=False``: the last block's output [B, T, D] in their place, for a loss that applies ``head``
        a piece at a time.

        Packed documents: ``segments`` int [B, T] names each token's document (a token attends only to
        its own document's earlier tokens, on every attention path), and ``positions`` restart at 0 in
        each document (RoPE)."""
        ids, positions, index, order = self.inputs(ids, positions)
        if segments is not None and order is not None:
            segments = segments[:, order]
        x, aux_loss, stats = self._blocks(self.embed(ids), positions, index, segments)  # x: [B, T, D]
        return ForwardOutput(self.head(x) if head else x, order, aux_loss, stats)

    # ------------------------------------------------------------------------------------ generation
    def cache_stacks(self) -> tuple[str, ...]:
        """The stacked layers that keep a KV cache, by attribute name, in the order they run."""
        return tuple(n for n in (self.prefix_stack, self.pipeline_stack) if n)

    def layers(self, name: str) -> Sequence[nnx.Module]:
        """Stack ``name``'s blocks, one module per layer: an unstacked model's own (``nnx.List``), else
        sliced from the stacked arrays (``split_stack``)."""
        blocks = getattr(self, name)
        return blocks if isinstance(blocks, nnx.List) else split_stack(blocks)

    def empty_cache(self, batch: int, slots: int) -> dict:
        """A zero KV cache for ``batch`` sequences: {stack: [KVCache or LatentCache of each layer]}.
        ``slots`` is the longest sequence; a sliding window keeps at most the window."""
        s, cfg = min(slots, self.cfg.sliding_window or slots), self.cfg
        if cfg.uses_mla:
            return self._zeros(LatentCache, [(batch, s, cfg.mla.kv_lora_rank), (batch, s, cfg.mla.qk_rope_head_dim)])
        k, h = cfg.num_kv_heads, cfg.head_dim
        return self._zeros(KVCache, [(batch, k, h, s), (batch, k, s, h)])  # keys [B, K, H, S], values [B, K, S, H]

    def empty_pages(self, num_pages: int, page_size: int) -> dict:
        """Zero page pools {stack: [PagedKVCache or PagedLatentCache of each layer, no table yet]}; give
        each call its table with ``jaxpar.layers.kvcache.with_table``. Page 0 is the null page."""
        cfg, pages = self.cfg, (num_pages, page_size)
        if cfg.uses_mla:
            return self._zeros(PagedLatentCache, [(*pages, cfg.mla.kv_lora_rank), (*pages, cfg.mla.qk_rope_head_dim)])
        k, h = cfg.num_kv_heads, cfg.head_dim  # keys [P, K, H, page], values [P, K, page, H]
        return self._zeros(PagedKVCache, [(num_pages, k, h, page_size), (num_pages, k, page_size, h)])

    def _zeros(self, cls: type, shapes: list[tuple[int, ...]]) -> dict:
        """{stack: [one zero ``cls`` per layer]}, its arrays of ``shapes`` (a paged cache: no table yet)."""
        dtype, out = self.execution.dtype, {}
        table = (None,) if cls in (PagedKVCache, PagedLatentCache) else ()
        for name in self.cache_stacks():
            prefix = self.cfg.first_dense_layers
            n = prefix if name == self.prefix_stack else self.cfg.num_layers - prefix
            out[name] = [cls(*(jnp.zeros(shape, dtype) for shape in shapes), *table) for _ in range(n)]
        return out

    def _cached(self, ids: jax.Array, positions: jax.Array, cache: dict, step: Step):
        """Embedding and every layer with its own cache, unrolled in order: (x [B, T, D], {stack: [each
        layer's updated cache]}). Prefill, chunked prefill, decode and verification all run here."""
        x, new = self.embed(ids), {}
        for name in self.cache_stacks():
            new[name] = []
            for block, c in zip(self.layers(name), cache[name], strict=True):
                out, c = block(x, positions, positions, c, step)
                x = out[0] if isinstance(out, tuple) else out  # MoE blocks: (x, stats)
                new[name].append(c)
        return x, new

    def prefill(self, ids: jax.Array, lengths: jax.Array, cache: dict):
        """Prompts ids [B, T] right-padded (row b's are the first lengths[b]) -> (float32 logits [B, V] of
        each prompt's last token, the cache holding the prompts). No storage order: positions are natural."""
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
        x, cache = self._cached(ids, positions, cache, Step(PREFILL, lengths))
        last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)  # [B, 1, D]
        return self.head(last)[:, 0, : self.cfg.vocab_size], cache

    def decode(self, ids: jax.Array, positions: jax.Array, cache: dict):
        """New tokens ids [B, T] at positions [B, T] (T = 1 when decoding) -> (float32 logits [B, T, V],
        the cache with them appended)."""
        x, cache = self._cached(ids, positions, cache, Step(DECODE))
        return self.head(x)[..., : self.cfg.vocab_size], cache
