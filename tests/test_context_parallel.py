"""Context parallelism in the model: the tiny model trains with the losses and every parameter's
gradients of 1 device with its sequence split (ring, Ulysses, GSPMD all-gather), the compiled ring moves
exactly the K/V the formula says, and layouts a strategy cannot run are refused before compiling.

The kernels themselves are checked against the dense oracle in tests/test_ring.py and test_ulysses.py;
MLA (tiny-deepseek) under ring and Ulysses in tests/test_moe_models.py.
"""

import jax
import numpy as np
import pytest
from flax import nnx
from invariance import reference as noisy_reference
from invariance import train_steps
from noise import check_mutation_caught, check_run

from jaxpar.analysis import analyze_compiled
from jaxpar.errors import ConfigError
from jaxpar.execution import ExecutionConfig
from jaxpar.layout import make_layout
from jaxpar.meshes import get_mesh_preset, resolve_mesh_arg
from jaxpar.models import build_model, get_model_preset
from jaxpar.rules import LayoutError

B, T, STEPS = 8, 32, 3
TOKENS = np.random.default_rng(0).integers(0, 256, (STEPS, B, T + 1), dtype=np.int32)


@pytest.fixture(scope="module")
def reference():
    """(the one-device run, its measured noise bound: tests/noise.py)."""
    return noisy_reference(get_model_preset("tiny"), TOKENS, "context")


@pytest.mark.parametrize(
    "strategy, order, mesh",
    [
        ("ring", "zigzag", "sequence=4,tensor=2"),
        ("ring", "zigzag", "data=2,sequence=2,tensor=2"),
        ("ring", "contiguous", "cp"),
        ("ring", "zigzag", "fsdp_cp"),
        ("ulysses", "zigzag", "data=2,fsdp=2,sequence=2"),
        ("none", "zigzag", "tp_cp"),
    ],
)
def test_same_losses_and_gradients_as_one_device(reference, strategy, order, mesh):
    """3 steps: the losses and, at every step, each parameter's gradient within the measured noise bound."""
    ref, bound = reference
    execution = ExecutionConfig(context_parallel=strategy, cp_order=order)
    run = train_steps(get_model_preset("tiny"), resolve_mesh_arg(mesh), TOKENS, execution=execution)
    check_run(run, ref, bound, f"{strategy} {order} {mesh}")
    assert abs(ref.losses[0] - ref.losses[-1]) > 1e-3  # the steps really change the model


def test_a_wrong_token_permutation_is_caught(reference):
    """Ring attention over zig-zag shards fed each sequence with two of its 8 chunks swapped: tokens attend
    in the wrong causal order, as they would under a wrong storage permutation."""
    ref, bound = reference
    chunk = T // 8  # sequence=4: 8 zig-zag chunks
    order = np.arange(T).reshape(8, chunk)[[0, 2, 1, 3, 4, 5, 6, 7]].ravel()
    mutant = np.concatenate([TOKENS[:, :, :-1][:, :, order], TOKENS[:, :, -1:]], axis=2)
    ring = ExecutionConfig(context_parallel="ring", cp_order="zigzag")
    got = train_steps(get_model_preset("tiny"), resolve_mesh_arg("sequence=4,tensor=2"), mutant, execution=ring)
    check_mutation_caught(got, ref, bound, "ring zigzag sequence=4: two chunks swapped")


def test_logits_come_back_in_natural_order():
    """Under zig-zag the model stores tokens permuted; ``model(ids)`` still returns natural order."""
    cfg, ring = get_model_preset("tiny"), ExecutionConfig(context_parallel="ring")
    ids = TOKENS[0, :, :-1]
    want = np.asarray(build_model(get_model_preset("tiny"), rngs=nnx.Rngs(0))(ids))
    layout = make_layout(cfg, get_mesh_preset("cp"), batch=B, seq=T, execution=ring)
    with layout.activate():
        model = build_model(cfg, execution=ring, rngs=nnx.Rngs(0))
        got = np.asarray(nnx.jit(lambda m, x: m(x))(model, ids))
        order = model.forward(ids).order
    assert order is not None and not np.array_equal(order, np.arange(T))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_ring_moves_exactly_the_kv_blocks():
    """Forward program under ``cp`` (sequence=8): collective-permute bytes per layer are
    (n−1)/n · 2·B·L·K·H·bytes (K and V) plus the int32 token indices that travel with them, within
    10% of the K/V term alone; and no device ever gathers a full-length K or V. (The one all-gather
    left is of the int32 ids [B, T], for the zig-zag permutation on entry.)"""
    cfg, ring = get_model_preset("tiny"), ExecutionConfig(context_parallel="ring")
    n, seq = 8, 128
    layout = make_layout(cfg, get_mesh_preset("cp"), batch=B, seq=seq, execution=ring)
    with layout.activate():
        model = build_model(cfg, execution=ring, rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(model)
        forward = jax.jit(lambda s, x: nnx.merge(graphdef, s).forward(x).logits)
        ids = jax.ShapeDtypeStruct((B, seq), np.int32, sharding=layout.sharding(("batch", "length")))
        report = analyze_compiled(forward.lower(state, ids).compile(), mesh=layout.mesh)
    kv = (n - 1) / n * 2 * B * seq * cfg.num_kv_heads * cfg.head_dim * 4 * cfg.num_layers
    permuted = report.collectives.bytes("collective-permute", axes=("sequence",))
    assert kv <= permuted <= 1.1 * kv, (permuted, kv)
    full_kv = [
        c
        for c in report.ops
        if c.kind == "all-gather"  # [B, T, K, H] with the full T
        and any(len(shape) == 4 and seq in shape for shape in c.shapes)
    ]
    assert not full_kv, full_kv


@pytest.mark.parametrize(
    "strategy, heads, mesh, seq, error, message",
    [
        ("ring", 8, "cp", 40, LayoutError, "seq=40 is not divisible by 2 × sequence=8 = 16"),
        ("ulysses", 8, "sequence=4,tensor=2", 32, LayoutError, "num_kv_heads (1 on this device) divisible by 4"),
        ("ulysses", 6, "data=2,sequence=4", 32, LayoutError, "num_heads (6 on this device) divisible by 4"),
        ("spiral", 8, "cp", 32, ConfigError, "execution.context_parallel='spiral'"),  # refused by the config itself
    ],
)
def test_layouts_a_strategy_cannot_run_are_refused(strategy, heads, mesh, seq, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        cfg = get_model_preset("tiny", num_heads=heads)
        make_layout(cfg, resolve_mesh_arg(mesh), batch=B, seq=seq, execution=ExecutionConfig(context_parallel=strategy))
