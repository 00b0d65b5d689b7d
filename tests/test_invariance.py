"""Layout invariance: the same 3 training steps give the same losses and gradients on 1 device and on
8 devices under every mesh preset without a sequence axis, with the tokens per step fixed.

Tolerances: losses rtol 1e-5; each parameter's gradient within 1e-5 of that parameter's largest
gradient entry (max |a - b| <= 1e-5 · max |b|), at every step (tests/invariance.py says why AdamW
runs with eps=1e-3 here). And one bf16 case, with the tolerance its docstring derives.
"""

import math

import numpy as np
import pytest
from invariance import assert_same_gradients, one_device, train_steps

from jaxpar.meshes import PRESETS
from jaxpar.models import ExecutionConfig, get_model_preset

BATCH, SEQ, STEPS = 8, 16, 3
CFG = get_model_preset("tiny")
TOKENS = np.random.default_rng(0).integers(0, CFG.vocab_size, (STEPS, BATCH, SEQ + 1), dtype=np.int32)


@pytest.fixture(scope="module")
def reference():
    return one_device(CFG, TOKENS)


# The presets with a ``sequence`` axis: tests/test_context_parallel.py.
@pytest.mark.parametrize("name", [n for n, p in PRESETS.items() if p.mesh.sequence == 1 and p.mesh.stage == 1])
def test_same_losses_and_gradients_on_8_devices(name, reference):
    run = train_steps(CFG, PRESETS[name], TOKENS)
    np.testing.assert_allclose(run.losses, reference.losses, rtol=1e-5)
    assert_same_gradients(run.grads, reference.grads, name)


# bf16 compute: the tolerance ``test_bf16_compute_under_3d_matches_one_device`` derives.
U = 2.0**-8  # bf16's unit roundoff: 8 significant bits, round to nearest
DEPTH_FORWARD = 40  # bf16 roundings on the longest forward chain of tiny
DEPTH_BACKWARD = 2 * DEPTH_FORWARD  # the backward pass runs the chain again, in reverse
BF16_GRAD_RTOL = 4 * U * math.sqrt(2 * DEPTH_BACKWARD / 3)  # 0.114
BF16_LOSS_RTOL = 2 * 4 * U * math.sqrt(2 * DEPTH_FORWARD / 3) / math.sqrt(BATCH * SEQ)  # 0.0143


def test_bf16_compute_under_3d_matches_one_device():
    """tiny with ``execution.dtype="bfloat16"`` (compute in bf16; parameters, optimizer state and the loss stay
    fp32) trains 3 steps under ``3d`` (data=2, fsdp=2, tensor=2) with the losses and gradients of bf16 on
    one device, within a tolerance derived from bf16's unit roundoff u = 2^-8 and the depth:

    - Depth: per block, 14 roundings in sequence (RMSNorm out, q/k/v projection, RoPE, scores, softmax,
      attention·v, output projection, residual add, RMSNorm out, gate_up, silu, ·up, down, residual add)
      plus 4 weight casts that enter those products (q/k/v, o, gate_up, down): 18; two blocks, the
      embedding cast, final norm and LM head (output and weight cast): d_f = 40. The backward pass
      runs the chain again: d_b = 80.
    - Each rounding multiplies a value by (1 + δ), δ uniform in [−u, u] (standard deviation u/√3),
      independent between roundings (round to nearest on values whose low bits are noise). Every block
      feeds an RMS-normalised input to its matmuls and only adds to the residual stream, so a relative
      error passes on with gain ~1 and d of them add as a random walk: standard deviation u·√(d/3) per
      run. The two runs round the same values wherever their inputs agree, so they differ by at most
      what two independent runs do: σ = u·√(2d/3).
    - Gradients: 4σ at d_b, max |a − b| ≤ 4·u·√(2·80/3) · max |b| = 0.114 · max |b| per parameter and
      step. (The worst-case first-order bound, 2·d_b·u = 0.63, guards nothing.)
    - Loss: the mean of B·T = 128 token losses with independent errors; a token's loss moves by
      Σ (p − y)·Δlogit with Σ |p − y| ≤ 2, and the logits are smaller than the loss (max |z| = 0.78
      at init against L ≈ 5.58), so rtol 2 · 4·u·√(2·40/3) / √128 = 0.0143.

    Measured: gradients 0.0117 · max |b| at worst at the first step (identical parameters), 0.0232
    by the third (about 6u; bf16 against fp32 on one device differs by 0.0217, the same size); losses
    5.6e-5 relative at worst. The last check makes sure the case really ran in bf16: in fp32 the gradients
    agree to ~1e-6."""
    cfg, bf16 = get_model_preset("tiny"), ExecutionConfig(dtype="bfloat16")
    ref, run = one_device(cfg, TOKENS, execution=bf16), train_steps(cfg, PRESETS["3d"], TOKENS, execution=bf16)
    np.testing.assert_allclose(run.losses, ref.losses, rtol=BF16_LOSS_RTOL)
    worst = assert_same_gradients(run.grads, ref.grads, "bf16 3d", rtol=BF16_GRAD_RTOL)
    assert worst > 1e-3, worst


def test_reference_really_trains(reference):
    """Guards against a vacuous comparison: the optimizer moves the loss and gradients are non-zero."""
    assert abs(reference.losses[1] - reference.losses[0]) > 1e-3
    assert all(np.max(np.abs(g)) > 0 for g in reference.grads[0].values())
