"""Where a model, a batch shape and a mesh preset meet: checked once, before anything compiles."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
from jax.sharding import NamedSharding

from jaxpar.execution import ExecutionConfig
from jaxpar.mesh import build_mesh
from jaxpar.parallel.attention import check_context_parallel
from jaxpar.parallel.flash import check_kernel
from jaxpar.rules import Dim, LayoutError, Rules, check_layout, trace_layout, use_layout


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh and the rules checked against one model and batch shape."""

    mesh: jax.sharding.Mesh
    rules: Rules

    def sharding(self, names) -> NamedSharding:
        return NamedSharding(self.mesh, self.rules.spec(names))

    def activate(self):
        """Context manager: mesh + rules current (for init, tracing and ``constrain``)."""
        return use_layout(self.mesh, self.rules)

    def activate_trace(self):
        """The same inside a jitted function, where ``jax.set_mesh`` is not allowed."""
        return trace_layout(self.mesh, self.rules)


def make_layout(
    model_cfg,
    preset,
    /,
    *,
    batch: int,
    seq: int,
    devices=None,
    execution: ExecutionConfig | None = None,
    extra_dims: Mapping[str, Dim] | None = None,
) -> Layout:
    """Build the mesh of ``preset`` (a ``jaxpar.meshes.MeshPreset``) and check the model, run as
    ``execution`` says (default ``ExecutionConfig()``), against it (``extra_dims``: dimensions that
    replace or add to the model's, such as a pipeline's storage rows of the stack).

    Raises ``LayoutError``/``MeshError`` naming the field, the mesh axis and the numbers.
    """
    mesh = build_mesh(preset.mesh, devices=devices)
    if execution is not None:  # a kernel the devices cannot run, refused before any work
        check_kernel(execution.attention_impl, mesh.devices.flat[0].platform, execution.context_parallel)
    shape = dict(mesh.shape)
    used = {a for _, axes in preset.rules.table for a in axes}
    idle = [f"{a}={n}" for a, n in shape.items() if n > 1 and a not in used]
    if idle:
        raise LayoutError(
            f"mesh {preset.mesh}: axis {', '.join(idle)} is used by no rule of preset "
            f"{preset.rules.name!r}; every device on it would repeat the same work"
        )
    rules = check_model_layout(
        model_cfg, execution, preset.rules, shape, batch=Dim(batch, "batch"), seq=Dim(seq, "seq"), extra_dims=extra_dims
    )
    return Layout(mesh, rules)


def layout_dims(model_cfg, /, *, batch: Dim, seq: Dim) -> dict[str, Dim]:
    """What the layout check measures: the model's dimensions (``logical_dims``), the batch, and the
    positions between blocks and inside them."""
    return dict(model_cfg.logical_dims()) | dict(batch=batch, length=seq, inner_length=seq)


def check_model_layout(
    model_cfg,
    execution: ExecutionConfig | None,
    rules: Rules,
    mesh_shape: Mapping[str, int],
    /,
    *,
    batch: Dim,
    seq: Dim,
    extra_dims=None,
) -> Rules:
    """The layout check, the one place a model meets a rules table (training, generation, the layout lab
    and its search): every dimension the rules shard (``layout_dims``, plus ``extra_dims`` such as a KV
    cache's) divides its mesh axes, and ``execution``'s context-parallel kernel (default
    ``ExecutionConfig()``: none) runs on the split positions. Returns the rules to use (kv heads fewer than
    the tensor size replicated: ``jaxpar.rules.check_layout``); raises ``LayoutError`` naming the field,
    the mesh axis and the numbers."""
    execution = ExecutionConfig() if execution is None else execution
    dims = layout_dims(model_cfg, batch=batch, seq=seq) | dict(extra_dims or {})
    rules = check_layout(dims, rules, mesh_shape)
    check_context_parallel(
        execution.context_parallel,
        execution.cp_order,
        seq=seq.size,
        num_heads=model_cfg.num_heads,
        num_kv_heads=model_cfg.num_kv_heads,
        rules=rules,
        mesh_shape=mesh_shape,
    )
    return rules


def default_batch_seq(preset, num_devices: int, /) -> tuple[int, int]:
    """The smallest batch and sequence length the mesh preset can split: its batch and length ways."""
    shape = preset.mesh.resolve(num_devices).shape()

    def ways(logical):
        return math.prod(shape[a] for a in preset.rules[logical])

    return ways("batch"), math.lcm(ways("length"), ways("inner_length"))
