"""Mixture-of-Experts decoder: Mixtral, Qwen3-MoE (and, with Multi-head Latent Attention, DeepSeek-V3).

Legend: B batch, T positions, D embed_dim, E experts, k experts per token, L layers (the first
``first_dense_layers`` with a dense SwiGLU, the rest with an MoE), V vocab (padded).

    ids [B, T] -> Embed -> dense blocks -> MoE blocks -> RMSNorm -> LM head -> logits [B, T, V] (float32)
    MoE block: x + Attention(RMSNorm(x)); x + MoE(RMSNorm(x))

Everything the dense family has (GQA, QK-norm, RoPE scaling; in execution remat, context parallelism,
the zig-zag order) carries over: ``MoEConfig`` extends ``DenseConfig`` and ``MoELM`` reuses ``DenseLM``'s
embedding, head and forward pass; only the layer stack differs. Each MoE layer reports ``MoEStats``; the model sums
their weighted losses into the objective and hands the statistics (stacked [L, ...]) to the train step,
which logs them and, when ``execution.bias_update_rate`` > 0, nudges the routers' selection bias.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.errors import ConfigError
from jaxpar.execution import ExecutionConfig
from jaxpar.layers import MoE, MoEConfig, updated_bias
from jaxpar.layers.lora import EXPERT_TARGETS
from jaxpar.layers.mla import MLA, MLAConfig, mla_param_count
from jaxpar.models.dense import Block, DenseConfig, DenseLM
from jaxpar.models.stacks import scan_blocks, stacked
from jaxpar.models.stored import mla_weights, mlp_weights, with_stored_groups
from jaxpar.rules import Dim, constrain


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEModelConfig(DenseConfig):
    moe: MoEConfig = dataclasses.field()  # the MoE layers' router, experts and capacity (required)
    first_dense_layers: int = 0  # DeepSeek: the first layers keep a dense SwiGLU of width mlp_dim
    mla: MLAConfig | None = None  # DeepSeek: Multi-head Latent Attention instead of GQA

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.moe, MoEConfig):
            raise ConfigError(f"model.moe: an MoE model needs its MoEConfig, got {self.moe!r}")
        if not 0 <= self.first_dense_layers < self.num_layers:
            raise ConfigError(
                f"model.first_dense_layers={self.first_dense_layers} must be in [0, model.num_layers={self.num_layers})"
            )

    @property
    def adapter_targets(self) -> tuple[str, ...]:
        """The dense model's targets (the attention's, the dense layers' and shared experts' MLPs) and the
        routed experts' weights (``jaxpar.layers.lora``)."""
        return (*super().adapter_targets, *EXPERT_TARGETS)

    def attention_module(self, execution: ExecutionConfig, *, rngs: nnx.Rngs) -> nnx.Module:
        if self.mla is None:
            return super().attention_module(execution, rngs=rngs)
        attn = self.attention(execution)
        return MLA(attn, self.mla, rngs=rngs, dtype=execution.dtype, param_dtype=self.param_dtype)

    def _attention_params(self) -> int:
        """Parameters of one layer's attention as the dense count has them (GQA)."""
        d, h, n, k = self.embed_dim, self.head_dim, self.num_heads, self.num_kv_heads
        return d * h * (2 * n + 2 * k) + (h * (n + 2 * k) if self.qkv_bias else 0) + (2 * h if self.qk_norm else 0)

    def logical_dims(self) -> dict[str, Dim]:
        experts = Dim(self.moe.num_experts, "model.moe.num_experts")
        dims = super().logical_dims() | dict(experts=experts, act_experts=experts)
        if self.mla is not None:
            if self.mla.q_lora_rank:
                dims["q_lora"] = Dim(self.mla.q_lora_rank, "model.mla.q_lora_rank")
            dims["kv_lora"] = Dim(self.mla.kv_lora_rank, "model.mla.kv_lora_rank")
        widths = {"model.moe.mlp_dim": self.moe.mlp_dim}  # `mlp` names every MLP width here:
        if self.first_dense_layers:  # each must divide its mesh axes, which
            widths["model.mlp_dim"] = self.mlp_dim  # their gcd does exactly when all do
        if self.moe.num_shared_experts:
            widths["model.moe.shared experts' width"] = self.moe.num_shared_experts * self.moe.shared_mlp_dim
        mlp = Dim(math.gcd(*widths.values()), " / ".join(widths) + (" (gcd)" if len(widths) > 1 else ""))
        if self.first_dense_layers:  # the dense prefix, then the MoE stack
            dims["layers"] = Dim(self.num_moe_layers, "model.num_layers - first_dense_layers")
            dims["prefix_layers"] = Dim(self.first_dense_layers, "model.first_dense_layers")
        return with_stored_groups(self, dims | dict(mlp=mlp, act_mlp=mlp))

    def quantized_weights(self) -> list[tuple]:
        """The dense list with MLA's weights for GQA's, the dense MLP only where dense layers are, and
        each routed expert's and the shared experts' SwiGLU (``DenseConfig.quantized_weights``)."""
        d, m = self.embed_dim, self.moe
        weights = super().quantized_weights()
        attention = weights[:4] if self.mla is None else mla_weights(self.mla, d, self.num_heads)
        dense = weights[4:] if self.first_dense_layers else []
        shared = mlp_weights(d, m.num_shared_experts * m.shared_mlp_dim, "moe.shared_mlp_dim × num_shared_experts")
        routed = mlp_weights(d, m.mlp_dim, "moe.mlp_dim")
        return [*attention, *dense, *routed, *(shared if m.num_shared_experts else [])]

    def num_params(self, *, padded: bool = False) -> int:
        """Exact parameter count: the dense count with each MoE layer's SwiGLU replaced by its router,
        experts and shared experts."""
        d, m = self.embed_dim, self.moe
        moe_mlp = (
            d * m.num_experts + m.num_experts * 3 * d * m.mlp_dim + 3 * d * m.num_shared_experts * m.shared_mlp_dim
        )
        total = super().num_params(padded=padded) + self.num_moe_layers * (moe_mlp - 3 * d * self.mlp_dim)
        if self.mla is not None:
            mla = mla_param_count(self.mla, embed_dim=d, num_heads=self.num_heads)
            total += self.num_layers * (mla - self._attention_params())
        return total

    def flops_per_token(self, seq: int) -> float:
        """Model FLOPs per training token with the *active* experts: k routed plus the shared ones."""
        d, m = self.embed_dim, self.moe
        routed = (m.top_k + m.num_shared_experts * m.shared_mlp_dim / m.mlp_dim) * 3 * d * m.mlp_dim
        dense_mlp = 3 * d * self.mlp_dim
        attn = d * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        score_width = self.head_dim  # per head: (q·k width + v width) / 2
        if self.mla is not None:
            la = self.mla
            attn = (
                mla_param_count(la, embed_dim=d, num_heads=self.num_heads) - (la.q_lora_rank or 0) - la.kv_lora_rank
            )  # matmul weights only
            score_width = (la.qk_nope_head_dim + la.qk_rope_head_dim + la.v_head_dim) / 2
        moe = routed + d * m.num_experts  # experts + router
        matmul = self.num_layers * attn + self.first_dense_layers * dense_mlp + self.num_moe_layers * moe
        matmul += self.padded_vocab * d
        return 6.0 * matmul + 6.0 * self.num_layers * self.num_heads * score_width * seq


