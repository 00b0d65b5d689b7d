"""Copies in a compiled program: the ``copy``, ``slice`` and ``dynamic-slice`` instructions that move a large buffer.

A decode step should read each weight once and write only the new cache entries. A ``copy`` (a layout
change or a materialised transpose) or a ``slice`` or ``dynamic-slice`` (a layer sliced out of a stacked array) whose
result is as large as a weight matrix moves a whole buffer every step. (A dynamic-slice of one row, such
as an embedding lookup of one token, moves the row only.) ``large_copies`` lists them from the optimised
HLO text (``compiled.as_text()``), fused computations included; each comes with XLA's ``op_name``
metadata, which names the model variable when the operand is one (``state['blocks'][1]...``).

    found = large_copies(compiled.as_text(), min_elements=smallest_weight)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

# `%name = f32[2,64]{1,0} op(` : the instruction's name, element type, dims and opcode
_INSTRUCTION = re.compile(r"%([\w.\-]+) = (\w+)\[([\d,]*)\]\S*\s+([\w\-]+)\(([^)]*)\)(.*)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
KINDS = ("copy", "dynamic-slice", "slice")


@dataclasses.dataclass(frozen=True)
class Copy:
    """One large copy: the opcode, its result's dims and element count, and XLA's op_name for it."""

    kind: str
    dims: tuple[int, ...]
    elements: int
    op_name: str


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(",") if d)


def large_copies(hlo_text: str, /, *, min_elements: int, kinds: tuple[str, ...] = KINDS) -> list[Copy]:
    """Every ``copy``, ``slice`` and ``dynamic-slice`` (or instruction of ``kinds``: ``("gather",)``) in
    ``hlo_text`` whose result has ≥ ``min_elements`` elements."""
    found = []
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.search(line)
        if m is None or m.group(4) not in kinds:
            continue
        dims = _dims(m.group(3))
        if math.prod(dims) >= min_elements:
            label = _OP_NAME.search(m.group(6))
            found.append(Copy(m.group(4), dims, math.prod(dims), label.group(1) if label else ""))
    return found


_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}
_ITEMSIZE |= {"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_COMPUTATION = re.compile(r"^%([\w.\-]+) \((.*)\) -> .* \{$")
_PARAMETER = re.compile(r"([\w.\-]+): (\w+)\[([\d,]*)\]")
_CALLS = re.compile(r"calls=%([\w.\-]+)")


def _nbytes(dtype: str, dims: str) -> int:
    return _ITEMSIZE.get(dtype, 4) * math.prod(_dims(dims))


def _fused(hlo_text: str) -> dict[str, tuple[dict[str, int], list[str]]]:
    """{computation: ({parameter: bytes}, its instruction lines)} of every computation in ``hlo_text``."""
    found, current = {}, None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = ({n: _nbytes(t, d) for n, t, d in _PARAMETER.findall(header.group(2))}, [])
            found[header.group(1)] = current
        elif not line.startswith("  "):  # "}", ENTRY, module lines
            current = None
        elif current is not None:
            current[1].append(line)
    return found


def _overcount_of(params: dict[str, int], lines: list[str]) -> tuple[int, int]:
    """What XLA overstates in a fusion of ``lines`` per byte of its output: (× its output bytes, plus
    bytes). A root scatter (into a donated buffer: in place) moves its updates, not its operand and output
    (2 × output − updates). A gather from a parameter (an embedding lookup) reads its rows, not the whole
    parameter (parameter − rows)."""
    times, extra = 0, 0
    for line in lines:
        m = _INSTRUCTION.search(line)
        if m is None:
            continue
        operands = [o.strip().lstrip("%") for o in m.group(5).split(",")]
        if m.group(4) == "scatter" and line.lstrip().startswith("ROOT"):
            times, extra = times + 2, extra - params.get(operands[-1], 0)
        elif m.group(4) == "gather" and operands[0] in params:
            extra += params[operands[0]] - _nbytes(m.group(2), m.group(3))
    return times, extra


def cost_overcount(hlo_text: str, /) -> int:
    """Bytes by which XLA's cost analysis of ``hlo_text`` overstates what its scatters and gathers move.
    XLA:CPU wraps them in fusions, and a fusion's cost counts each operand whole and its whole output.
    But a scatter into a donated buffer writes in place, reading and writing the updates only (measured:
    a [4, 8, 4096, 128] float32 cache takes 0.013 ms to scatter one slot per row into, 2.2 ms to rewrite),
    and a gather of B rows of an embedding table reads B rows. (A dynamic-update-slice and a
    dynamic-slice, what batch 1 compiles to, XLA already counts so.)"""
    fused, over = _fused(hlo_text), 0
    rates = {name: _overcount_of(*body) for name, body in fused.items()}
    for line in hlo_text.splitlines():
        m, calls = _INSTRUCTION.search(line), _CALLS.search(line)
        if m and calls and m.group(4) == "fusion" and calls.group(1) in rates:
            times, extra = rates[calls.group(1)]
            over += times * _nbytes(m.group(2), m.group(3)) + extra
    return over


@dataclasses.dataclass(frozen=True)
class DecodeStep:
    """A compiled decode step (abstract: nothing the size of the model allocated) and what it must move:
    ``weight_bytes`` (every parameter read once, except the embedding table, of which a step reads one row
    per sequence, unless the LM head shares it, and an absorbed MLA's kv_b, which prefill reads),
    ``cache_bytes`` (every layer's whole cache read) and
    ``new_bytes`` (one position per sequence written in every layer); beside them ``sampler_bytes``, what
    the step's sampler moves compiled alone on the step's [B, V] logits (``bytes_moved`` of it)."""

    compiled: object
    smallest_weight: int  # elements of the smallest parameter of ≥ 2 dims
    cache_shapes: frozenset  # every cache array's shape
    weight_bytes: int
    cache_bytes: int
    new_bytes: int
    sampler_bytes: float
    lower_s: float  # tracing and lowering (``lower_programs``: prefill's too)
    compile_s: float  # XLA's compilation of the decode step
    prefill: object = None  # the compiled prefill (``compile_decode(prefill_of=)``)

    @property
    def floor_bytes(self) -> int:
        return self.weight_bytes + self.cache_bytes + self.new_bytes

    @property
    def bytes_accessed(self) -> float:
        """XLA's cost analysis of the step: the bytes every instruction reads and writes."""
        return float(self.compiled.cost_analysis()["bytes accessed"])

    @property
    def bytes_moved(self) -> float:
        """``bytes_accessed`` with each in-place scatter and each gather of rows counted as what it moves
        (``cost_overcount``)."""
        return moved(self.compiled)


def cache_copies(found: list[Copy], cache_shapes) -> list[Copy]:
    """The copies in ``found`` of a whole cache array, in any layout: their dims are a permutation of a
    cache array's (size-1 dims aside)."""
    key = lambda dims: sorted(d for d in dims if d > 1)
    shapes = [key(shape) for shape in cache_shapes]
    return [c for c in found if c.kind == "copy" and key(c.dims) in shapes]


def moved(compiled) -> float:
    """XLA's bytes accessed of ``compiled`` less ``cost_overcount``."""
    return float(compiled.cost_analysis()["bytes accessed"]) - cost_overcount(compiled.as_text())


def _sampler_bytes(batch: int, vocab: int, draws: bool) -> float:
    """``moved`` of the generator's sampler alone on float32 [batch, vocab] logits (greedy settings)."""
    import jax  # deferred, as in compile_decode
    import jax.numpy as jnp

    from jaxpar.inference.sampling import SamplingParams, sample

    logits, positions = jax.ShapeDtypeStruct((batch, vocab), jnp.float32), jax.ShapeDtypeStruct((batch,), jnp.int32)
    program = jax.jit(functools.partial(sample, draws=draws))
    return moved(program.lower(logits, SamplingParams.greedy(batch), positions).compile())


def compile_decode(
    cfg,
    *,
    batch: int,
    slots: int,
    mesh: str = "decode_dp",
    unstacked: bool = True,
    prefill_of: int | None = None,
    draws: bool = False,
) -> DecodeStep:
    """The decode step ``Generator`` runs for ``cfg`` (unstacked, on one device's ``mesh`` layout),
    compiled from shapes alone. ``unstacked=False``: the same step on the stacked model (each layer
    sliced out of its stack inside the step), what generation ran before the inference boundary.
    ``prefill_of``: also compile the prefill of prompts bucketed to that many positions (``prefill``).
    ``draws``: the step that can sample (else the greedy one)."""
    # deferred: jax, flax, the model zoo and the generator
    import time

    import jax
    from flax import nnx

    from jaxpar.execution import ExecutionConfig
    from jaxpar.inference.generate import abstract_cache, for_generation, lower_programs
    from jaxpar.inference.layouts import build_inference_mesh, check_inference_layout, generation_execution
    from jaxpar.layers.kvcache import slot_axis
    from jaxpar.models import build_model

    name, built = build_inference_mesh(mesh, devices=jax.devices()[:1])
    prompt = prefill_of or 16
    layout = check_inference_layout(cfg, built, name, batch=batch, prompt=prompt, slots=slots)
    if unstacked:
        model = for_generation(nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0))))
    else:
        execution = generation_execution(ExecutionConfig())
        model = nnx.eval_shape(lambda: build_model(cfg, execution=execution, rngs=nnx.Rngs(0)))
    with layout.phase("decode").activate():
        abstract = nnx.state(model)
        shardings = nnx.get_named_sharding(abstract, built)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)
    start = time.perf_counter()
    prefill, lowered = lower_programs(model, state, layout, batch, prompt, slots, draws=draws)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    lower_s, compile_s = lowered_at - start, time.perf_counter() - lowered_at
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    (table,) = jax.tree.leaves(nnx.state(model.embed))  # [V, D]
    unread = 0 if cfg.tie_embeddings else nbytes(table) - batch * table.shape[1] * table.dtype.itemsize
    if unstacked:  # an absorbed MLA's kv_b: prefill's (decode reads kv_k and kv_v)
        unread += nbytes([v for path, v in nnx.to_flat_state(abstract) if path[-1] == "kv_b"])
    layers = jax.tree.leaves(abstract_cache(model, layout, batch, slots), is_leaf=lambda c: hasattr(c, "NAMES"))
    arrays = [(x, names) for c in layers for x, names in zip(jax.tree.leaves(c), c.NAMES)]  # with logical names
    cache = [x for x, _ in arrays]
    new = sum(x.size // x.shape[slot_axis(names)] * x.dtype.itemsize for x, names in arrays)  # one position
    smallest = min(x.size for x in jax.tree.leaves(state) if x.ndim >= 2)
    sampler = _sampler_bytes(batch, cfg.vocab_size, draws)
    weights = nbytes(state) - unread
    shapes, prefill = frozenset(x.shape for x in cache), prefill.compile() if prefill_of else None
    return DecodeStep(compiled, smallest, shapes, weights, nbytes(cache), new, sampler, lower_s, compile_s, prefill)
