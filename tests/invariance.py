"""Layout invariance, shared by the tests that train one model on one device and under a parallel layout:
``train_steps`` records a few training steps (losses, MoE statistics, and each step's gradient of every
parameter, taken from ``make_grad_fn`` on the state the step starts from), and ``assert_same_gradients``
compares two such records parameter by parameter.

Gradient tolerance: at every step, each parameter's gradient within ``rtol`` of that parameter's largest
gradient entry, max |a − b| ≤ rtol · max |b| (default 1e-5, fp32). A relative-to-the-largest measure,
not per entry: entries whose true gradient is ~0 are float noise summed in a different order.

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

from jaxpar.layout import make_layout
from jaxpar.mesh import MeshConfig
from jaxpar.meshes import get_mesh_preset
from jaxpar.models import build_model
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
    cfg, preset, tokens: np.ndarray, *, devices=None, grad_accum: int = 1, pipeline=None, execution=None
) -> Run:
    """Trains ``cfg``, run as ``execution`` says (default ``ExecutionConfig()``), under ``preset`` on
    ``tokens`` [steps, B, T + 1] (step i: inputs tokens[i, :, :-1], targets tokens[i, :, 1:]), recording
    each step's loss, MoE statistics and gradients. ``grad_accum`` and ``pipeline`` (a schedule table) go
    to the train step and the gradient function."""
    steps, batch, seq = tokens.shape[0], tokens.shape[1], tokens.shape[2] - 1
    layout = make_layout(cfg, preset, batch=batch, seq=seq, devices=devices, execution=execution)
    make = lambda r: build_model(cfg, execution=execution, rngs=r)
    ts = init_train_state(make, functools.partial(make_optimizer, OPTIMIZER), layout)
    kw = dict(grad_accum=grad_accum, pipeline=pipeline)
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


def assert_same_gradients(got: list[dict], want: list[dict], label: str, *, rtol: float = 1e-5) -> float:
    """Every parameter's gradient at every step: max |got − want| ≤ rtol · max |want|. The failure names
    ``label`` (the path under test), the step and the parameter. Returns the largest ratio
    max |got − want| / max |want| seen (0 where both are exactly 0)."""
    assert len(got) == len(want), f"{label}: {len(got)} steps of gradients, want {len(want)}"
    worst = 0.0
    for step, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys(), f"{label} step {step}: parameters {sorted(g.keys() ^ w.keys())} differ"
        for path, ref in w.items():
            err, scale = float(np.max(np.abs(g[path] - ref))), float(np.max(np.abs(ref)))
            assert err <= rtol * scale, (
                f"{label} step {step} {path}: max err {err:.3g} > {rtol:g} · max|g| "
                f"{scale:.3g} (ratio {err / scale if scale else np.inf:.3g})"
            )
            worst = max(worst, err / scale if scale else 0.0)
    return worst
