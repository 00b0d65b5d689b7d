"""Copies in a compiled program: the ``copy`` and ``dynamic-slice`` instructions that move a large buffer.

A decode step should read each weight once and write only the new cache entries. A ``copy`` (a layout
change or a materialised transpose) or a ``dynamic-slice`` (a layer sliced out of a stacked array) whose
result is as large as a weight matrix moves a whole buffer every step. (A dynamic-slice of one row, such
as an embedding lookup of one token, moves the row only.) ``large_copies`` lists them from the optimised
HLO text (``compiled.as_text()``), fused computations included; each comes with XLA's ``op_name``
metadata, which names the model variable when the operand is one (``state['blocks'][1]...``).

    found = large_copies(compiled.as_text(), min_elements=smallest_weight)
"""

from __future__ import annotations

import dataclasses
import math
import re

# `%name = f32[2,64]{1,0} op(` : the instruction's name, element type, dims and opcode
_INSTRUCTION = re.compile(r"%([\w.\-]+) = (\w+)\[([\d,]*)\]\S*\s+([\w\-]+)\(([^)]*)\)(.*)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
KINDS = ("copy", "dynamic-slice")


@dataclasses.dataclass(frozen=True)
class Copy:
    """One large copy: the opcode, its result's dims and element count, and XLA's op_name for it."""

    kind: str
    dims: tuple[int, ...]
    elements: int
    op_name: str


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(",") if d)


def large_copies(hlo_text: str, /, *, min_elements: int) -> list[Copy]:
    """Every ``copy`` and ``dynamic-slice`` in ``hlo_text`` whose result has ≥ ``min_elements`` elements."""
    found = []
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.search(line)
        if m is None or m.group(4) not in KINDS:
            continue
        dims = _dims(m.group(3))
        if math.prod(dims) >= min_elements:
            label = _OP_NAME.search(m.group(6))
            found.append(Copy(m.group(4), dims, math.prod(dims), label.group(1) if label else ""))
    return found


@dataclasses.dataclass(frozen=True)
class DecodeStep:
    """A compiled decode step (abstract: nothing the size of the model allocated) and what it must move:
    ``weight_bytes`` (every parameter read once, except the embedding table, of which a step reads one row
    per sequence, unless the LM head shares it), ``cache_bytes`` (every layer's whole cache read) and
    ``new_bytes`` (one position per sequence written in every layer)."""

    compiled: object
    smallest_weight: int  # elements of the smallest parameter of ≥ 2 dims
    weight_bytes: int
    cache_bytes: int
    new_bytes: int
    lower_s: float  # tracing and lowering (``lower_programs``: prefill's too)
    compile_s: float  # XLA's compilation of the decode step

    @property
    def floor_bytes(self) -> int:
        return self.weight_bytes + self.cache_bytes + self.new_bytes

    @property
    def bytes_accessed(self) -> float:
        """XLA's cost analysis of the step: the bytes every instruction reads and writes."""
        return float(self.compiled.cost_analysis()["bytes accessed"])


def compile_decode(cfg, *, batch: int, slots: int, mesh: str = "decode_dp") -> DecodeStep:
    """The decode step ``Generator`` runs for ``cfg`` (unstacked, on one device's ``mesh`` layout),
    compiled from shapes alone."""
    # deferred: jax, flax, the model zoo and the generator
    import time

    import jax
    from flax import nnx

    from jaxpar.inference.generate import abstract_cache, for_generation, lower_programs
    from jaxpar.inference.layouts import build_inference_mesh, check_inference_layout
    from jaxpar.models import build_model

    name, built = build_inference_mesh(mesh, devices=jax.devices()[:1])
    layout = check_inference_layout(cfg, built, name, batch=batch, prompt=16, slots=slots)
    model = for_generation(nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0))))
    with layout.phase("decode").activate():
        abstract = nnx.state(model)
        shardings = nnx.get_named_sharding(abstract, built)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)
    start = time.perf_counter()
    lowered = lower_programs(model, state, layout, batch, 16, slots)[1]
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    lower_s, compile_s = lowered_at - start, time.perf_counter() - lowered_at
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    (table,) = jax.tree.leaves(nnx.state(model.embed))  # [V, D]
    unread = 0 if cfg.tie_embeddings else nbytes(table) - batch * table.shape[1] * table.dtype.itemsize
    cache = jax.tree.leaves(abstract_cache(model, layout, batch, slots))  # each layer's [B, S, ...]
    new = sum(x.size // x.shape[1] * x.dtype.itemsize for x in cache)  # one position of every row
    smallest = min(x.size for x in jax.tree.leaves(state) if x.ndim >= 2)
    return DecodeStep(compiled, smallest, nbytes(state) - unread, nbytes(cache), new, lower_s, compile_s)
