"""How a model runs, never what it is: ``ExecutionConfig``.

A model config (``jaxpar.models``) says what a model is: its shapes, its routers, its parameter dtype.
Everything in it changes the function the weights compute or the arrays a checkpoint holds, so a saved
run is this run only when the model config is the same, whole (``jaxpar.identity``). The settings here
change how the same model is computed or trained, and may differ between runs of one model:

    remat                 what the backward pass keeps and what it recomputes (``Remat``)
    dtype                 the compute dtype (parameters keep ``model.param_dtype``)
    attention_impl        which attention kernel jax uses (``AttentionImpl``; None: jax picks)
    context_parallel      attention when positions are split over ``sequence`` (``ContextParallel``)
    cp_order              how a ring stores the tokens over its devices (``TokenOrder``)
    capacity_factor       MoE: token slots per expert, or None for dropless execution
    aux_loss_weight       MoE: the weight of the balancing loss in the objective
    router_z_loss_weight  MoE: the weight of the router z-loss in the objective
    bias_update_rate      MoE: how fast training balances the routers' selection bias
    loss_chunks           the loss's logits made a piece of the tokens at a time (memory)

A training run holds it as ``execution`` (``--set execution.remat=dots``); a model object holds the
one it was built with (``model.execution``). Runs saved before these settings left the model config hold
them under ``model`` (``model.remat``, ``model.moe.capacity_factor``, ...): ``MOVED_FROM_MODEL`` maps
each to its field here, and ``split_saved_model`` reads such data.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxpar.config import Choice, DType, check_choices
from jaxpar.errors import ConfigError

# What remat=attn keeps: named in jaxpar.layers.attention (MLA names its context only) and models/dense.py.
ATTN_NAMES = ("attn_q", "attn_k", "attn_v", "attn_ctx", "attn_out")


class Remat(Choice):
    """What a scanned block keeps for the backward pass."""

    NONE = "none"  # keep every intermediate
    FULL = "full"  # keep only the block input; recompute the rest
    DOTS = "dots"  # keep matmul outputs without batch dims (weights-side products)
    ATTN = "attn"  # keep q/k/v, the attention context and the block's output (named checkpoints)

    def policy(self):
        cp = jax.checkpoint_policies
        return {
            Remat.FULL: cp.nothing_saveable,
            Remat.DOTS: cp.dots_with_no_batch_dims_saveable,
            Remat.ATTN: cp.save_only_these_names(*ATTN_NAMES),
            Remat.NONE: None,
        }[self]


class AttentionImpl(Choice):
    """The attention kernel (``execution.attention_impl``; None: ``jax.nn.dot_product_attention`` picks):
    ``jax.nn.dot_product_attention``'s implementations, or the Pallas kernel of ``jaxpar.parallel.flash``."""

    XLA = "xla"
    CUDNN = "cudnn"  # GPUs: cuDNN's flash attention
    SPLASH = "splash"  # TPUs: Pallas splash attention (``jaxpar.parallel.flash``; interpreted on CPU)


class ContextParallel(Choice):
    """How attention runs when positions are split over a mesh axis (``execution.context_parallel``)."""

    NONE = "none"  # GSPMD gathers the full K/V on every device
    RING = "ring"  # K/V blocks travel the ring
    ULYSSES = "ulysses"  # all-to-all from sequence-split to head-split and back


class TokenOrder(Choice):
    """How a ring stores the sequence over its devices (``execution.cp_order``)."""

    ZIGZAG = "zigzag"  # device i holds chunks i and 2n-1-i: causal work balanced
    CONTIGUOUS = "contiguous"  # device i holds chunk i


@dataclasses.dataclass(frozen=True)
class ExecutionConfig:
    """How a model is computed and trained (module docstring); none of it is the model's identity."""

    remat: Remat = Remat.FULL
    dtype: DType = DType.FLOAT32  # compute dtype
    attention_impl: AttentionImpl | None = None
    context_parallel: ContextParallel = ContextParallel.NONE  # attention when positions are split over `sequence`
    cp_order: TokenOrder = TokenOrder.ZIGZAG  # ring: how tokens are stored over the devices
    capacity_factor: float | None = 1.25  # MoE slots per expert: C = max(1, ceil(cf·T·k/E)); None = dropless
    aux_loss_weight: float = 0.01  # MoE: Switch balancing loss E · Σ_e f_e · P_e
    router_z_loss_weight: float = 0.001  # MoE: mean over tokens of logsumexp(logits)²
    bias_update_rate: float = 0.0  # MoE: aux-loss-free balancing step (``jaxpar.layers.moe.updated_bias``)
    # the loss over this many pieces of the tokens, each piece's float32 logits made, used and made again
    # in the backward: the logits of one piece live at a time (1: all at once)
    loss_chunks: int = 1

    def __post_init__(self):
        check_choices(self, "execution")
        if self.loss_chunks < 1:
            raise ConfigError(f"execution.loss_chunks={self.loss_chunks} must be ≥ 1")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ConfigError(f"execution.capacity_factor={self.capacity_factor} must be > 0 (or None: dropless)")
        for name in ("aux_loss_weight", "router_z_loss_weight", "bias_update_rate"):
            if not getattr(self, name) >= 0:  # also refuses NaN
                raise ConfigError(f"execution.{name}={getattr(self, name)} must be ≥ 0")


# ------------------------------------------------------------------------------- saved before the move
# Where each setting lived in a model config before it moved here: {dotted path under model: field}.
MOVED_FROM_MODEL = {
    "remat": "remat",
    "dtype": "dtype",
    "attention_impl": "attention_impl",
    "context_parallel": "context_parallel",
    "cp_order": "cp_order",
    "moe.capacity_factor": "capacity_factor",
    "moe.aux_loss_weight": "aux_loss_weight",
    "moe.router_z_loss_weight": "router_z_loss_weight",
    "moe.bias_update_rate": "bias_update_rate",
}


def moved_field(path: str, /) -> str | None:
    """``--set model.remat=…`` and friends: the message for a path that moved to ``execution``, else None."""
    field = MOVED_FROM_MODEL.get(path.removeprefix("model."))
    if not path.startswith("model.") or field is None:
        return None
    return f"moved: execution settings left the model config; use execution.{field}"


def split_saved_model(data: dict, /) -> tuple[dict, dict]:
    """A saved model config's data as (model data, execution data): settings saved under the model by
    runs from before they moved (``MOVED_FROM_MODEL``) leave it for the execution data; data of the current
    form comes back as it is, with no execution data."""
    if not isinstance(data, dict):
        return data, {}
    model, execution = dict(data), {}
    for path, field in MOVED_FROM_MODEL.items():
        outer, _, inner = path.rpartition(".")
        holder = model.get(outer) if outer else model
        if isinstance(holder, dict) and inner in holder:
            if outer:  # copy before removing: the caller's data stays as it was
                holder = model[outer] = dict(holder)
            execution[field] = holder.pop(inner)
    return model, execution
