"""LoRA adapters (Hu et al. 2021) on a model's named projections.

A projection ``y = einsum(spec, x, W)`` with an adapter becomes ``y + (alpha / rank) · (x A) B``: ``A``
maps the dimensions ``W`` contracts to ``rank``, ``B`` maps ``rank`` to ``W``'s output dimensions
(per expert, or per any dimension ``W`` shares with both ``x`` and ``y``). The adapter path is computed
apart, so the backward pass forms only adapter-sized weight gradients, never ``W``'s.

* ``A`` starts as PEFT's (Kaiming-uniform with a = √5, over its fan-in), ``B`` at zero: a fresh adapter
  leaves every logit bit for bit the base model's.
* Sharding: ``A`` carries ``W``'s input axis names and ``lora_rank``, ``B`` carries ``lora_rank`` and
  ``W``'s output names; ``lora_rank`` is replicated in every rules table.
* Only adapters train: they are ``LoraParam``s, and ``trainable(model)`` is the filter the optimizer and
  the gradients take (``nnx.Param`` for a model without adapters).

``model.lora.targets`` names the projections: ``q``, ``k``, ``v``, ``o`` (GQA attention); ``q_a``,
``q_b`` (or ``q`` without a query latent), ``kv_a``, ``kv_b``, ``o`` (MLA); ``gate_up`` (an adapter each
for gate and up, as PEFT has), ``down`` (the dense SwiGLU MLPs: every layer of a dense model, the dense
layers and shared experts of an MoE model). ``model.lora.rank=0`` (the default) means no adapters.

Serving several adapters at once (``jaxpar.inference.adapters``): ``model.lora.bank=S`` gives every
targeted projection a *bank* of S adapters, ``A`` [S, …] and ``B`` [S, …] (the bank axis first, never
sharded), and inside ``select(rows)`` row ``b`` of a batch takes adapter ``rows[b]`` (``delta``: the
other slots' products zeroed by a one-hot), so one batch mixes adapters (slot 0, all zeros, is the base
model).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.errors import ConfigError
from jaxpar.layers.quant import Quantized, check_kind, dequantize_weights

# Each target's projection, einsum(spec, x, W), as the layers compute it
SPECS = {
    "q": "btd,dnh->btnh",
    "k": "btd,dnh->btnh",
    "v": "btd,dnh->btnh",
    "o": "btnh,nhd->btd",
    "gate_up": "btd,dgf->btgf",
    "down": "btf,fd->btd",
    # Multi-head Latent Attention (``jaxpar.layers.mla``): q through its latent, and keys and values
    "q_a": "btd,dr->btr",
    "q_b": "btr,rnh->btnh",
    "kv_a": "btd,dr->btr",
    "kv_b": "btr,rnh->btnh",
}
# The routed experts of an MoE layer (``jaxpar.layers.moe``): its weights gate_up [E, D, 2, F] and down
# [E, F, D], as the expert kernels use them; an adapter per expert, or one shared by all (``experts``)
EXPERT_SPECS = {"gate_up": "becd,edgf->becgf", "down": "becf,efd->becd"}
EXPERT_TARGETS = {"expert_gate_up": "gate_up", "expert_down": "down"}
TARGETS = (*SPECS, *EXPERT_TARGETS)
RANK_AXIS = "lora_rank"
# Output dimensions of W that the adapter keeps apart: gate and up get an adapter each (A and B both
# carry the part), as PEFT's separate gate_proj and up_proj adapters do
PARTS = {"gate_up": "g"}


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: int = 0  # 0: no adapters
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank
    targets: str = "q,k,v,o"  # comma-separated projection names (``TARGETS``)
    quantize: str = "none"  # the frozen base's projections stored int8 or nf4 (QLoRA: jaxpar.layers.quant)
    bank: int = 0  # serving: S adapters per projection, one picked per row (``select``); 0: one adapter
    experts: str = "each"  # expert_gate_up / expert_down: an adapter per routed expert, or one "shared"

    def __post_init__(self):
        if self.rank < 0:
            raise ConfigError(f"model.lora.rank={self.rank}: must be ≥ 1 (or 0: no adapters)")
        if not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ConfigError(f"model.lora.alpha={self.alpha}: must be a positive number")
        names = [t.strip() for t in self.targets.split(",") if t.strip()]
        if not names or any(t not in TARGETS for t in names):
            raise ConfigError(f"model.lora.targets={self.targets!r}: name projections among {', '.join(TARGETS)}")
        check_kind(self.quantize, self.rank)
        if self.experts not in ("each", "shared"):
            raise ConfigError(f"model.lora.experts={self.experts!r}: each (an adapter per expert) or shared")
        if self.bank < 0 or (self.bank and not self.rank):
            raise ConfigError(f"model.lora.bank={self.bank}: a bank of adapters needs ≥ 1 slot and a rank")

    @property
    def names(self) -> tuple[str, ...]:
        """The targeted projections (none without a rank)."""
        return tuple(t.strip() for t in self.targets.split(",") if t.strip()) if self.rank else ()

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoraParam(nnx.Param):
    """An adapter's weights: the only parameters a run with adapters trains."""


