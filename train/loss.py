"""The training objective: next-token cross-entropy of a model's logits, with the z-loss and the model's
own auxiliary losses, token weights for packed rows and masked losses (``token_weights``), and the
loss over pieces of the tokens (``head_losses``: one piece's logits at a time)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.errors import ConfigError
from jaxpar.model_api import LanguageModel
from jaxpar.rules import partly_manual

# {'inputs': int32 [B, T], 'targets': int32 [B, T]} and, for packed documents and masked losses,
# 'positions' and 'segments' int32 [B, T] (``DenseLM.forward``) and 'mask' [B, T] (1: a trained target);
# for preference pairs (``jaxpar.train.preference``) 'pairs' [B, T] (1 at each pair's first token) and
# 'reference' float32 [B, T] (precomputed reference log-probs of the targets)
Batch = dict[str, jax.Array]
BATCH_KEYS = ("inputs", "targets", "positions", "segments", "mask", "pairs", "reference")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LossParts:
    cross_entropy: jax.Array
    z_loss: jax.Array
    moe: Any = None  # MoE statistics of the forward pass (None for dense models)
    extra: Any = None  # an objective's own logged means ({name: scalar}), e.g. DPO's rewards


def next_token_loss(model: LanguageModel, batch: Batch, /, *, z_loss: float = 0.0) -> tuple[jax.Array, LossParts]:
    """Objective = mean float32 cross-entropy of the model's logits against ``targets`` plus
    ``z_loss · mean(log Z²)`` (PaLM's z-loss: keeps the softmax normaliser near 1, so logits don't drift
    in low precision) plus the model's own weighted auxiliary losses (MoE balancing and router z-loss).
    A batch with ``weights`` (``token_weights``) weighs each token's terms by them: the mean over the
    batch is then Σ masked cross-entropy ÷ the batch's count of trained tokens. Returns
    ``(objective, LossParts)``."""
    # the final hidden states, in the layout's storage order
    out = model.forward(batch["inputs"], batch.get("positions"), batch.get("segments"), head=False)
    stored = lambda a: a if a is None or out.order is None else a[:, out.order]
    targets, weights = stored(batch["targets"]), stored(batch.get("weights"))
    chunks = model.execution.loss_chunks
    ce, z = head_losses(model.head, out.logits, targets, z_loss=z_loss, chunks=chunks, weights=weights)
    return ce + z + out.aux_loss, LossParts(ce, z, out.moe)


def token_weights(batch: Batch, /) -> Batch:
    """``batch`` with its loss ``mask`` [B, T] (1: a trained target) turned into ``weights`` whose mean
    over the whole (global) batch is 1: mask × (B·T) ÷ Σ mask. A loss that takes the mean of weighted
    token terms over any equal slices of the batch (gradient accumulation, pipeline microbatches, data
    shards) and averages the slices then divides by the global count of trained tokens, never by a
    slice's own (no mean of means). Preference ``pairs`` [B, T] become ``pair_weights`` the same way.
    Without a mask, the batch as it is."""
    out = dict(batch)
    for key, weights in (("mask", "weights"), ("pairs", "pair_weights")):
        if key in out:
            marks = out.pop(key).astype(jnp.float32)
            out[weights] = marks * (marks.size / jnp.maximum(jnp.sum(marks), 1.0))
    return out


def head_losses(head, x: jax.Array, targets: jax.Array, /, *, z_loss: float = 0.0, chunks: int = 1, weights=None):
    """``token_losses`` of ``head(x)`` (x [B, T, D] -> float32 logits [B, T, V]) against ``targets``
    [B, T] (``weights`` [B, T] or None). With ``chunks`` > 1 the tokens go in that many pieces (piece i:
    tokens i, i + chunks, ..., so a split of T over devices stays where it is), each piece's logits made,
    reduced and dropped, and made again in the backward (``jax.checkpoint``): one piece's logits live at
    a time."""
    if chunks == 1:
        return token_losses(head(x), targets, z_loss=z_loss, weights=weights)
    b, t, d = x.shape
    if t % chunks:
        raise ConfigError(f"execution.loss_chunks={chunks} does not divide the {t} tokens of a sequence")
    pieces = lambda a: jnp.moveaxis(a.reshape(b, t // chunks, chunks, *a.shape[2:]), 2, 0)  # [chunks, B, T/c, ...]

    @jax.checkpoint
    def piece(x, targets, weights):  # the sums over one piece: cross-entropy, log Z²
        ce, z = token_losses(head(x), targets, z_loss=1.0, weights=weights)
        return ce * targets.size, z * targets.size

    def add(total, xtw):
        return jax.tree.map(jnp.add, total, piece(*xtw)), None

    zero = jnp.zeros((), jnp.float32)
    weighed = None if weights is None else pieces(weights)
    (ce, z), _ = jax.lax.scan(add, (zero, zero), (pieces(x), pieces(targets), weighed))
    return ce / targets.size, (z_loss * z / targets.size if z_loss else zero)


def token_losses(
    logits: jax.Array, targets: jax.Array, /, *, z_loss: float = 0.0, weights=None
) -> tuple[jax.Array, jax.Array]:
    """(mean cross-entropy, weighted z-loss) of float32 ``logits`` [B, T, V] against ``targets`` [B, T],
    each token's terms times its ``weights`` [B, T] when given."""
    log_z = jax.nn.logsumexp(logits, axis=-1)
    if partly_manual():
        # Inside the pipeline's shard_map XLA's partitioner fails on this gather when the vocabulary is
        # split over `tensor`: take the target's logit as a masked sum (exact: one term is not zero).
        hit = jnp.arange(logits.shape[-1]) == targets[..., None]
        target_logit = jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
    else:
        target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    weigh = (lambda a: a) if weights is None else (lambda a: a * weights)
    ce = jnp.mean(weigh(log_z - target_logit))
    z = z_loss * jnp.mean(weigh(jnp.square(log_z))) if z_loss else jnp.zeros((), jnp.float32)
    return ce, z
