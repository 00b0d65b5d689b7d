"""Layout search: every factorization of N devices over the mesh axes a model can use, estimated
analytically (no compile: a candidate costs one abstract model build) and ranked by predicted step time
among those that fit.

Estimates per device (the same roofline as ``jaxpar.analysis.plan``, with analytic inputs):
    memory   16 bytes per local parameter element (float32 parameter, gradient, two Adam moments) plus
             activations: the saved layer inputs under full remat (layers × tokens × D × b_a, split by
             tensor's sequence parallelism), one layer's working set (16 × tokens × max(D, F/t) × b_a),
             and float32 logits with their gradient (2 × 4 × tokens × V/t)
    traffic  the analytic minimum bytes per axis group (``costmodel.minimum_bytes``)
    compute  model FLOPs × 4/3 under full remat
"""
from __future__ import annotations

import dataclasses
import math

from jaxpar.analysis.costmodel import hbm_bytes, memory_estimate, minimum_bytes
from jaxpar.analysis.hardware import get_hardware
from jaxpar.analysis.plan import activations_of, predict
from jaxpar.mesh import AXES
from jaxpar.rules import LayoutError

SEARCH_AXES = tuple(a for a in AXES if a != "stage")      # pipelining is not searched (yet)


@dataclasses.dataclass(frozen=True)
class Candidate:
    mesh: dict
    fits: bool
    memory_bytes: float
    predicted_step_s: float
    predicted_mfu: float
    bytes_by_axis: dict


def factorizations(n: int, axes: tuple[str, ...]) -> list[dict]:
    """Every way to write n as a product of sizes over ``axes`` (sizes ≥ 1), in a fixed order."""
    if len(axes) == 1:
        return [{axes[0]: n}]
    return [{axes[0]: d} | rest for d in range(1, n + 1) if n % d == 0 for rest in factorizations(n // d, axes[1:])]


def estimate(cfg, mesh: dict, *, batch: int, seq: int, hardware: str, efficiency=0.6, overlap=0.8):
    """One candidate's ``Candidate`` (raises ``LayoutError`` when the layout cannot divide the model)."""
    from jaxpar.layout import Layout
    from jaxpar.meshes import compose_rules
    from jaxpar.rules import Dim, check_layout
    from jaxpar.shardings import param_shardings

    hw = get_hardware(hardware)
    full = {a: mesh.get(a, 1) for a in ("stage", *SEARCH_AXES)}
    spec = ",".join(f"{a}={n}" for a, n in mesh.items() if n > 1) or "data=1"
    rules = compose_rules(spec, {a for a, n in mesh.items() if n > 1})
    dims = dict(cfg.logical_dims())
    dims.update(batch=Dim(batch, "batch"), length=Dim(seq, "seq"), inner_length=Dim(seq, "seq"))
    rules = check_layout(dims, rules, full)
    layout = Layout(_abstract_mesh(full), rules)
    report = param_shardings(cfg, layout)
    acts = activations_of(cfg, batch=batch, seq=seq)
    token_axes = {a for a in (*rules["batch"], *rules["inner_length"]) if full[a] > 1}
    traffic = minimum_bytes(report, acts, full, rules)
    train_flops = cfg.flops_per_token(seq) * batch * seq / math.prod(full.values()) * (
        4 / 3 if cfg.remat.value == "full" else 1.0)
    times = predict(traffic, flops=train_flops, bytes_accessed=hbm_bytes(report, acts, full, token_axes), mesh=full,
                    hw=hw, efficiency=efficiency, overlap=overlap)
    memory = memory_estimate(cfg, report, acts, full, token_axes)
    mfu = cfg.flops_per_token(seq) * batch * seq / math.prod(full.values()) / (times["step_s"] * hw.peak_bf16_flops)
    return Candidate({a: n for a, n in mesh.items() if n > 1}, memory <= hw.hbm_bytes, memory, times["step_s"], mfu,
                     traffic)


def _abstract_mesh(shape: dict):
    """A mesh over the first N devices JAX has when there are enough, else an abstract one (shapes and
    shardings only: the search never places arrays)."""
    import jax

    from jaxpar.mesh import AXES
    sizes = tuple(shape.get(a, 1) for a in AXES)
    n = math.prod(sizes)
    if n <= jax.device_count():
        from jax.sharding import AxisType
        return jax.make_mesh(sizes, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=jax.devices()[:n])
    return jax.sharding.AbstractMesh(sizes, AXES)


def search(model: str, devices: int, *, batch: int, seq: int, hardware: str, **overrides) -> tuple[list, list]:
    """(ranked candidates: fitting ones by predicted step time, then the rest by memory; refused
    factorizations with their reasons)."""
    from jaxpar.models import get_model_preset

    cfg = get_model_preset(model, **({"dtype": "bfloat16"} | overrides))
    axes = SEARCH_AXES if getattr(cfg, "moe", None) is not None else tuple(a for a in SEARCH_AXES if a != "expert")
    ranked, refused = [], []
    for mesh in factorizations(devices, axes):
        try:
            ranked.append(estimate(cfg, mesh, batch=batch, seq=seq, hardware=hardware))
        except LayoutError as err:
            refused.append((mesh, str(err)))
    ranked.sort(key=lambda c: (not c.fits, c.predicted_step_s if c.fits else c.memory_bytes))
    return ranked, refused
