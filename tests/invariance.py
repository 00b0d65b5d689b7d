"""Layout invariance, shared by the tests that train one model on one device and under a parallel layout:
``train_steps`` records a few training steps (losses, MoE statistics, and each step's gradient of every
parameter, taken from ``make_grad_fn`` on the state the step starts from); ``reference`` runs the
one-device reference and measures its own float noise (tests/noise.py), which sets the bound that
``noise.check_run`` holds a parallel run to.

Gradients are compared per parameter relative to its largest entry, max |a − b| / max |b|, not per
entry: entries whose true gradient is ~0 are float noise summed in a different order.

AdamW runs with eps=1e-3 here: with the usual 1e-8, Adam's first update is lr·sign(g), so an entry whose
gradient is float noise (~1e-10, summed in a different order on 8 devices) moves by ±lr in opposite
directions, and later gradients then differ by far more than rounding. That amplification belongs to
Adam, not to the layout; a large eps removes it and leaves differences at the 1e-6 level (measured),
which is what these tests guard.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from noise import MULTIPLE, Bound, measure, permuted_rows

from jaxpar.layout import make_layout
from jaxpar.mesh import MeshConfig
from jaxpar.meshes import get_mesh_preset
from jaxpar.models import build_model
from jaxpar.pipeline.executor import check_stack
from jaxpar.train.optim import OptimizerConfig, make_optimizer
from jaxpar.train.step import init_train_state, make_grad_fn, make_train_step

OPTIMIZER = OptimizerConfig(learning_rate=1e-2, eps=1e-3)
ONE_DEVICE = dataclasses.replace(get_mesh_preset("dp"), mesh=MeshConfig())


@dataclasses.dataclass(frozen=True)
class Run:
    losses: list[float]  # each step's mean cross-entropy
    grads: list[dict[str, np.ndarray]]  # each step's gradients, by parameter path (``flat``)
    moe: list  # each step's MoE statistics as numpy ([] for dense models)
    state: object  # the state after the last step
    mesh: dict[str, int]  # the layout's mesh axes of size > 1


def flat(tree) -> dict[str, np.ndarray]:
    """A pytree as {path: numpy array}, the path spelled by ``jax.tree_util.keystr``."""
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def train_steps(
    cfg,
    preset,
    tokens: np.ndarray,
    *,
    devices=None,
    grad_accum: int = 1,
    pipeline=None,
    execution=None,
    fsdp_gather: str = "section",
    grad_reduce: str = "slice",
    ends: tuple = (None, None),
) -> Run:
    """Trains ``cfg``, run as ``execution`` says (default ``ExecutionConfig()``), under ``preset`` on
    ``tokens`` [steps, B, T + 1] (step i: inputs tokens[i, :, :-1], targets tokens[i, :, 1:]), recording
    each step's loss, MoE statistics and gradients. ``grad_accum``, ``pipeline`` (a schedule table),
    ``fsdp_gather`` and ``grad_reduce`` go to the train step and the gradient function; ``ends``: the
    pipeline's first and last stage layers (``jaxpar.pipeline.stack``; None: an even split)."""
    steps, batch, seq = tokens.shape[0], tokens.shape[1], tokens.shape[2] - 1
    split = None if pipeline is None else check_stack(cfg, pipeline.stages, pipeline.virtual_stages, None, *ends)
    rows = None if split is None else split.layout_dims()
    layout = make_layout(cfg, preset, batch=batch, seq=seq, devices=devices, execution=execution, extra_dims=rows)
    make = lambda r: build_model(cfg, execution=execution, rngs=r)
    ts = init_train_state(make, functools.partial(make_optimizer, OPTIMIZER), layout, stack=split)
    kw = dict(grad_accum=grad_accum, pipeline=pipeline, fsdp_gather=fsdp_gather, grad_reduce=grad_reduce)
    step, grad_fn = make_train_step(ts, layout, **kw), make_grad_fn(ts, layout, **kw)
    state, losses, grads, moe = ts.state, [], [], []
    for i in range(steps):
        data = {"inputs": tokens[i, :, :-1], "targets": tokens[i, :, 1:]}
        grads.append(flat(grad_fn(state, data)[1]))  # before the step: it donates ``state``
        state, metrics = step(state, data)
        losses.append(float(metrics.loss))
        if metrics.moe is not None:
            moe.append(jax.tree.map(np.asarray, metrics.moe))
    return Run(losses, grads, moe, state, {a: n for a, n in layout.mesh.shape.items() if n > 1})


def one_device(cfg, tokens: np.ndarray, *, grad_accum: int = 1, execution=None) -> Run:
    """``train_steps`` on the first device alone: the reference a parallel layout must reproduce."""
    return train_steps(cfg, ONE_DEVICE, tokens, devices=jax.devices()[:1], grad_accum=grad_accum, execution=execution)


def reference_pair(cfg, tokens: np.ndarray, *, grad_accum: int = 1, execution=None, exact=None) -> tuple[Run, Run]:
    """``one_device`` twice: as given, and another valid way: with the batch rows in another order
    (``noise.permuted_rows``, each row kept in its microbatch), or, given ``exact`` (an execution config
    computing the same function in higher precision), run that way."""
    run = one_device(cfg, tokens, grad_accum=grad_accum, execution=execution)
    if exact is None:
        rows = permuted_rows(tokens.shape[1], grad_accum)
        return run, one_device(cfg, tokens[:, rows], grad_accum=grad_accum, execution=execution)
    return run, one_device(cfg, tokens, grad_accum=grad_accum, execution=exact)


def reference(
    cfg, tokens: np.ndarray, family: str, *, grad_accum: int = 1, execution=None, multiple: float = MULTIPLE, exact=None
):
    """The one-device run and the ``noise.Bound`` that its distance from ``reference_pair``'s other
    run sets."""
    run, other = reference_pair(cfg, tokens, grad_accum=grad_accum, execution=execution, exact=exact)
    return run, Bound(family, measure(run, other), multiple)


def replace_rows(tokens: np.ndarray, dst, src) -> np.ndarray:
    """A mutation: ``tokens`` with rows ``dst`` of every step replaced by rows ``src``: the run sees
    one part of the batch twice and another part never (a dropped microbatch, a shard's gradient term
    missing from its all-reduce and another's counted twice)."""
    out = np.array(tokens)
    out[:, dst] = tokens[:, src]
    return out
