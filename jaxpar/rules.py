"""Logical axis names, rule tables, and the check where a model meets a mesh.

Models name every dimension of every parameter and activation with a *logical* axis. A rule table maps
each logical name onto zero or more *mesh* axes. Parameters and activations have separate names, so FSDP
can shard weights over ``fsdp`` on ``embed`` while activations are sharded over ``fsdp`` on ``batch``.

Parameter names:
    vocab      rows of the embedding table / columns of the LM head
    embed      model width D on the weight side
    heads      query heads N              kv_heads   key/value heads K (GQA/MQA: K < N)
    head_dim   per-head width H           mlp        feed-forward width F
    layers     the stacked-layer axis L of the stack a pipeline splits over ``stage``
    prefix_layers  the stacked axis of layers that run before that stack (DeepSeek's first dense
               layers: the pipeline runs them before its schedule, see ``jaxpar.pipeline.executor``)
    norm       scale vectors of norms over D
    experts    the expert axis E of MoE expert weights
    q_lora / kv_lora   the low-rank latent widths of Multi-head Latent Attention (DeepSeek)
    lora_rank  the rank of a LoRA adapter (``jaxpar.layers.lora``; replicated in every table)
Activation names:
    batch        sequences B
    length       positions T of the residual stream *between* blocks (Megatron sequence parallelism
                 shards it over ``tensor`` there)
    inner_length positions T *inside* attention and MLP blocks
    act_embed    D of activations         act_heads / act_kv_heads   N / K of activations
    act_mlp      F of activations         act_vocab  V of logits
    act_experts  E of MoE dispatch buffers [E, C, D] (tokens gathered per expert)
KV-cache names (generation, ``jaxpar.inference``):
    cache_batch     sequences of the cache       cache_length   its slots (positions)
    cache_kv_heads  K of a GQA cache (an MLA cache, one latent per token, has none)
``None`` in a names tuple means "never sharded".
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.errors import LayoutError, NoLayoutError  # noqa: F401  (LayoutError: re-exported)

PARAM_AXES = (
    "vocab",
    "embed",
    "heads",
    "kv_heads",
    "head_dim",
    "mlp",
    "layers",
    "prefix_layers",
    "norm",
    "experts",
    "q_lora",
    "kv_lora",
    "lora_rank",
)
ACTIVATION_AXES = (
    "batch",
    "length",
    "inner_length",
    "act_embed",
    "act_heads",
    "act_kv_heads",
    "act_mlp",
    "act_vocab",
    "act_experts",
)
CACHE_AXES = ("cache_batch", "cache_length", "cache_kv_heads")
LOGICAL_AXES = PARAM_AXES + ACTIVATION_AXES + CACHE_AXES


@dataclasses.dataclass(frozen=True)
class Rules:
    """A complete table: every logical axis maps to a tuple of mesh axes (empty = replicated)."""

    name: str
    table: tuple[tuple[str, tuple[str, ...]], ...]

    @classmethod
    def from_mapping(cls, name: str, mapping: Mapping[str, str | Sequence[str] | None]) -> Rules:
        missing = [a for a in LOGICAL_AXES if a not in mapping]
        unknown = [a for a in mapping if a not in LOGICAL_AXES]
        if missing or unknown:
            raise LayoutError(
                f"rules {name!r}: every logical axis needs exactly one rule; missing {missing}, unknown {unknown}"
            )
        norm = {k: (() if v is None else (v,) if isinstance(v, str) else tuple(v)) for k, v in mapping.items()}
        return cls(name, tuple((a, norm[a]) for a in LOGICAL_AXES))

    def __getitem__(self, logical: str) -> tuple[str, ...]:
        for name, axes in self.table:
            if name == logical:
                return axes
        raise LayoutError(f"rules {self.name!r}: unknown logical axis {logical!r}; known: {LOGICAL_AXES}")

    def replace(self, **changes: str | Sequence[str] | None) -> Rules:
        mapping = dict(self.table)
        mapping.update(changes)
        return Rules.from_mapping(self.name, mapping)

    def spec(self, names: Iterable[str | None]) -> PartitionSpec:
        """Logical names of one array's dimensions -> PartitionSpec."""
        parts, used = [], set()
        for logical in names:
            axes = () if logical is None else self[logical]
            clash = used.intersection(axes)
            if clash:
                raise LayoutError(f"rules {self.name!r}: mesh axis {sorted(clash)} used twice in {tuple(names)}")
            used.update(axes)
            parts.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return PartitionSpec(*parts)

    def as_flax(self) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
        """The form ``nnx.logical_axis_rules`` takes."""
        return tuple((a, None if not m else m[0] if len(m) == 1 else m) for a, m in self.table)


# ---------------------------------------------------------------------------------------- context
@dataclasses.dataclass(frozen=True)
class _Layout:
    mesh: jax.sharding.Mesh
    rules: Rules


_CURRENT: contextvars.ContextVar[_Layout | None] = contextvars.ContextVar("jaxpar_layout", default=None)


@contextlib.contextmanager
def trace_layout(mesh: jax.sharding.Mesh, rules: Rules):
    """Rules current for ``constrain`` and Flax metadata; usable inside a jitted function."""
    from flax import nnx  # deferred: flax, which only tracing under a layout needs

    token = _CURRENT.set(_Layout(mesh, rules))
    try:
        with nnx.logical_axis_rules(rules.as_flax()):
            yield
    finally:
        _CURRENT.reset(token)