class MoEBlock(Block):
    """A dense block whose feed-forward is an MoE; returns (x, MoEStats)."""

    def _init_feed_forward(self, cfg: MoEModelConfig, execution: ExecutionConfig, rngs: nnx.Rngs) -> None:
        kw = dict(dtype=execution.dtype, param_dtype=cfg.param_dtype)
        self.moe = MoE(
            cfg.embed_dim, cfg.moe, execution=execution, rngs=rngs, lora=cfg.lora, quantize=cfg.stored_as, **kw
        )

    def _feed_forward(self, x: jax.Array, index: jax.Array):
        y, stats = self.moe(self.mlp_norm(x), index)
        return constrain(x + y, ("batch", "length", "act_embed")), stats


class MoELM(DenseLM):
    """The MoE family's ``jaxpar.model_api.LanguageModel``: ``DenseLM`` with another layer stack."""

    def __init__(self, cfg: MoEModelConfig, *, execution: ExecutionConfig | None = None, rngs: nnx.Rngs):
        self.cfg, self.execution = cfg, ExecutionConfig() if execution is None else execution
        run = self.execution
        self._init_io(cfg, rngs)
        if cfg.first_dense_layers:
            dense = lambda r: Block(cfg, run, rngs=r)
            self.dense_blocks = stacked(cfg.first_dense_layers, dense, rngs, "prefix_layers")
        self.moe_blocks = stacked(cfg.num_moe_layers, lambda r: MoEBlock(cfg, run, rngs=r), rngs)

    pipeline_stack = "moe_blocks"

    @property
    def prefix_stack(self):
        return "dense_blocks" if self.cfg.first_dense_layers else None

    def run_stack(self, blocks, x, positions, index, active=None, segments=None):
        remat = self.execution.remat
        x, stats = scan_blocks(
            blocks, x, positions, index, remat, per_layer_outputs=True, active=active, segments=segments
        )
        return x, jnp.sum(stats.aux_loss) + jnp.sum(stats.router_z_loss), stats

    def prefix(self, x, positions, index, segments=None):
        """DeepSeek's first dense layers (the pipeline runs them before its schedule)."""
        if not self.cfg.first_dense_layers:
            return x
        return scan_blocks(self.dense_blocks, x, positions, index, self.execution.remat, segments=segments)

    def update_router_bias(self, expert_load: jax.Array) -> None:
        """DeepSeek's auxiliary-loss-free balancing for every MoE layer ([L, E] loads); no-op at rate 0."""
        rate = self.execution.bias_update_rate
        if rate:
            bias = self.moe_blocks.moe.router_bias
            bias[...] = updated_bias(bias[...], jax.lax.stop_gradient(expert_load), rate)