_ROWS: contextvars.ContextVar = contextvars.ContextVar("lora_rows", default=None)


@contextlib.contextmanager
def select(rows: jax.Array):
    """Inside (while a model is traced): row ``b`` of the batch takes adapter ``rows[b]`` [B] of every
    adapter bank (``LoraConfig.bank``); models without banks ignore it."""
    token = _ROWS.set(rows)
    try:
        yield
    finally:
        _ROWS.reset(token)


def trainable(model) -> type:
    """The parameters training updates: the adapters when the model has any, else every parameter."""
    has = any(isinstance(v, LoraParam) for _, v in nnx.iter_graph(model))
    return LoraParam if has else nnx.Param


def letters(spec: str, parts: str = ""):
    """(x, w, y letters, W's contracted, shared and output letters) of an einsum ``x,w->y``; ``parts``
    (output letters of W kept apart, ``PARTS``) count as shared: A and B both carry them."""
    if "z" in spec:
        raise ValueError(f"lora: {spec!r} uses z, the adapter's rank letter")
    ins, y = spec.split("->")
    x, w = ins.split(",")
    contracted = "".join(c for c in w if c in x and c not in y)
    shared = "".join(c for c in w if (c in x and c in y) or c in parts)
    out = "".join(c for c in w if c not in x and c not in parts)
    return x, w, y, contracted, shared, out


def add_adapter(
    module: nnx.Module,
    name: str,
    spec: str,
    lora: LoraConfig | None,
    rngs: nnx.Rngs,
    *,
    target: str = "",
    drop: str = "",
) -> None:
    """Adds ``{name}_lora_a``/``_b`` to ``module`` for its weight ``name`` used as ``einsum(spec, x, W)``,
    when ``lora`` targets ``target`` (default ``name``). ``drop``: letters of W that A and B leave out,
    sharing one adapter over them (the experts of a shared expert adapter)."""
    if lora is None or (target or name) not in lora.names:
        return
    weight = getattr(module, name)
    _, w, _, contracted, shared, out = letters(spec, PARTS.get(name, ""))
    shared = "".join(c for c in shared if c not in drop)
    dims = dict(zip(w, zip(weight.shape, weight.get_metadata()["out_sharding"])))
    bank = [(lora.bank, None)] if lora.bank else []  # the bank axis, never sharded
    a_dims = bank + [dims[c] for c in shared + contracted] + [(lora.rank, RANK_AXIS)]
    b_dims = bank + [dims[c] for c in shared] + [(lora.rank, RANK_AXIS)] + [dims[c] for c in out]
    fan_in = math.prod(dims[c][0] for c in contracted)
    bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform(a=√5): √(6 / ((1 + 5) · fan_in))
    a = jax.random.uniform(rngs.params(), [n for n, _ in a_dims], weight.dtype, -bound, bound)
    b = jnp.zeros([n for n, _ in b_dims], weight.dtype)
    for suffix, value, names in (("a", a, a_dims), ("b", b, b_dims)):
        var = LoraParam(value, out_sharding=tuple(n for _, n in names), eager_sharding=False)
        setattr(module, f"{name}_lora_{suffix}", var)
    module.lora_scale = lora.scale  # static: alpha / rank
    module.lora_bank = bool(lora.bank)  # static: A and B lead with the bank axis (``select`` picks per row)


