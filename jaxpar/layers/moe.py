"""Mixture of experts: a router sends each token to a few SwiGLU experts, with optional shared experts.

Legend: B batch, T positions, N = B·T tokens, D width, E experts, k top-k, F expert mlp width,
C capacity (token slots per expert), G groups of experts (sigmoid router).
Weights: router [D, E] (float32), gate_up [E, D, 2, F], down [E, F, D] — ``SwiGLU``'s fused layout with a
leading expert axis — plus an optional always-on ``SwiGLU`` for the shared experts.

Routers (``MoEConfig.router``; capacity, loss weights and the bias rate are execution settings,
``jaxpar.execution.ExecutionConfig``, which the layer takes beside its config):
    softmax        Mixtral/Qwen: softmax over E, the k best, weights renormalised over the k if norm_topk.
    sigmoid        DeepSeek-V3: sigmoid scores; only the ``topk_groups`` best groups (a group scores the sum
                   of its two best experts) compete; the k best there; weights are the k raw scores
                   (normalised over the k if norm_topk) times ``routed_scale``.
    expert_choice  each expert takes its C best tokens by softmax score; a token gets 0..E experts.
Token-choice routers select on ``score + router_bias`` but weigh by the raw score: the bias steers load
without entering the output or the gradient (DeepSeek's auxiliary-loss-free balancing, see ``updated_bias``).

Execution, for token-choice routers. Capacity is per *group*, and a group is one sequence of the batch
(GShard's groups): the rule does not depend on how the batch is split over devices, so the layer gives
the same result on one device and under any data or expert parallel layout.
    capacity (capacity_factor set): C = max(1, ceil(capacity_factor · T · k / E)) slots per expert per
        sequence. Priority within a sequence: its T·k assignments are ranked choice-major — every token's
        1st choice, in token order, then every token's 2nd choice, and so on. An assignment's slot is the
        number of assignments of its sequence ranked before it that went to the same expert
        (``expert_slots``; token order is the original one, whatever order the layout stores the
        sequence in); slots ≥ C are dropped and contribute 0 (the surviving weights are not
        renormalised: norm_topk acts before dropping). Tokens reach the [B, E, C, D] buffer through a
        one-hot dispatch einsum, the experts run where they live (``jaxpar.parallel.moe``: all-to-all
        over ``expert`` when it is split), and a combine einsum carries the routing weights back. The
        dispatch tensor [B, T, E, C] grows as T²·k·capacity_factor/E per sequence.
    dropless (capacity_factor None): the N·k assignments are sorted by expert and run through
        ``jax.lax.ragged_dot`` with the per-expert counts as group sizes, then unsorted and summed; with
        the experts split, the assignments reach their experts by a ragged all-to-all
        (``jaxpar.parallel.dropless``; a padded equivalent on CPU).
Expert choice, per sequence too: C = min(T, max(1, ceil(capacity_factor · T · k / E))).
A token's j-th choice is its j-th highest selection score (``jax.lax.top_k`` order).

Losses (float32, already weighted): aux = aux_loss_weight · E · Σ_e f_e · P_e, with f_e the share of the
N·k assignments that chose e (before capacity) and P_e the mean router probability of e (softmax; for
sigmoid the scores normalised over E) — zero for expert choice, which balances by construction;
z = router_z_loss_weight · mean over tokens of logsumexp(router logits)².
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import Choice, check_choices
from jaxpar.errors import ConfigError
from jaxpar.execution import ExecutionConfig
from jaxpar.layers.common import param
from jaxpar.layers.lora import EXPERT_SPECS, EXPERT_TARGETS, SPECS, LoraConfig, add_adapter
from jaxpar.layers.mlp import SwiGLU
from jaxpar.layers.quant import quantize_weights, weight
from jaxpar.parallel.dropless import dropless_apply
from jaxpar.parallel.moe import ExpertAdapters, experts_apply
from jaxpar.rules import constrain


class Router(Choice):
    SOFTMAX = "softmax"  # Mixtral, Qwen3-MoE
    SIGMOID = "sigmoid"  # DeepSeek-V3: group-limited, with the selection bias
    EXPERT_CHOICE = "expert_choice"  # each expert takes its C best tokens


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    mlp_dim: int  # F of each routed expert
    router: Router = Router.SOFTMAX
    norm_topk: bool = True  # renormalise the k weights to sum to 1
    num_groups: int = 1  # sigmoid: experts split into this many groups …
    topk_groups: int = 1  # … and only this many best groups are routed to
    routed_scale: float = 1.0  # multiplies the routing weights (DeepSeek-V3)
    num_shared_experts: int = 0  # always-on experts, each of width shared_mlp_dim
    shared_mlp_dim: int = 0

    def __post_init__(self):
        check_choices(self, "model.moe")
        e, k, g, kg = self.num_experts, self.top_k, self.num_groups, self.topk_groups
        if e < 1 or k < 1 or self.mlp_dim < 1:
            raise ConfigError(
                f"model.moe.num_experts={e}, model.moe.top_k={k} and "
                f"model.moe.mlp_dim={self.mlp_dim} must all be at least 1"
            )
        if k > e:
            raise ConfigError(f"model.moe.top_k={k} exceeds model.moe.num_experts={e}")
        if g < 1 or e % g:
            raise ConfigError(f"model.moe.num_groups={g} does not divide model.moe.num_experts={e}")
        if not 1 <= kg <= g:
            raise ConfigError(f"model.moe.topk_groups={kg} must lie in 1..model.moe.num_groups={g}")
        if k > kg * (e // g):
            raise ConfigError(
                f"model.moe.top_k={k} exceeds the {kg * (e // g)} experts in "
                f"model.moe.topk_groups={kg} of model.moe.num_groups={g} groups of {e // g}"
            )
        if self.num_shared_experts < 0 or (self.num_shared_experts and self.shared_mlp_dim < 1):
            raise ConfigError(
                f"model.moe.num_shared_experts={self.num_shared_experts} needs "
                f"model.moe.shared_mlp_dim >= 1 (got {self.shared_mlp_dim})"
            )


def check_execution(cfg: MoEConfig, execution: ExecutionConfig) -> None:
    """Refuses an execution these experts cannot run, naming the fields."""
    if execution.capacity_factor is None and cfg.router == "expert_choice":
        raise ConfigError(
            "execution.capacity_factor=None: model.moe.router 'expert_choice' needs a capacity; "
            "dropless is for token-choice routers"
        )


def capacity(num_tokens: int, cfg: MoEConfig, capacity_factor: float) -> int:
    """Token slots per expert per group of ``num_tokens`` (one sequence: T):
    max(1, ceil(capacity_factor · T · k / E)); at most T for expert choice."""
    c = max(1, math.ceil(capacity_factor * num_tokens * cfg.top_k / cfg.num_experts))
    return min(c, num_tokens) if cfg.router == "expert_choice" else c


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEStats:
    aux_loss: jax.Array  # scalar, already times aux_loss_weight (0 for expert choice)
    router_z_loss: jax.Array  # scalar, already times router_z_loss_weight
    expert_load: jax.Array  # [E] float32: assignments per expert this call, before capacity
    dropped_fraction: jax.Array  # scalar: dropped share of the N·k assignments (expert choice: of tokens)


class RouterBias(nnx.Variable):
    """Per-expert selection bias [E]: state, not a parameter, so optimizers (wrt=nnx.Param) skip it."""


def updated_bias(bias: jax.Array, expert_load: jax.Array, rate: float) -> jax.Array:
    """DeepSeek's auxiliary-loss-free step: b += rate · sign(mean load − load), over the last axis.

    Under-loaded experts gain selection bias, over-loaded ones lose it. Call it outside the gradient,
    after the optimizer step, with the ``expert_load`` of that step (stacked layers: [L, E] works too).
    """
    load = expert_load.astype(jnp.float32)
    return bias + rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)


def expert_slots(idx: jax.Array, num_experts: int, index: jax.Array | None = None) -> jax.Array:
    """idx [B, T, k] expert ids -> each assignment's slot [B, T, k] in its expert's buffer of its group
    (one sequence). The slot counts the group's assignments to the same expert ranked before it,
    choice-major: all 1st choices in token order, then all 2nd choices, ... Capacity C keeps slots < C.
    ``index`` [B, T]: each stored token's place in the original sequence (a permutation of 0..T-1 per
    row, e.g. zig-zag context parallelism): token order is that order, so the same assignments drop
    however the layout stores the sequence."""
    if index is not None:
        by_place = jnp.broadcast_to(index[..., None], idx.shape)
        ranked = expert_slots(jax.lax.sort((by_place, idx), dimension=1, num_keys=1)[1], num_experts)
        by_store = jnp.broadcast_to(jnp.argsort(index, axis=1)[..., None], idx.shape)
        return jax.lax.sort((by_store, ranked), dimension=1, num_keys=1)[1]
    b, t, k = idx.shape
    choice_major = jnp.swapaxes(idx, 1, 2).reshape(b, k * t)  # [B, k·T]
    hot = jax.nn.one_hot(choice_major, num_experts, dtype=jnp.int32)  # [B, k·T, E]
    slot = jnp.sum(jnp.cumsum(hot, axis=1) * hot, axis=-1) - 1  # [B, k·T]
    return jnp.swapaxes(slot.reshape(b, k, t), 1, 2)


def _group_limited(sel: jax.Array, groups: int, keep: int) -> jax.Array:
    """sel [..., E] with experts outside the ``keep`` best of ``groups`` groups set to -inf."""
    if keep == groups:
        return sel
    grouped = sel.reshape(*sel.shape[:-1], groups, sel.shape[-1] // groups)  # [..., G, E/G]
    group_score = jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0].sum(-1)  # [..., G]
    best = jax.nn.one_hot(jax.lax.top_k(group_score, keep)[1], groups).sum(-2) > 0  # [..., G]
    return jnp.where(best[..., None], grouped, -jnp.inf).reshape(sel.shape)


class MoE(nnx.Module):
    def __init__(
        self,
        embed_dim: int,
        cfg: MoEConfig,
        *,
        execution: ExecutionConfig | None = None,
        dtype,
        param_dtype,
        rngs: nnx.Rngs,
        lora: LoraConfig | None = None,
        quantize: str = "none",
    ):
        """``execution``: its capacity, loss weights and bias rate (default ``ExecutionConfig()``; the
        compute ``dtype`` is given apart). ``lora``: adapters on the routed experts (``expert_gate_up``,
        ``expert_down``: one per expert, or shared) and on the shared experts (``gate_up``, ``down``).
        ``quantize``: the experts' stored format (``jaxpar.layers.quant``: QLoRA's base, or for serving)."""
        execution = ExecutionConfig() if execution is None else execution
        check_execution(cfg, execution)
        e, d, f = cfg.num_experts, embed_dim, cfg.mlp_dim
        self.cfg, self.execution, self.dtype = cfg, execution, dtype
        self.router = param(rngs, (d, e), ("embed", None), dtype=jnp.float32)
        self.gate_up = param(rngs, (e, d, 2, f), ("experts", "embed", None, "mlp"), dtype=param_dtype)
        self.down = param(rngs, (e, f, d), ("experts", "mlp", "embed"), dtype=param_dtype)
        self.router_bias = RouterBias(jnp.zeros((e,), jnp.float32), out_sharding=("experts",), eager_sharding=False)
        width = cfg.num_shared_experts * cfg.shared_mlp_dim  # n shared experts = one SwiGLU n times wider
        shared = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs, lora=lora, quantize=quantize)
        self.shared = SwiGLU(d, width, **shared) if width else None
        drop = "e" if lora is not None and lora.experts == "shared" else ""
        for target, name in EXPERT_TARGETS.items():
            add_adapter(self, name, EXPERT_SPECS[name], lora, rngs, target=target, drop=drop)
        # each expert's matrices stored quantized as a dense MLP's are
        quantize_weights(self, {name: SPECS[name] for name in EXPERT_SPECS}, quantize)
        if hasattr(self, "gate_up_lora_a") or hasattr(self, "down_lora_a"):
            self.lora_experts = lora.experts  # static: "each" or "shared" (``jaxpar.layers.lora.merged_state``)

    def _adapters(self) -> ExpertAdapters | None:
        """The routed experts' adapters for the kernels, or None."""
        if not hasattr(self, "lora_experts"):
            return None
        pairs = {
            name: (getattr(self, f"{name}_lora_a")[...], getattr(self, f"{name}_lora_b")[...])
            for name in EXPERT_SPECS
            if hasattr(self, f"{name}_lora_a")
        }
        return ExpertAdapters(pairs.get("gate_up"), pairs.get("down"), jnp.asarray(self.lora_scale, jnp.float32))

    def _weight(self, name: str) -> jax.Array:
        """The routed experts' ``gate_up`` or ``down`` as stored, or dequantized in the compute dtype
        (stored quantized: never trained, so no gradient of it is reduced)."""
        if hasattr(self, f"{name}_data"):
            return weight(self, name, SPECS[name], self.dtype)
        return getattr(self, name)[...]

    def update_bias(self, expert_load: jax.Array) -> None:
        """Apply ``updated_bias`` with ``execution.bias_update_rate`` in place (a no-op at rate 0)."""
        self.router_bias[...] = updated_bias(self.router_bias[...], expert_load, self.execution.bias_update_rate)

    def __call__(self, x: jax.Array, index: jax.Array | None = None) -> tuple[jax.Array, MoEStats]:
        """x [B, T, D]; index [B, T]: each stored token's place in the original sequence (capacity ranks
        tokens in that order; None: the stored order is the original one)."""
        cfg, run = self.cfg, self.execution
        x = constrain(x, ("batch", "inner_length", "act_embed"))  # x: [B, T, D]
        logits = jnp.einsum("btd,de->bte", x.astype(jnp.float32), self.router[...])  # fp32 [B, T, E]
        z_loss = run.router_z_loss_weight * jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
        xc = x.astype(self.dtype)
        if cfg.router == "expert_choice":
            y, aux, load, dropped = self._expert_choice(xc, logits)
        else:
            idx, weight, probs = self._route(logits)  # [B, T, k] ×2
            load = jax.nn.one_hot(idx, cfg.num_experts, dtype=jnp.float32).sum((0, 1, 2))  # [E]
            f = load / idx.size  # share of assignments per expert
            aux = run.aux_loss_weight * cfg.num_experts * jnp.sum(f * probs.mean((0, 1)))
            if run.capacity_factor is None:
                y, dropped = self._dropless(xc, idx, weight), jnp.zeros((), jnp.float32)
            else:
                y, dropped = self._capacity(xc, idx, weight, index)
        if self.shared is not None:
            y = y + self.shared(xc)
        y = constrain(y, ("batch", "length", "act_embed"))
        return y, MoEStats(aux_loss=aux, router_z_loss=z_loss, expert_load=load, dropped_fraction=dropped)

    # ------------------------------------------------------------------------------------- routing
    def _route(self, logits: jax.Array):
        """Token choice: expert ids [B, T, k], float32 weights [B, T, k], router probabilities [B, T, E]
        (softmax, or the sigmoid scores normalised over E) for the balancing loss."""
        cfg = self.cfg
        bias = jax.lax.stop_gradient(self.router_bias[...])
        if cfg.router == "softmax":
            scores = probs = jax.nn.softmax(logits, axis=-1)
            sel = scores + bias
        else:
            scores = jax.nn.sigmoid(logits)
            probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
            sel = _group_limited(scores + bias, cfg.num_groups, cfg.topk_groups)
        idx = jax.lax.top_k(sel, cfg.top_k)[1]  # selection sees the bias
        weight = jnp.take_along_axis(scores, idx, axis=-1)  # the weights do not
        if cfg.norm_topk:
            weight = weight / jnp.sum(weight, axis=-1, keepdims=True)
        return idx, weight * cfg.routed_scale, probs

    def _expert_choice(self, x: jax.Array, logits: jax.Array):
        """Each expert takes the C best tokens of each group by softmax score; returns
        (y, aux=0, load [E], dropped: the share of tokens no expert took)."""
        cfg = self.cfg
        b, t, _ = x.shape
        c = capacity(t, cfg, self.execution.capacity_factor)
        scores = jax.nn.softmax(logits, axis=-1)  # [B, T, E]
        gate, token = jax.lax.top_k(jnp.swapaxes(scores, 1, 2), c)  # [B, E, C] each
        pick = jax.nn.one_hot(token, t, dtype=jnp.float32)  # [B, E, C, T]
        dispatch = jnp.moveaxis(pick, -1, 1)  # [B, T, E, C]
        combine = jnp.moveaxis(pick * (gate * cfg.routed_scale)[..., None], -1, 1)
        y = self._dispatch_combine(x, dispatch.astype(self.dtype), combine.astype(self.dtype))
        dropped = 1.0 - jnp.mean((pick.sum((1, 2)) > 0).astype(jnp.float32))
        return y, jnp.zeros((), jnp.float32), jnp.full((cfg.num_experts,), float(b * c), jnp.float32), dropped

    # ----------------------------------------------------------------------------------- execution
    def _capacity(self, x: jax.Array, idx: jax.Array, weight: jax.Array, index: jax.Array | None):
        """Capacity-limited token choice (priority rule in the module docstring); returns (y, dropped)."""
        b, t, k = idx.shape
        e = self.cfg.num_experts
        c = capacity(t, self.cfg, self.execution.capacity_factor)
        slot = expert_slots(idx, e, index)  # [B, T, k]
        kept = slot < c
        expert_hot = jax.nn.one_hot(idx, e, dtype=jnp.float32)  # [B, T, k, E]
        slot_hot = jax.nn.one_hot(jnp.where(kept, slot, c), c, dtype=jnp.float32)  # dropped: all zeros
        dispatch = jnp.einsum("btke,btkc->btec", expert_hot, slot_hot)  # [B, T, E, C]
        combine = jnp.einsum("btke,btkc,btk->btec", expert_hot, slot_hot, weight)
        y = self._dispatch_combine(x, dispatch.astype(self.dtype), combine.astype(self.dtype))
        return y, 1.0 - jnp.mean(kept.astype(jnp.float32))

    def _dispatch_combine(self, x: jax.Array, dispatch: jax.Array, combine: jax.Array) -> jax.Array:
        """x [B, T, D]; dispatch, combine [B, T, E, C] -> y [B, T, D]: each group's tokens gathered per
        expert, the experts run where they live (``jaxpar.parallel.moe.experts_apply``: all-to-all
        over the expert axis when it is split), and the results weighed back."""
        buf = constrain(jnp.einsum("btec,btd->becd", dispatch, x), ("batch", None, None, "act_embed"))
        # the weights enter the kernels as stored and are cast inside: their gradients' reduction over the
        # batch shards then runs in the parameter dtype (XLA:CPU aborts promoting a bf16 one, and f32 is
        # the precision gradients are summed in everywhere else)
        out = experts_apply(buf, self._weight("gate_up"), self._weight("down"), self._adapters())
        out = constrain(out, ("batch", None, None, "act_embed"))  # [B, E, C, D]
        return jnp.einsum("btec,becd->btd", combine, out)

    def _dropless(self, x: jax.Array, idx: jax.Array, weight: jax.Array) -> jax.Array:
        """Every assignment runs (``jaxpar.parallel.dropless``: grouped matmuls, and the ragged
        exchange over the expert axis when it is split); the outputs are weighed and summed. A decode
        step (one token per row) runs every expert instead (``_every_expert``)."""
        if x.shape[1] == 1:
            return self._every_expert(x, idx, weight)
        out = dropless_apply(x, idx, self._weight("gate_up"), self._weight("down"), self._adapters())  # as above
        return jnp.einsum("btkd,btk->btd", out, weight.astype(self.dtype))

    def _every_expert(self, x: jax.Array, idx: jax.Array, weight: jax.Array) -> jax.Array:
        """Every expert on every token, combined by the routing weights (zero for the experts a token did
        not choose): the decode step's experts. Batched over E, each expert's weights are read once as
        they are stored; grouping the rows by expert for ``ragged_dot`` instead made XLA:CPU lay every
        expert's weights out anew in each step (measured: a copy of ``down`` per layer). E/k× the
        routed flops, which a step bound by reading the weights hides; with the experts split, each
        device runs its own and the combine sums over the expert axis."""
        e, dtype = self.cfg.num_experts, x.dtype
        chosen = jnp.sum(jax.nn.one_hot(idx, e, dtype=jnp.float32) * weight[..., None], axis=2)  # [B, T, E]
        xe = jnp.broadcast_to(x[None], (e, *x.shape))  # [E, B, T, D]: a few rows
        adapters = self._adapters()
        h = jnp.einsum("ebtd,edkf->ebtkf", xe, self._weight("gate_up").astype(dtype))
        h = h if adapters is None else h + adapters.gate_up(xe, "ebtd")
        act = jax.nn.silu(h[..., 0, :]) * h[..., 1, :] * jnp.einsum("bte->ebt", chosen.astype(dtype))[..., None]
        y = jnp.einsum("ebtf,efd->btd", act, self._weight("down").astype(dtype))  # weighed, summed over E·F at once
        return y if adapters is None else y + adapters.down(act, "ebtf", "btd")
