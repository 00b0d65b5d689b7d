"""Direct preference optimisation (Rafailov et al. 2023) and IPO (Azar et al. 2023): ``objective=dpo``.

A batch row holds whole preference pairs (``data.pack=pairs``, ``jaxpar.data.packing.plan_pairs``): pair k
of a row is its documents 2k (prompt + chosen) and 2k + 1 (prompt + rejected), told apart by ``segments``
so that neither attends to the other. A completion's log-probability is the sum of its trained tokens'
log-probs (the ``mask`` of ``jaxpar prepare --field preference``). With the reference's log-ratios
``lc = log π(c) - log π_ref(c)`` and ``lr`` likewise:

* ``sigmoid`` (DPO): ``-log σ(β (lc - lr))``;
* ``ipo``: ``(lc / |c| - lr / |r| - 1 / (2β))²``, each log-ratio averaged over its completion's tokens.

The loss is the mean over the batch's pairs, however many each row holds: ``token_weights`` turns the
``pairs`` marks (1 at each chosen document's first token) into weights normalised by the global count,
as it does the loss mask's, so slices (``grad_accum``) and data shards sum to the global mean.

The reference (``dpo.reference``): ``precomputed``, log-probs per token from the initial weights, made in
one pass before the first step and carried in the batch (``reference``); or ``adapters_off``, the same
weights with the LoRA adapters off (a fresh adapter starts as the base, so both give the same loss then);
``auto``: adapters_off when the model has adapters, else precomputed.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import Choice, check_choices
from jaxpar.errors import ConfigError
from jaxpar.layers.lora import LoraParam
from jaxpar.model_api import LanguageModel
from jaxpar.parallel.common import inverse_order
from jaxpar.train.loss import Batch, LossParts


class PreferenceLoss(Choice):
    SIGMOID = "sigmoid"
    IPO = "ipo"


class Reference(Choice):
    AUTO = "auto"
    PRECOMPUTED = "precomputed"
    ADAPTERS_OFF = "adapters_off"


@dataclasses.dataclass(frozen=True)
class PreferenceConfig:
    beta: float = 0.1  # how far the policy may move from the reference
    loss: PreferenceLoss = PreferenceLoss.SIGMOID
    reference: Reference = Reference.AUTO

    def __post_init__(self):
        check_choices(self, "dpo")
        if not (self.beta > 0 and math.isfinite(self.beta)):
            raise ConfigError(f"dpo.beta={self.beta}: must be a positive number")

    def resolved(self, lora_rank: int) -> Reference:
        """The reference a model with adapters of ``lora_rank`` (0: none) uses."""
        if self.reference == Reference.AUTO:
            return Reference.ADAPTERS_OFF if lora_rank else Reference.PRECOMPUTED
        if self.reference == Reference.ADAPTERS_OFF and not lora_rank:
            raise ConfigError("dpo.reference=adapters_off: the model has no adapters (set model.lora.rank)")
        return Reference(self.reference)


def token_logps(model: LanguageModel, batch: Batch, /) -> tuple[jax.Array, object]:
    """(log-probability of each target given its prefix, float32 [B, T] in the layout's storage order,
    the forward's output) of ``batch``'s inputs, positions and segments."""
    out = model.forward(batch["inputs"], batch.get("positions"), batch.get("segments"))
    targets = batch["targets"] if out.order is None else batch["targets"][:, out.order]
    logits = out.logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1), out


def natural_logps(model: LanguageModel, batch: Batch, /) -> jax.Array:
    """``token_logps`` in the natural order of the tokens (a precomputed reference, the engine's parity)."""
    logps, out = token_logps(model, batch)
    return logps if out.order is None else logps[:, inverse_order(out.order)]


def without_adapters(model: LanguageModel) -> LanguageModel:
    """The same model with every adapter's B at zero: the base model's function, no gradient to it."""
    graphdef, adapters, rest = nnx.split(model, LoraParam, ...)
    zero = jax.tree.map(lambda x: jnp.zeros_like(jax.lax.stop_gradient(x)), adapters)
    return nnx.merge(graphdef, zero, rest)


def _per_pair(values: jax.Array, segments: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Sums of ``values`` [B, T] over each row's chosen (even) and rejected (odd) segments: [B, K] each."""
    t = values.shape[1]
    sums = jax.vmap(lambda v, s: jax.ops.segment_sum(v, s, num_segments=t + 1))(values, segments)
    k = (t + 1) // 2
    return sums[:, 0::2][:, :k], sums[:, 1::2][:, :k]


def preference_loss(
    model: LanguageModel, batch: Batch, /, *, cfg: PreferenceConfig, z_loss: float = 0.0
) -> tuple[jax.Array, LossParts]:
    """(objective, LossParts) of a batch of pairs (module docstring); ``LossParts.cross_entropy`` holds the
    preference loss, ``extra`` the logged means over pairs. The model's auxiliary losses (MoE) are added
    to the objective; ``z_loss`` is not used (the objective is not a cross-entropy)."""
    del z_loss
    if "pair_weights" not in batch:
        raise ConfigError(
            "objective=dpo: the batch has no pairs (data.pack=pairs, from jaxpar prepare --field preference)"
        )
    logps, out = token_logps(model, batch)
    stored = (lambda a: a) if out.order is None else (lambda a: a[:, out.order])
    segments, trained = stored(batch["segments"]), (stored(batch["weights"]) > 0).astype(jnp.float32)
    if "reference" in batch:
        reference = stored(batch["reference"])
    else:
        reference = jax.lax.stop_gradient(token_logps(without_adapters(model), batch)[0])
    chosen, rejected = _per_pair(logps * trained, segments)
    ref_c, ref_r = _per_pair(reference * trained, segments)
    weight, _ = _per_pair(stored(batch["pair_weights"]), segments)  # B·T / pairs at each pair, else 0
    lc, lr = chosen - ref_c, rejected - ref_r
    if cfg.loss == PreferenceLoss.IPO:
        n_c, n_r = _per_pair(trained, segments)
        per_pair = jnp.square(lc / jnp.maximum(n_c, 1.0) - lr / jnp.maximum(n_r, 1.0) - 1.0 / (2.0 * cfg.beta))
    else:
        per_pair = -jax.nn.log_sigmoid(cfg.beta * (lc - lr))
    mean = lambda x: jnp.sum(weight * x) / batch["inputs"].size  # noqa: E731  (the mean over pairs)
    loss = mean(per_pair)
    extra = {
        "rewards/accuracy": mean((lc > lr).astype(jnp.float32)),
        "rewards/margin": mean(cfg.beta * (lc - lr)),
        "rewards/chosen": mean(cfg.beta * lc),
        "rewards/rejected": mean(cfg.beta * lr),
        "logps/chosen": mean(chosen),
        "logps/rejected": mean(rejected),
    }
    zero = jnp.zeros((), jnp.float32)
    return loss + out.aux_loss, LossParts(loss, zero, out.moe, extra)
