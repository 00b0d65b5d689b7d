"""``execution.loss_chunks``: the loss over pieces of the tokens, one piece's float32 logits alive at a
time (``train.loss.head_losses``).

* The same training as the whole loss: tiny (with a z-loss) and tiny-moe train 2 steps with 4 pieces,
  losses and every parameter's gradient within the one-device reference's noise bound
  (tests/invariance.py); and under a 1F1B pipeline, whose last stage computes the loss the same way.
* The pieces cover every token once: dropping one misses the bound of the function's own noise (the
  same sums over the tokens in another order) by ``MUTATION_GAP``× or more.
* What it is for: the compiled gradient's temporary memory with a 32k vocabulary falls by most of the
  logits' size.
* A count that does not divide the sequence is refused by name before any work.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from invariance import one_device, reference, train_steps
from noise import FLOOR, MULTIPLE, MUTATION_GAP, check_run, record

from jaxpar.errors import ConfigError
from jaxpar.execution import ExecutionConfig
from jaxpar.meshes import resolve_mesh_arg
from jaxpar.models import build_model, get_execution_preset, get_model_preset
from jaxpar.pipeline import build
from jaxpar.train.config import apply_overrides, default_config
from jaxpar.train.loss import head_losses, next_token_loss


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_chunked_loss_trains_as_the_whole_loss(preset):
    cfg = get_model_preset(preset)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 8, 33))
    execution = get_execution_preset(preset)
    want, bound = reference(cfg, tokens, "loss-chunks", execution=execution)
    got = one_device(cfg, tokens, execution=dataclasses.replace(execution, loss_chunks=4))
    check_run(got, want, bound, f"{preset} loss_chunks=4")


def test_pipeline_last_stage_chunks_its_loss():
    cfg = get_model_preset("tiny")
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 8, 33))
    want, bound = reference(cfg, tokens, "loss-chunks", grad_accum=2)
    execution = ExecutionConfig(loss_chunks=2)
    got = train_steps(
        cfg, resolve_mesh_arg("stage=2,data=4"), tokens, pipeline=build("1f1b", 2, 2), execution=execution
    )
    check_run(got, want, bound, "pipeline 1f1b loss_chunks=2")


def _losses(x, targets, w, chunks, z_loss=1e-2):
    return head_losses(lambda h: jnp.einsum("btd,dv->btv", h, w), x, targets, z_loss=z_loss, chunks=chunks)


def test_every_token_counts_once_and_a_dropped_piece_is_caught():
    rng = np.random.default_rng(2)
    x, w = jnp.asarray(rng.standard_normal((2, 64, 16)), jnp.float32), jnp.asarray(rng.standard_normal((16, 50)))
    targets = jnp.asarray(rng.integers(0, 50, (2, 64)), jnp.int32)
    whole = np.array(_losses(x, targets, w, 1))
    perm = rng.permutation(64)  # the same sums in another order: the function's own noise
    noise = float(np.max(np.abs(np.array(_losses(x[:, perm], targets[:, perm], w, 1)) - whole) / np.abs(whole)))
    tol = max(MULTIPLE * noise, FLOOR["loss"])
    got = float(np.max(np.abs(np.array(_losses(x, targets, w, 8)) - whole) / np.abs(whole)))
    record(
        "loss-chunks", "head_losses 8 pieces", noise=dict(loss=noise), tolerance=dict(loss=tol), error=dict(loss=got)
    )
    assert got <= tol, (got, tol)
    # the mutation: the last piece (tokens 7, 15, ...) left out, the mean still over every token
    kept = jnp.arange(64) % 8 != 7
    dropped = _losses(x[:, kept], targets[:, kept], w, 7)
    factor = float(np.max(np.abs(np.array(dropped) * 56 / 64 - whole) / np.abs(whole))) / tol
    record("loss-chunks", "mutation: a piece dropped", factor=factor)
    assert factor >= MUTATION_GAP, factor


def _temp_bytes(chunks: int, vocab: int = 32_000, batch: int = 4, seq: int = 256) -> int:
    cfg = dataclasses.replace(get_model_preset("tiny"), vocab_size=vocab)
    graphdef, state = nnx.split(build_model(cfg, execution=ExecutionConfig(loss_chunks=chunks), rngs=nnx.Rngs(0)))
    grad = jax.jit(jax.grad(lambda s, b: next_token_loss(nnx.merge(graphdef, s), b)[0]))
    batch = {k: jnp.zeros((batch, seq), jnp.int32) for k in ("inputs", "targets")}
    return grad.lower(state, batch).compile().memory_analysis().temp_size_in_bytes


def test_pieces_cut_the_logits_memory():
    """32k vocabulary, 4 × 256 tokens: float32 logits of 131 MB. In 8 pieces the gradient's temporary
    memory falls by more than half of that."""
    logits = 4 * 256 * 32_000 * 4
    whole, pieces = _temp_bytes(1), _temp_bytes(8)
    assert whole - pieces > logits / 2, (whole, pieces, logits)


def test_a_count_that_does_not_divide_the_sequence_is_refused():
    cfg = apply_overrides(default_config("tiny"), ["seq=30", "execution.loss_chunks=4"])
    with pytest.raises(ConfigError, match=r"execution\.loss_chunks=4 does not divide seq=30"):
        cfg.validate()
    with pytest.raises(ConfigError, match=r"execution\.loss_chunks=0 must be ≥ 1"):
        apply_overrides(default_config("tiny"), ["execution.loss_chunks=0"])
