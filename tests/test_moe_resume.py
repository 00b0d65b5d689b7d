"""Resume and reshard of MoE runs: tiny-moe (Mixtral-like, with a selection bias switched on here) and
tiny-deepseek (MLA attention, sigmoid group-limited routing, selection bias on in the preset).

The router bias is state, not a parameter: the train step moves each expert's entry by -rate, 0 or +rate
after every update (DeepSeek's auxiliary-loss-free balancing), so a resume that lost it, or restored it from the
wrong step, would route tokens differently. Per model, one uninterrupted run of STEPS steps (saved
under SAVED_MESH, a checkpoint every STOP steps) is the reference for:
  * the run interrupted after checkpoint STOP (a copy of its folder without the later checkpoints: the
    state a run killed after step STOP leaves; ``stop_after`` itself is tested on the dense model in
    test_train.py, and a second fresh run would cost another init and step compile) and resumed in
    that folder: the same losses bit for bit, and its final checkpoint equal to the reference's in
    every array;
  * the step-STOP checkpoint restored under OTHER_MESH: every array (router bias included) equals the
    saved one exactly, now split over fsdp. The run resumed there is another program (its sums run in
    another order), so it is not bit for bit: its later losses and its final state lie within the
    noise bound (tests/noise.py) measured for this model by one device with its rows in another order;
  * a resume that restores a stale router bias (zeros, as if the bias were lost) misses that bound by a
    wide margin.
The model config is the same in every run; only the mesh differs.
"""

import functools
import shutil

import jax
import numpy as np
import pytest
from invariance import reference_pair
from noise import MULTIPLE, MUTATION_GAP, Bound, grad_ratios, loss_ratio, measure, record

from jaxpar.checkpoint import Checkpointer, abstract_like
from jaxpar.models import build_model
from jaxpar.train.config import apply_overrides, default_config
from jaxpar.train.loop import plan_layout, train
from jaxpar.train.optim import make_optimizer
from jaxpar.train.step import init_program

STEPS, STOP = 4, 2
SAVED_MESH, OTHER_MESH = "data=2,expert=4", "data=2,fsdp=2,expert=2"
# A checkpoint at STOP and at the end only: each save costs seconds of CPU (orbax compiles its copies).
QUIET = [
    "log.progress=false",
    "log.tensorboard=false",
    "log.eval_every=0",
    f"checkpoint.every={STOP}",
    "optimizer.schedule=constant",
    "optimizer.warmup_steps=0",
    "optimizer.learning_rate=1e-2",
]
BIAS_ON = {"tiny-moe": ["execution.bias_update_rate=1e-3"], "tiny-deepseek": []}


def _cfg(name, mesh=SAVED_MESH):
    cfg = apply_overrides(default_config(name, steps=STEPS, batch=8, seq=16, mesh=mesh), [*QUIET, *BIAS_ON[name]])
    assert cfg.execution.bias_update_rate > 0
    return cfg


def _restore(cfg, run_dir, step):
    """Checkpoint ``step`` of ``run_dir`` restored onto ``cfg``'s layout: {path: array}."""
    layout = plan_layout(cfg)
    program = init_program(
        lambda r: build_model(cfg.model, execution=cfg.execution, rngs=r),
        lambda m: make_optimizer(cfg.optimizer, m, total_steps=cfg.steps),
        layout,
    )
    ckpt = Checkpointer(run_dir / "checkpoints", every=STOP, keep=STEPS)
    try:
        with layout.activate():
            state, _ = ckpt.restore(step, abstract_like(jax.eval_shape(program.create), program.shardings))
    finally:
        ckpt.close()
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(state)}


def _assert_same_arrays(got: dict, want: dict):
    assert got.keys() == want.keys()
    for path in want:
        np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(want[path]), err_msg=path)


def _router_bias(arrays: dict) -> np.ndarray:
    (bias,) = [np.asarray(x) for p, x in arrays.items() if "router_bias" in p]
    return bias


def _interrupted_copy(run_dir, to):
    """``run_dir`` as a run killed after checkpoint STOP was complete: the later checkpoints removed."""
    shutil.copytree(run_dir, to)
    later = [d for d in (to / "checkpoints").iterdir() if d.name.isdigit() and int(d.name) > STOP]
    assert later, "the run must have saved after STOP"
    for step_dir in later:
        shutil.rmtree(step_dir)
    return to


@pytest.fixture(scope="module", params=sorted(BIAS_ON))
def runs(request, tmp_path_factory):
    """(name, the uninterrupted run): one per model, shared by every test."""
    name = request.param
    return name, train(_cfg(name), tmp_path_factory.mktemp(name) / "reference")


