"""Pallas splash attention (``jaxpar.parallel.flash``, ``execution.attention_impl=splash``) in Pallas'
interpret mode on CPU: the TPU kernel's own body, checked against the independent oracle
(tests/attention_oracle.py) on the output and the gradients of q, k and v.

Cases: causal, a sliding window, GQA 8:2, packed documents whose boundaries straddle the 128-token
block edges, MLA's unequal q/k and v widths, and a length that is not a multiple of the block (the
kernel pads it). float32: within ``MULTIPLE`` × the oracle's own noise (its keys summed in another
order, ``attention_oracle.own_noise``). bfloat16: within ``BF16_MULTIPLE`` × the noise of another valid
bfloat16 computation (XLA's attention on the same bfloat16 inputs) against the float32 oracle. A kernel
that drops the segments misses each bound by ``MUTATION_GAP``× or more.

Then the model: tiny (GQA), tiny with a sliding window and tiny-deepseek (MLA) train the same steps
with splash as with their default attention, losses and every parameter's gradient within the reference's noise bound
(tests/invariance.py); and a GPU refuses the kernel by name before any work.
"""

from __future__ import annotations

import dataclasses
import re

import attention_oracle as oracle
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from invariance import one_device, reference, train_steps
from noise import FLOOR, MULTIPLE, MUTATION_GAP, array_ratios, check_arrays, check_run, record

from jaxpar.errors import ConfigError
from jaxpar.execution import ExecutionConfig
from jaxpar.layout import make_layout
from jaxpar.meshes import resolve_mesh_arg
from jaxpar.models import get_execution_preset, get_model_preset
from jaxpar.parallel.flash import block_size, check_kernel, splash_attention

BF16_MULTIPLE = 6  # bfloat16: the output's one rounding dominates both ways, so a small multiple suffices
CASES = {  # heads, kv heads, q/k width, v width, length, window, document starts
    "causal": (4, 4, 32, 32, 256, None, ()),
    "window": (4, 4, 32, 32, 256, 40, ()),
    "gqa-8-2": (8, 2, 16, 16, 256, None, ()),
    "segments-straddle-blocks": (4, 2, 16, 16, 256, None, (100, 130, 200)),
    "mla-dims": (4, 4, 24, 16, 256, None, ()),
    "length-not-a-block": (4, 2, 16, 16, 200, 24, (90,)),
}


def _inputs(case: str, dtype=np.float32, seed: int = 0):
    n, kv, hq, hv, length, window, starts = CASES[case]
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, length, n, hq))
    k = rng.standard_normal((2, length, kv, hq))
    v = rng.standard_normal((2, length, kv, hv))
    ct = rng.standard_normal((2, length, n, hv))
    q, k, v, ct = (jnp.asarray(a, dtype) for a in (q, k, v, ct))
    segments = np.zeros((2, length), np.int32)
    for s in starts:
        segments[:, s:] += 1
    index = np.tile(np.arange(length), (2, 1))
    allowed = oracle.mask(index, index, segments, segments, causal=True, window=window)
    return q, k, v, ct, segments, allowed, window


def _splash(q, k, v, ct, segments, window, **kw):
    """(out, dq, dk, dv) of the kernel for the loss sum(out · ct)."""
    out, vjp = jax.vjp(lambda q, k, v: splash_attention(q, k, v, window=window, segments=segments, **kw), q, k, v)
    return (out, *vjp(ct))


_splash_jit = jax.jit(_splash, static_argnames=("window",))


def _f32(arrays):
    return [np.asarray(a, np.float32) for a in arrays]


def test_block_rule():
    assert [block_size(n) for n in (128, 256, 384, 512, 1024, 8192, 640)] == [128, 256, 128, 512, 512, 512, 128]


@pytest.mark.parametrize("case", list(CASES))
def test_splash_matches_the_oracle(case):
    q, k, v, ct, segments, allowed, window = _inputs(case)
    got = _splash_jit(q, k, v, ct, jnp.asarray(segments), window)
    want = oracle.value_and_grads(q, k, v, ct, allowed)
    check_arrays(got, want, oracle.own_noise(q, k, v, ct, allowed), "flash", case)


