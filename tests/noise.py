"""Tolerances from measured noise, shared by every numerical test family.

A parallel path is compared with a one-device reference, and the reference is only one of many valid
float orders. The same one-device computation done another valid way lands at some distance from it:
that distance is the float noise of this computation, on this machine, under these XLA flags. Every bound
here is a stated multiple of that noise, with a floor:

    tolerance = max(multiple · noise, floor)

The other valid way, for training: the batch rows in another order (``permuted_rows``). The loss is a
mean over rows, the MoE statistics are sums over rows, the capacity rule ranks tokens within their own
row, and the rows of a microbatch stay in that microbatch, so the step computes the same function;
only every sum over the batch adds in another order. The test runs the reference both ways (the second
run hits the compilation cache) and so measures the noise where it runs.

The measure (``Noise``): for gradients, each parameter's max |a − b| over its largest |b| at each step,
the worst over parameters and steps; for losses, the worst relative difference over steps.

``MULTIPLE`` is set from the ratios error / noise that parallel paths reached under three XLA
configurations (benchmarks/numerics.py writes them to benchmarks/results/numerics_cpu.json): up to 5 (a
pipeline under Ulysses splits the batch sums and the contractions at once, where the rows-in-another-order
reference reorders only the first), so a multiple of 50 keeps every bound about 10× above the worst
error seen, while a real bug (tests' mutations: a dropped microbatch, a swapped pair of tokens, a stale
router bias) misses it by thousands. The floors are a few units in the last place of a float32
(2^-23 ≈ 1.2e-7), for when both ways happen to round alike.

Each check appends one JSON line to the file named by ``JAXPAR_NUMERICS_LOG`` (when set): family,
case, noise, tolerance and the error reached, or for a mutation the error it caused.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

EPS32 = 2.0**-23
MULTIPLE = 50  # float32 families: tolerance = MULTIPLE · measured noise
FLOOR = {"grad": 32 * EPS32, "loss": 16 * EPS32, "logit": 16 * EPS32}  # logits: absolute, |z| ~ 1
MUTATION_GAP = 20  # a mutation must miss its bound by at least this factor


@dataclasses.dataclass(frozen=True)
class Noise:
    grad: float  # worst per-parameter max |a − b| / max |b| over steps and parameters
    loss: float  # worst |a − b| / |b| over steps


@dataclasses.dataclass(frozen=True)
class Bound:
    """Tolerances for one family, from the noise measured on this machine."""

    family: str
    noise: Noise
    multiple: float = MULTIPLE

    @property
    def grad(self) -> float:
        return max(self.multiple * self.noise.grad, FLOOR["grad"])

    @property
    def loss(self) -> float:
        return max(self.multiple * self.noise.loss, FLOOR["loss"])


def grad_ratios(got: list[dict], want: list[dict]) -> dict[tuple[int, str], float]:
    """{(step, parameter): max |got − want| / max |want|} (0 where both are exactly 0)."""
    assert len(got) == len(want), f"{len(got)} steps of gradients, want {len(want)}"
    out = {}
    for step, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys(), f"step {step}: parameters {sorted(g.keys() ^ w.keys())} differ"
        for path, ref in w.items():
            err, scale = float(np.max(np.abs(g[path] - ref))), float(np.max(np.abs(ref)))
            out[step, path] = err / scale if scale else (0.0 if err == 0 else np.inf)
    return out


def loss_ratio(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.max(np.abs(got - want) / np.abs(want))) if want.size else 0.0


def measure(a, b) -> Noise:
    """The noise between two valid runs (``invariance.Run``) of the same computation."""
    return Noise(grad=max(grad_ratios(a.grads, b.grads).values()), loss=loss_ratio(a.losses, b.losses))


def permuted_rows(batch: int, microbatches: int = 1, seed: int = 1) -> np.ndarray:
    """A row order that keeps every row in its microbatch (microbatch i holds rows i, i+m, i+2m, ...)
    and visits the microbatches in another order: the same gradient, summed in another order."""
    rng = np.random.default_rng(seed)
    order, out = rng.permutation(microbatches), np.empty(batch, np.int64)
    for i in range(microbatches):
        out[np.arange(i, batch, microbatches)] = rng.permutation(np.arange(order[i], batch, microbatches))
    return out


def record(family: str, case: str, **fields) -> None:
    path = os.environ.get("JAXPAR_NUMERICS_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(dict(family=family, case=case, **fields)) + "\n")


def check_run(got, want, bound: Bound, case: str) -> float:
    """Asserts ``got``'s losses and every parameter's gradient at every step lie within ``bound`` of
    ``want``'s (``invariance.Run``); the failure names the case, step and parameter. Returns the worst
    error as a fraction of its tolerance."""
    ratios, loss = grad_ratios(got.grads, want.grads), loss_ratio(got.losses, want.losses)
    (step, path), worst = max(ratios.items(), key=lambda kv: kv[1])
    record(
        bound.family,
        case,
        noise=dataclasses.asdict(bound.noise),
        tolerance=dict(grad=bound.grad, loss=bound.loss),
        error=dict(grad=worst, loss=loss),
    )
    assert loss <= bound.loss, f"{case}: losses differ by {loss:.3g} > {bound.loss:.3g} (noise {bound.noise.loss:.3g})"
    assert worst <= bound.grad, (
        f"{case} step {step} {path}: gradient error {worst:.3g} · max|g| > {bound.grad:.3g} "
        f"(measured noise {bound.noise.grad:.3g}, × {bound.multiple:g})"
    )
    return max(worst / bound.grad, loss / bound.loss)


def array_ratios(got, want, names) -> dict[str, float]:
    """{name: max |got − want| / max |want|} over paired arrays (a kernel's outputs and gradients)."""
    return {
        k: v
        for (_, k), v in grad_ratios(
            [dict(zip(names, map(np.asarray, got)))], [dict(zip(names, map(np.asarray, want)))]
        ).items()
    }


def check_arrays(got, want, noise: float, family: str, case: str, names=("out", "dq", "dk", "dv")) -> float:
    """Each of ``got``'s arrays within max(MULTIPLE · noise, FLOOR) of ``want``'s, measured as max |Δ| over
    the largest |want| of that array; ``noise`` is the oracle's own (the same measure between two valid
    ways of computing it). Returns the worst error as a fraction of the tolerance."""
    tol = max(MULTIPLE * noise, FLOOR["grad"])
    ratios = array_ratios(got, want, names)
    name, worst = max(ratios.items(), key=lambda kv: kv[1])
    record(family, case, noise=dict(array=noise), tolerance=dict(array=tol), error=dict(array=worst))
    assert worst <= tol, f"{case}: {name} error {worst:.3g} · max|want| > {tol:.3g} (noise {noise:.3g})"
    return worst / tol


def check_mutation_caught(got, want, bound: Bound, mutation: str, gap: float = MUTATION_GAP) -> float:
    """A run with a deliberate bug (``mutation``) must miss ``bound`` by at least ``gap``× in its losses
    or gradients. Returns (and records) that factor: how far the smallest such error lies above the
    tolerance."""
    worst = max(grad_ratios(got.grads, want.grads).values())
    loss = loss_ratio(got.losses, want.losses)
    factor = max(worst / bound.grad, loss / bound.loss)
    record(
        bound.family,
        f"mutation: {mutation}",
        noise=dataclasses.asdict(bound.noise),
        tolerance=dict(grad=bound.grad, loss=bound.loss),
        error=dict(grad=worst, loss=loss),
        factor=factor,
    )
    assert factor >= gap, f"{mutation}: error {worst:.3g} (loss {loss:.3g}) is only {factor:.3g}× the bound"
    return factor
