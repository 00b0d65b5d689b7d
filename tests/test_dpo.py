"""DPO's loss (jaxpar.train.preference) on preference pairs packed into rows (``data.pack=pairs``): with the
policy equal to its reference the loss is log 2, one step raises the chosen-minus-rejected margin, the
precomputed and the adapters-off references give the same run, and the adapters' (or every weight's)
gradients are the one-device ones on the parallel layouts and under gradient accumulation, within the
measured noise; a reference taken from the wrong rows is caught by that bound."""

import dataclasses
import functools
import json
import math

import jax
import numpy as np
import pytest
from invariance import ONE_DEVICE, OPTIMIZER, Run, flat
from noise import Bound, Noise, check_mutation_caught, check_run, measure, permuted_rows

from jaxpar.cli import main
from jaxpar.data import PackedRows, TokenFiles, batch_of_rows, plan_pairs
from jaxpar.execution import ExecutionConfig
from jaxpar.layers.lora import LoraConfig
from jaxpar.layout import make_layout
from jaxpar.meshes import resolve_mesh_arg
from jaxpar.models import build_model, get_model_preset
from jaxpar.train.optim import make_optimizer
from jaxpar.train.preference import PreferenceConfig, natural_logps, preference_loss
from jaxpar.train.step import init_train_state, make_grad_fn, make_model_fn, make_train_step

B, T, STEPS, BETA = 8, 48, 3, 0.5
FULL = dataclasses.replace(get_model_preset("tiny"), vocab_size=257)
LORA = dataclasses.replace(FULL, lora=LoraConfig(rank=4, targets="q,k,v,o,gate_up,down"))


def preference_records(n: int, seed: int = 0) -> list[dict]:
    """Toy pairs: the chosen reply reverses the prompt's word, the rejected one repeats it."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        word = "".join(rng.choice(list("abcdefgh"), rng.integers(3, 7)))
        out.append({"prompt": word + ">", "chosen": word[::-1], "rejected": word})
    return out


def prepared(folder, n: int = 64):
    """The pairs as ``jaxpar prepare --field preference --bytes`` writes them."""
    (folder / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in preference_records(n)))
    assert (
        main(
            ["prepare", str(folder / "prefs.jsonl"), "--field", "preference", "--bytes", "--out", str(folder / "p.npy")]
        )
        == 0
    )
    return folder / "p.npy"


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    """STEPS batches of B rows of T + 1 tokens, the pairs placed in file order."""
    path = prepared(tmp_path_factory.mktemp("prefs"))
    files = TokenFiles([path], "uint16")
    plan, _ = plan_pairs(*files.documents(), T + 1)
    masks = files.masks()
    rows = PackedRows(files.read, functools.partial(files.trained, masks), plan, T + 1, 0, plan.rows, pairs=True)
    assert plan.rows >= STEPS * B
    stacked = [[rows[s * B + i] for i in range(B)] for s in range(STEPS)]
    return [batch_of_rows({k: np.stack([r[k] for r in step]) for k in step[0]}) for step in stacked]


def dpo_steps(
    cfg, preset, batches, *, reference="adapters_off", loss="sigmoid", grad_accum=1, execution=None, devices=None
) -> Run:
    """Trains ``cfg`` with DPO on ``batches`` under ``preset``, recording each step's loss, margin and
    gradients (taken before the step); ``reference="precomputed"``: the initial weights' log-probs of
    each batch's targets, carried in the batch as the loader carries them."""
    layout = make_layout(cfg, preset, batch=B, seq=T, devices=devices, execution=execution)
    make = lambda r: build_model(cfg, execution=execution, rngs=r)  # noqa: E731
    ts = init_train_state(make, functools.partial(make_optimizer, OPTIMIZER), layout)
    loss_fn = functools.partial(preference_loss, cfg=PreferenceConfig(beta=BETA, loss=loss, reference=reference))
    if reference == "precomputed" and "reference" not in batches[0]:  # (a test may bring its own)
        initial = make_model_fn(ts, layout, natural_logps, layout.sharding(("batch", "length")))
        batches = [b | {"reference": np.asarray(initial(ts.state, b))} for b in batches]
    step = make_train_step(ts, layout, loss_fn=loss_fn, grad_accum=grad_accum)
    grad_fn = make_grad_fn(ts, layout, loss_fn=loss_fn, grad_accum=grad_accum)
    state, losses, grads, extras = ts.state, [], [], []
    for data in batches:
        grads.append(flat(grad_fn(state, data)[1]))
        state, metrics = step(state, data)
        losses.append(float(metrics.loss))
        extras.append({k: float(v) for k, v in metrics.extra.items()})
    return Run(losses, grads, extras, state, {a: n for a, n in layout.mesh.shape.items() if n > 1})