def _bf16_bound(case: str):
    """The bfloat16 inputs, the f32 oracle on them, and the bound: BF16_MULTIPLE × the distance of XLA's
    bfloat16 attention (with the same mask) from that oracle."""
    q, k, v, ct, segments, allowed, window = _inputs(case, jnp.bfloat16)
    want = oracle.value_and_grads(*(a.astype(jnp.float32) for a in (q, k, v, ct)), allowed)
    xla = jax.vjp(
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=jnp.asarray(allowed)[:, None], implementation="xla"),
        q,
        k,
        v,
    )
    other = (xla[0], *xla[1](ct))
    noise = max(array_ratios(_f32(other), want, ("out", "dq", "dk", "dv")).values())
    return (q, k, v, ct, segments, window), want, max(BF16_MULTIPLE * noise, FLOOR["grad"]), noise


def test_splash_bf16_within_bf16_noise_and_a_dropped_mask_is_caught():
    inputs, want, tol, noise = _bf16_bound("segments-straddle-blocks")
    q, k, v, ct, segments, window = inputs
    got = _splash_jit(q, k, v, ct, jnp.asarray(segments), window)
    worst = max(array_ratios(_f32(got), want, ("out", "dq", "dk", "dv")).values())
    record("flash", "bf16", noise=dict(array=noise), tolerance=dict(array=tol), error=dict(array=worst))
    assert worst <= tol, f"bf16: error {worst:.3g} > {tol:.3g} (noise {noise:.3g})"
    dropped = _splash_jit(q, k, v, ct, None, window)  # the mutation: the documents' boundaries ignored
    factor = max(array_ratios(_f32(dropped), want, ("out", "dq", "dk", "dv")).values()) / tol
    record("flash", "mutation: bf16 segments dropped", factor=factor)
    assert factor >= MUTATION_GAP, factor


def test_a_dropped_mask_misses_the_f32_bound():
    q, k, v, ct, segments, allowed, window = _inputs("segments-straddle-blocks")
    tol = max(MULTIPLE * oracle.own_noise(q, k, v, ct, allowed), FLOOR["grad"])
    dropped = _splash_jit(q, k, v, ct, None, window)
    factor = max(array_ratios(dropped, oracle.value_and_grads(q, k, v, ct, allowed), ("o", "q", "k", "v")).values())
    record("flash", "mutation: segments dropped", factor=factor / tol)
    assert factor / tol >= MUTATION_GAP, factor / tol


# ------------------------------------------------------------------------------------------ the model
@pytest.mark.parametrize("preset,window", [("tiny", None), ("tiny", 8), ("tiny-deepseek", None)])
def test_model_trains_as_with_xla_attention(preset, window):
    """GQA (tiny), a window, and MLA with its MoE (tiny-deepseek, whose reference is MLA's own explicit
    softmax): splash trains the same steps."""
    cfg = dataclasses.replace(get_model_preset(preset), sliding_window=window)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 8, 33))
    execution = get_execution_preset(preset)
    want, bound = reference(cfg, tokens, "flash", execution=execution)
    got = one_device(cfg, tokens, execution=dataclasses.replace(execution, attention_impl="splash"))
    check_run(got, want, bound, f"{preset} window={window}")


def test_ulysses_runs_splash_on_its_gathered_heads():
    """tiny with its sequence split over 2 devices (and data, fsdp over 2 each), Ulysses running splash
    on the gathered heads: the one-device run's losses and gradients, within its noise bound. (The
    model stores a sequence in its natural order under Ulysses; zig-zag storage is checked on the
    kernel in tests/test_ulysses.py.)"""
    cfg = get_model_preset("tiny")
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 8, 33))
    want, bound = reference(cfg, tokens, "flash")
    execution = ExecutionConfig(attention_impl="splash", context_parallel="ulysses")
    got = train_steps(cfg, resolve_mesh_arg("data=2,fsdp=2,sequence=2"), tokens, execution=execution)
    check_run(got, want, bound, "ulysses splash")