@contextlib.contextmanager
def use_layout(mesh: jax.sharding.Mesh, rules: Rules):
    """``trace_layout`` plus ``jax.set_mesh``: for sharded init and eager code (not inside jit)."""
    with jax.set_mesh(mesh), trace_layout(mesh, rules):
        yield


def _devices_spanned(x) -> int:
    """How many devices the mesh of ``x`` (a traced or concrete array) spans; 0 or 1 for one device."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty:
        concrete = getattr(x, "sharding", None) if isinstance(x, jax.Array) else None
        return 0 if concrete is None else len(concrete.device_set)
    return mesh.size


def _in_context(mesh: jax.sharding.Mesh):
    """``mesh``, or inside a ``shard_map`` that made some axes manual (the pipeline's ``stage``) the
    context's abstract mesh, which says so: shardings and nested ``shard_map``s must name that one."""
    return jax.sharding.get_abstract_mesh() if partly_manual() else mesh


def partly_manual() -> bool:
    """Whether this code is traced inside a ``shard_map`` that made some mesh axes manual (the pipeline)."""
    context = jax.sharding.get_abstract_mesh()
    return not context.empty and bool(context.manual_axes)


def active_layout(*arrays) -> tuple[jax.sharding.Mesh, Rules] | None:
    """``(mesh, rules)`` of the current layout, or None when the model runs on one device. Inside a
    partly manual ``shard_map`` the mesh is the context's abstract mesh (see ``_in_context``).

    Never silent: with no layout active, arrays that live on a multi-device mesh (or a multi-device
    ``jax.set_mesh`` context) raise ``NoLayoutError``. Without its layout a model would compile with no
    sharding constraints and with the one-device attention and MoE paths: correct, but O(L) memory and
    none of the kernels its layout asks for."""
    layout = _CURRENT.get()
    if layout is not None:
        return _in_context(layout.mesh), layout.rules
    context = jax.sharding.get_abstract_mesh()
    spans = max([0 if context.empty else context.size] + [_devices_spanned(x) for x in arrays])
    if spans > 1:
        raise NoLayoutError(
            f"the model is traced on a mesh of {spans} devices but no jaxpar layout is active, so it would run "
            "without sharding constraints and with its one-device attention and MoE paths. Trace it inside "
            "`layout.activate()` (eager code, init) or `layout.activate_trace()` (inside a jitted function), "
            "with the layout from jaxpar.layout.make_layout; jaxpar.train.step's functions do this for you"
        )
    return None


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Pin an activation's layout by logical names. On one device (no layout, ``x`` on one device) it
    is the identity; on a multi-device mesh without a layout it raises ``NoLayoutError``. Inside a
    ``shard_map`` the axes it made manual are left out (the array is already this device's part over them:
    the batch axes, when gradients are reduced once a step)."""
    layout = active_layout(x)
    if layout is None:
        return x
    mesh, rules = layout
    if len(names) != x.ndim:
        raise LayoutError(f"constrain: {len(names)} names {tuple(names)} for an array of rank {x.ndim}")
    spec = rules.spec(names)
    if partly_manual():
        spec = without_axes(spec, jax.sharding.get_abstract_mesh().manual_axes)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def axes_of(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def without_axes(spec: PartitionSpec, axes: Iterable[str]) -> PartitionSpec:
    """``spec`` with the mesh ``axes`` left out of every entry."""
    axes = set(axes)
    kept = [tuple(a for a in axes_of(e) if a not in axes) for e in spec]
    return PartitionSpec(*[None if not k else k[0] if len(k) == 1 else k for k in kept])


# ------------------------------------------------------------------------------------------ check
@dataclasses.dataclass(frozen=True)
class Dim:
    """One sized dimension that logical axes govern: its size and the config field it comes from."""

    size: int
    field: str


def check_layout(dims: Mapping[str, Dim], rules: Rules, mesh_shape: Mapping[str, int]) -> Rules:
    """Check every dimension a rule shards divides its mesh axes; return the rules to use.

    Key/value heads fewer than the tensor size (and dividing it) are replicated over ``tensor``, the
    Megatron answer for GQA/MQA: the returned rules map ``kv_heads``/``act_kv_heads`` to nothing.
    Anything else that does not divide raises ``LayoutError`` naming field, axis and numbers.
    """
    kv = dims.get("kv_heads")
    kv_axes = rules["kv_heads"]
    kv_ways = math.prod(mesh_shape[a] for a in kv_axes)
    if kv is not None and kv.size % kv_ways and kv_ways % kv.size == 0:
        rules = rules.replace(kv_heads=None, act_kv_heads=None)
    for logical, dim in dims.items():
        axes = rules[logical]
        ways = math.prod(mesh_shape[a] for a in axes)
        if dim.size % ways:
            detail = "×".join(f"{a}={mesh_shape[a]}" for a in axes)
            hint = ""
            if logical in ("kv_heads", "act_kv_heads"):
                hint = f"; kv heads are replicated only when they divide the tensor size {ways}"
            raise LayoutError(
                f"{dim.field}={dim.size} (logical axis {logical!r}) is not divisible by mesh "
                f"axes {detail} = {ways} under rules {rules.name!r}{hint}"
            )
    return rules
