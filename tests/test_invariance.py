"""Layout invariance: the same 3 training steps give the same losses and gradients on 1 device and on
8 devices under every mesh preset without a sequence axis, with the tokens per step fixed.

Tolerances (tests/noise.py): a multiple of the one-device reference's own noise, measured here by
running it a second time with the batch rows in another order (tests/invariance.py says why AdamW
runs with eps=1e-3 here). And one bf16 case, whose noise is measured the same way in bf16. A mutation
(one device's batch shard seen twice, another's never: a missing all-reduce term) must miss the bound
by a wide margin.
"""

import numpy as np
import pytest
from invariance import reference, replace_rows, train_steps
from noise import check_mutation_caught, check_run

from jaxpar.meshes import PRESETS
from jaxpar.models import ExecutionConfig, get_model_preset

BATCH, SEQ, STEPS = 8, 16, 3
CFG = get_model_preset("tiny")
TOKENS = np.random.default_rng(0).integers(0, CFG.vocab_size, (STEPS, BATCH, SEQ + 1), dtype=np.int32)


@pytest.fixture(scope="module")
def fp32():
    """(the one-device run, its noise bound)."""
    return reference(CFG, TOKENS, "invariance")


# The presets with a ``sequence`` axis: tests/test_context_parallel.py.
@pytest.mark.parametrize("name", [n for n, p in PRESETS.items() if p.mesh.sequence == 1 and p.mesh.stage == 1])
def test_same_losses_and_gradients_on_8_devices(name, fp32):
    ref, bound = fp32
    check_run(train_steps(CFG, PRESETS[name], TOKENS), ref, bound, name)


def test_a_missing_all_reduce_term_is_caught(fp32):
    """Under ``dp`` (data=8, one row per device), device 0's gradient term replaced by device 1's."""
    ref, bound = fp32
    check_mutation_caught(
        train_steps(CFG, PRESETS["dp"], replace_rows(TOKENS, [0], [1])), ref, bound, "dp: row 0 as row 1"
    )


# bf16: measured, the layout's error reached 1.2× the reference's own rounding error in the gradients and
# 2.5× in the loss (bf16 rounds every activation, and a layout's split contractions round other partial
# sums): a multiple of 15 keeps the bound 5× above that, and a real bug still misses it by 5×.
BF16_MULTIPLE, BF16_GAP = 15, 5


def test_bf16_compute_under_3d_matches_one_device():
    """tiny with ``execution.dtype="bfloat16"`` (compute in bf16; parameters, optimizer state and the loss stay
    fp32) trains 3 steps under ``3d`` (data=2, fsdp=2, tensor=2) with the losses and gradients of bf16 on
    one device, within BF16_MULTIPLE × the bf16 reference's own rounding error: its distance from the same
    run computed in fp32. (Rows in another order measure almost nothing here: bf16's error is the rounding
    of every activation, the same in any row order, while a layout splits the contractions, whose partial
    sums round to bf16 before they are added.) The noise check makes sure the case really ran in bf16:
    in fp32 it is ~1e-6. A missing all-reduce term (one of the 4 batch shards seen twice) must still miss the bound."""
    bf16 = ExecutionConfig(dtype="bfloat16")
    ref, bound = reference(CFG, TOKENS, "bf16", execution=bf16, multiple=BF16_MULTIPLE, exact=ExecutionConfig())
    check_run(train_steps(CFG, PRESETS["3d"], TOKENS, execution=bf16), ref, bound, "bf16 3d")
    assert bound.noise.grad > 1e-3, bound.noise
    mutant = train_steps(CFG, PRESETS["3d"], replace_rows(TOKENS, [0, 1], [2, 3]), execution=bf16)
    check_mutation_caught(mutant, ref, bound, "bf16 3d: shard 0 as shard 1", gap=BF16_GAP)


def test_reference_really_trains(fp32):
    """Guards against a vacuous comparison: the optimizer moves the loss and gradients are non-zero."""
    reference, _ = fp32
    assert abs(reference.losses[1] - reference.losses[0]) > 1e-3
    assert all(np.max(np.abs(g)) > 0 for g in reference.grads[0].values())