def test_ring_refuses_splash_by_name():
    cfg = get_model_preset("tiny")
    execution = ExecutionConfig(attention_impl="splash", context_parallel="ring")
    with pytest.raises(ConfigError, match=r"attention_impl=splash with execution\.context_parallel=ring"):
        make_layout(
            cfg, resolve_mesh_arg("sequence=2"), batch=2, seq=32, devices=jax.devices()[:2], execution=execution
        )


def test_gpu_refuses_the_tpu_kernel_by_name():
    with pytest.raises(
        ConfigError, match=r"execution\.attention_impl=splash: a TPU kernel .* use execution\.attention_impl=cudnn"
    ):
        check_kernel("splash", "gpu")
    (
        check_kernel("splash", "tpu"),
        check_kernel("splash", "cpu"),
        check_kernel("cudnn", "gpu"),
        check_kernel(None, "gpu"),
    )


@pytest.mark.parametrize(
    "hardware,kernel,message",
    [("h100", "splash", "a TPU kernel"), ("tpu-v6e", "cudnn", "cuDNN runs on NVIDIA GPUs")],
)
def test_plan_refuses_a_kernel_the_chip_cannot_run(hardware, kernel, message, capsys):
    from jaxpar.cli import main

    argv = ["plan", "--model", "tiny", "--mesh", "fsdp", "--batch", "8", "--seq", "64", "--hardware", hardware]
    assert main([*argv, "--set", f"execution.attention_impl={kernel}"]) == 2
    assert f"execution.attention_impl={kernel}: {message}" in capsys.readouterr().err


def _tpu_program(attention_impl, length: int = 512) -> str:
    """The StableHLO of tiny's loss gradient in bfloat16, lowered for a TPU on this host
    (``jax.export``; the kernels inside ``lowered_for_tpu`` lower through Mosaic, not interpreted)."""
    from flax import nnx
    from jax import export

    from jaxpar.models import build_model
    from jaxpar.parallel.flash import lowered_for_tpu

    cfg = dataclasses.replace(get_model_preset("tiny"), max_seq_len=length)
    execution = ExecutionConfig(attention_impl=attention_impl, dtype="bfloat16")
    graphdef, state = nnx.split(build_model(cfg, execution=execution, rngs=nnx.Rngs(0)))
    grad = jax.jit(jax.grad(lambda state, ids: nnx.merge(graphdef, state)(ids).astype(jnp.float32).mean()))
    with lowered_for_tpu():
        exported = export.export(grad, platforms=["tpu"])(state, jax.ShapeDtypeStruct((2, length), jnp.int32))
    return exported.mlir_module()


def _score_tensors(program: str, length: int = 512) -> set[str]:
    """The tensor types of ``program`` whose last two dimensions are (length, length): attention scores."""
    found = re.findall(r"tensor<([0-9x]+)x(?:bf16|f32)>", program)
    return {s for s in found if s.split("x")[-2:] == [str(length)] * 2}


def test_tpu_program_runs_the_kernel_and_holds_no_scores():
    """The cost claim, on the program a TPU would run: splash's Mosaic calls and no [T, T] tensor; XLA's
    attention (the contrast that shows the check can fail) holds the scores."""
    splash = _tpu_program("splash")
    assert splash.count("tpu_custom_call") >= 3 and not _score_tensors(splash)  # forward, dq, dk/dv
    xla = _tpu_program(None)
    assert "tpu_custom_call" not in xla and _score_tensors(xla)


def test_pipeline_stage_runs_splash():
    """A 1F1B pipeline over 2 stages (and data over 4), each stage's attention on splash: the one-device
    run with the same 2 gradient-accumulation slices, within its noise bound."""
    from jaxpar.pipeline import build

    cfg = get_model_preset("tiny")
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 8, 33))
    want, bound = reference(cfg, tokens, "flash", grad_accum=2)
    execution = ExecutionConfig(attention_impl="splash")
    got = train_steps(
        cfg, resolve_mesh_arg("stage=2,data=4"), tokens, pipeline=build("1f1b", 2, 2), execution=execution
    )
    check_run(got, want, bound, "pipeline 1f1b splash")