def one_device(cfg, batches, **kw) -> Run:
    return dpo_steps(cfg, ONE_DEVICE, batches, devices=jax.devices()[:1], **kw)


def _rows(batches, order):
    return [{k: v[order] for k, v in b.items()} for b in batches]


def _bound(cfg, batches, run, **kw) -> Bound:
    """The noise of ``run``: the larger distance to two runs with the rows in other orders (one alone
    can round exactly alike on a loss, a measured 0)."""
    others = [one_device(cfg, _rows(batches, permuted_rows(B, seed=seed)), **kw) for seed in (1, 2)]
    noises = [measure(run, other) for other in others]
    return Bound("dpo", Noise(grad=max(n.grad for n in noises), loss=max(n.loss for n in noises)))


@pytest.fixture(scope="module")
def dpo_reference(batches):
    """The one-device LoRA run and the bound its own noise sets (the rows in other orders)."""
    run = one_device(LORA, batches)
    return run, _bound(LORA, batches, run)


def test_the_policy_equal_to_its_reference_gives_log_2_and_a_step_raises_the_margin(batches):
    run = one_device(LORA, [batches[0], batches[0]])  # the same batch again, after one update
    first, second = run.moe  # (Run.moe holds each step's logged means here)
    # lc = lr = 0 exactly (a fresh adapter adds exact zeros), so each pair's loss is -log σ(0) = log 2
    # exactly; their mean over the batch's pairs rounds it by a few units in the last place
    assert first["rewards/chosen"] == first["rewards/rejected"] == first["rewards/margin"] == 0.0
    assert abs(run.losses[0] - math.log(2)) <= 4 * np.spacing(np.float32(math.log(2)))
    assert second["rewards/margin"] > 0.0


def test_precomputed_and_adapters_off_references_give_the_same_run(dpo_reference, batches):
    ref, bound = dpo_reference
    check_run(one_device(LORA, batches, reference="precomputed"), ref, bound, "precomputed reference")


CASES = [
    ("fsdp=8", {}, 1),
    ("data=2,tensor=4", {}, 1),
    ("data=2,sequence=4", dict(context_parallel="ring"), 1),
    ("fsdp=4,tensor=2", {}, 2),
]


@pytest.mark.parametrize("mesh, settings, grad_accum", CASES)
def test_adapter_gradients_equal_one_device(dpo_reference, batches, mesh, settings, grad_accum):
    ref, bound = dpo_reference
    if grad_accum > 1:  # the slices hold different numbers of pairs: the mean is over the whole batch's
        ref = one_device(LORA, batches, grad_accum=grad_accum)
    run = dpo_steps(LORA, resolve_mesh_arg(mesh), batches, grad_accum=grad_accum, execution=ExecutionConfig(**settings))
    check_run(run, ref, bound, f"dpo {mesh} {settings} grad_accum={grad_accum}")


@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_full_fine_tuning_with_a_precomputed_reference_equals_one_device(batches, loss):
    ref = one_device(FULL, batches, reference="precomputed", loss=loss)
    bound = _bound(FULL, batches, ref, reference="precomputed", loss=loss)
    run = dpo_steps(FULL, resolve_mesh_arg("fsdp=4,tensor=2"), batches, reference="precomputed", loss=loss)
    check_run(run, ref, bound, f"dpo full {loss} fsdp=4,tensor=2")


def test_a_reference_from_the_wrong_rows_is_caught(dpo_reference, batches):
    ref, bound = dpo_reference
    layout = make_layout(LORA, ONE_DEVICE, batch=B, seq=T, devices=jax.devices()[:1])
    ts = init_train_state(lambda r: build_model(LORA, rngs=r), functools.partial(make_optimizer, OPTIMIZER), layout)
    initial = make_model_fn(ts, layout, natural_logps, layout.sharding(("batch", "length")))
    wrong = [b | {"reference": np.roll(np.asarray(initial(ts.state, b)), 1, axis=0)} for b in batches]
    run = dpo_steps(LORA, ONE_DEVICE, wrong, reference="precomputed", devices=jax.devices()[:1])
    check_mutation_caught(run, ref, bound, "reference rows rolled by one")