def test_the_router_bias_moves_between_checkpoints(runs):
    """From 0, by -rate, 0 or +rate per entry and step: STOP steps move each entry by a whole
    number of rates in [-STOP, STOP], and some entries move in every interval."""
    name, reference = runs
    cfg = _cfg(name)
    rate = cfg.execution.bias_update_rate
    biases = [_router_bias(_restore(cfg, reference.out_dir, s)) for s in range(STOP, STEPS + 1, STOP)]
    assert biases[0].shape == (cfg.model.num_moe_layers, cfg.model.moe.num_experts)
    for before, after in zip([np.zeros_like(biases[0]), *biases], biases):
        moved = (after.astype(np.float64) - before) / rate
        assert np.any(moved != 0), "the bias did not move"
        np.testing.assert_allclose(moved, np.round(moved), atol=1e-3)
        assert np.all(np.abs(np.round(moved)) <= STOP)


def test_resume_in_the_same_folder_is_bit_exact(runs, tmp_path):
    name, reference = runs
    assert sorted(reference.losses) == list(range(1, STEPS + 1))
    assert reference.losses[STEPS] < reference.losses[1], "the run must train for this to mean anything"
    resumed = train(_cfg(name), _interrupted_copy(reference.out_dir, tmp_path / "run"))
    assert resumed.start_step == STOP and resumed.last_step == STEPS
    assert resumed.losses == {s: reference.losses[s] for s in range(STOP + 1, STEPS + 1)}  # bit for bit
    cfg = _cfg(name)
    _assert_same_arrays(_restore(cfg, resumed.out_dir, STEPS), _restore(cfg, reference.out_dir, STEPS))


@functools.cache
def _bound(name: str) -> tuple[Bound, float]:
    """(the noise bound on losses, the bound on the final state's arrays) of ``name``'s model: one device
    over STEPS steps of random batches of the runs' shape, rows in another order (tests/noise.py). The
    state bound is MULTIPLE × the two runs' largest per-array max |a − b| / max |b| of the final state."""
    cfg = _cfg(name)
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (STEPS, 8, 17), dtype=np.int32)
    ref, other = reference_pair(cfg.model, tokens, execution=cfg.execution)
    return Bound("resume", measure(ref, other)), MULTIPLE * max(
        grad_ratios([_arrays(other.state)], [_arrays(ref.state)]).values()
    )


def _arrays(state) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(state)}


def _resumed_error(name, reference, resumed, snapshot) -> tuple[float, float]:
    """(relative error of the resumed steps' losses, worst per-array error of the final state)."""
    later = range(STOP + 1, STEPS + 1)
    loss = loss_ratio([resumed.losses[s] for s in later], [reference.losses[s] for s in later])
    final, want = _restore(_cfg(name), snapshot, STEPS), _restore(_cfg(name), reference.out_dir, STEPS)
    assert final.keys() == want.keys()
    state = max(
        grad_ratios(
            [{p: np.asarray(x) for p, x in final.items()}], [{p: np.asarray(x) for p, x in want.items()}]
        ).values()
    )
    return loss, state


def _record(case, bound, state_bound, loss, state, **extra):
    record(
        "resume",
        case,
        noise=dict(loss=bound.noise.loss, state=state_bound / MULTIPLE),
        tolerance=dict(loss=bound.loss, state=state_bound),
        error=dict(loss=loss, state=state),
        **extra,
    )


def test_restore_under_another_mesh_reshards_and_continues(runs, tmp_path):
    name, reference = runs
    snapshot = _interrupted_copy(reference.out_dir, tmp_path / "run")
    saved = _restore(_cfg(name), snapshot, STOP)
    other = _restore(_cfg(name, OTHER_MESH), snapshot, STOP)
    _assert_same_arrays(other, saved)
    assert np.any(_router_bias(other) != 0)
    specs = {p: str(x.sharding.spec) for p, x in other.items()}
    assert any("fsdp" in s for s in specs.values()), "the other mesh must split the restored state over fsdp"
    assert specs != {p: str(x.sharding.spec) for p, x in saved.items()}
    resumed = train(_cfg(name, OTHER_MESH), snapshot)
    assert resumed.start_step == STOP
    (bound, state_bound), (loss, state) = _bound(name), _resumed_error(name, reference, resumed, snapshot)
    _record(f"{name} on {OTHER_MESH}", bound, state_bound, loss, state)
    assert loss <= bound.loss, (loss, bound)
    assert state <= state_bound, (state, state_bound)


def test_a_stale_router_bias_is_caught(runs, tmp_path, monkeypatch):
    """The same resume, with the restore handing back a zero router bias: the bound must be missed."""
    name, reference = runs
    snapshot = _interrupted_copy(reference.out_dir, tmp_path / "run")
    restore = Checkpointer.restore

    def stale(self, step, abstract):
        state, data = restore(self, step, abstract)
        zero = lambda p, x: jax.numpy.zeros_like(x) if "router_bias" in jax.tree_util.keystr(p) else x
        return jax.tree_util.tree_map_with_path(zero, state), data

    monkeypatch.setattr(Checkpointer, "restore", stale)
    resumed = train(_cfg(name, OTHER_MESH), snapshot)
    (bound, state_bound), (loss, state) = _bound(name), _resumed_error(name, reference, resumed, snapshot)
    factor = max(loss / bound.loss, state / state_bound)
    _record(f"mutation: {name}: stale router bias", bound, state_bound, loss, state, factor=factor)
    assert factor >= MUTATION_GAP, (loss, state, bound, state_bound)