def delta(module: nnx.Module, name: str, spec: str, x: jax.Array) -> jax.Array | None:
    """The adapter of weight ``name`` on ``x``, ``scale · einsum(x A) B`` shaped as ``einsum(spec, x, W)``,
    or None when ``module`` has none. From a bank, every row runs through every slot's A, the products
    of the other slots are zeroed (a one-hot of ``select``'s rows), and one contraction over slots and
    rank applies B: each slot's A and B are read once per call, and nothing is gathered per row."""
    if not hasattr(module, f"{name}_lora_a"):
        return None
    a, b = (
        getattr(module, f"{name}_lora_a")[...].astype(x.dtype),
        getattr(module, f"{name}_lora_b")[...].astype(x.dtype),
    )
    parts = PARTS.get(name, "")
    xs, _, ys, contracted, shared, out = letters(spec, parts)
    low = "".join(c for c in xs if c not in contracted) + parts + "z"  # x's but the contracted, parts, rank
    scale = jnp.asarray(module.lora_scale, x.dtype)
    if not getattr(module, "lora_bank", False):
        xa = jnp.einsum(f"{xs},{shared}{contracted}z->{low}", x, a)
        return jnp.einsum(f"{low},{shared}z{out}->{ys}", xa, b) * scale
    hot = jax.nn.one_hot(_rows(name), a.shape[0], dtype=x.dtype)  # [B, S]: each row's slot
    low = low[:-1] + "yz"  # y: the bank's slots
    xa = jnp.einsum(f"{xs},y{shared}{contracted}z,{xs[0]}y->{low}", x, a, hot)  # the batch letter leads x
    return jnp.einsum(f"{low},y{shared}z{out}->{ys}", xa, b) * scale


def _rows(name: str) -> jax.Array:
    rows = _ROWS.get()
    if rows is None:
        raise ValueError(f"lora: {name}'s adapter bank is read outside select(rows)")
    return rows


def factors(module: nnx.Module, name: str) -> tuple[str, jax.Array, jax.Array, float] | None:
    """(row letter, A, B, scale) of weight ``name``'s adapter, or None when ``module`` has none; in a
    bank, A and B gathered per row (``select``) with the row letter ``"b"`` leading both, else ``""``.
    For the products ``delta`` cannot write (MLA's absorbed decode)."""
    if not hasattr(module, f"{name}_lora_a"):
        return None
    a, b = getattr(module, f"{name}_lora_a")[...], getattr(module, f"{name}_lora_b")[...]
    if not getattr(module, "lora_bank", False):
        return "", a, b, module.lora_scale
    rows = _rows(name)
    return "b", a[rows], b[rows], module.lora_scale


def project(module: nnx.Module, name: str, spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """``einsum(spec, x, w)``, plus the adapter of weight ``name`` when ``module`` has one."""
    y = jnp.einsum(spec, x, w)
    extra = delta(module, name, spec, x)
    return y if extra is None else y + extra


def _merge(
    w: jax.Array, a: jax.Array, b: jax.Array, *, spec: str, parts: str, scale: float, drop: str = ""
) -> jax.Array:
    _, ws, _, contracted, shared, out = letters(spec, parts)
    shared = "".join(c for c in shared if c not in drop)  # an adapter shared over them: broadcast
    kept = "".join(c for c in ws if c not in drop)
    ab = jnp.einsum(f"{shared}{contracted}z,{shared}z{out}->{kept}", a.astype(jnp.float32), b.astype(jnp.float32))
    ab = jnp.expand_dims(ab, tuple(i for i, c in enumerate(ws) if c in drop))
    return (w.astype(jnp.float32) + scale * ab).astype(w.dtype)


def merged_state(model: nnx.Module) -> nnx.State:
    """The state of the same model without adapters: every targeted weight with its adapter folded in,
    ``W + scale · A B`` (computed in float32, stored in W's dtype), the adapters dropped. Stacked layers
    merge layer by layer. A quantized (QLoRA) base is dequantized first, to float32 weights."""
    model = nnx.clone(model)
    for _, module in nnx.iter_graph(model):
        if isinstance(module, nnx.Module):
            dequantize_weights(module, SPECS)  # a QLoRA base: its float weights first
        if not isinstance(module, nnx.Module) or not hasattr(module, "lora_scale"):
            continue
        if getattr(module, "lora_bank", False):
            raise ValueError("merged_state: a bank of adapters (serving) has no one merged model")
        experts = getattr(module, "lora_experts", None)  # a routed-experts layer: "each" or "shared"
        for name, spec in (EXPERT_SPECS if experts else SPECS).items():
            if not hasattr(module, f"{name}_lora_a"):
                continue
            weight = getattr(module, name)
            drop = "e" if experts == "shared" else ""
            merge = functools.partial(_merge, spec=spec, parts=PARTS.get(name, ""), scale=module.lora_scale, drop=drop)
            for _ in range(weight.ndim - len(spec.split(",")[1].split("->")[0])):  # stacked: over the layers
                merge = jax.vmap(merge)
            weight[...] = merge(
                weight[...], getattr(module, f"{name}_lora_a")[...], getattr(module, f"{name}_lora_b")[...]
            )
    return nnx.state(model, nnx.Not(nnx.Any(LoraParam, Quantized)))
