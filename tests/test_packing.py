"""Packed documents on every attention path: a packed row's loss and every parameter's gradient equal the
token-weighted sum over each of its documents run alone, on one device and under the parallel layouts
(pipelines included), for dense, MoE and MLA models; and no document sees another: changing one
document's tokens leaves the other documents' logits bit for bit the same.

The oracle shares no code with the packed path: each document goes through the model alone, in a row of
its own from position 0 (natural positions, no segments, no mask; the untrained padding after it is never
read by causal attention), and its cross-entropy is summed here, over the targets that train, and divided
by the batch's count of them. Its own float noise is the larger distance to two other valid ways: the
documents in longer rows (the shapes differ, so every contraction rounds differently) and in the other
row order (the sums over the batch add in another order); every bound is a multiple of that noise
(tests/noise.py).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from invariance import OPTIMIZER, Run, flat
from noise import Bound, Noise, check_mutation_caught, check_run, measure

from jaxpar.execution import ExecutionConfig
from jaxpar.layout import make_layout
from jaxpar.meshes import resolve_mesh_arg
from jaxpar.models import build_model, get_model_preset
from jaxpar.pipeline import build
from jaxpar.pipeline.executor import check_stack
from jaxpar.train.optim import make_optimizer
from jaxpar.train.step import init_train_state, make_grad_fn

B, T = 8, 32  # rows, tokens per row (a row holds T + 1 tokens: inputs and the targets shifted by one)
PAD_TAIL = 5  # the oracle's second way: each document in a row this much longer
DROPLESS = dict(capacity_factor=None, aux_loss_weight=0.0, router_z_loss_weight=0.0)  # routing per token


def _documents(seed: int = 0):
    """Per row: documents (token arrays) that fill it partly, and per document which targets train."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(B):
        docs, room = [], T + 1
        while room >= 3 and (len(docs) < 2 or rng.random() < 0.6):
            n = int(rng.integers(2, min(room, 14) + 1))
            tokens = rng.integers(1, 256, n).astype(np.int32)
            trained = (rng.random(n - 1) < 0.7).astype(np.float32)  # a chat-like mask on the targets
            docs.append((tokens, trained))
            room -= n
        rows.append(docs)
    return rows


def pack(rows) -> dict[str, np.ndarray]:
    """The batch of packed rows: documents back to back, the rest a padding document of token 0."""
    out = {k: np.zeros((B, T + 1), np.int32) for k in ("tokens", "positions", "segments")}
    trained = np.zeros((B, T + 1), np.float32)  # entry t: does token t train (as a target)?
    for r, docs in enumerate(rows):
        at = 0
        for s, (tokens, mask) in enumerate(docs):
            n = len(tokens)
            out["tokens"][r, at : at + n] = tokens
            out["positions"][r, at : at + n] = np.arange(n)
            out["segments"][r, at : at + n] = s
            trained[r, at + 1 : at + n] = mask
            at += n
        out["positions"][r, at:] = np.arange(T + 1 - at)
        out["segments"][r, at:] = len(docs)
    return {
        "inputs": out["tokens"][:, :-1],
        "targets": out["tokens"][:, 1:],
        "positions": out["positions"][:, :-1],
        "segments": out["segments"][:, :-1],
        "mask": trained[:, 1:],
    }


def oracle(model, rows, length: int = T, reverse: bool = False) -> tuple[float, dict]:
    """(loss, gradients) of the documents each alone in a row of ``length`` inputs (from position 0,
    untrained padding after it, which causal attention never reads): Σ trained cross-entropy ÷ their
    count; ``reverse``: the documents' rows in the other order."""
    docs = [d for docs in rows for d in docs][:: -1 if reverse else 1]
    ids, trained = np.zeros((len(docs), length + 1), np.int32), np.zeros((len(docs), length), np.float32)
    for i, (tokens, mask) in enumerate(docs):
        ids[i, : len(tokens)], trained[i, : len(mask)] = tokens, mask
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def loss(params, rest):
        logp = jax.nn.log_softmax(nnx.merge(graphdef, params, rest)(ids[:, :-1]), axis=-1)
        picked = jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
        return -jnp.sum(picked * trained) / trained.sum()

    value, grads = jax.value_and_grad(loss)(params, rest)
    return float(value), flat(grads)


def _run(loss, grads) -> Run:
    return Run([loss], [grads], [], None, {})


ROWS = _documents()
BATCH = pack(ROWS)
WINDOW = 6  # tiny with a sliding window shorter than most documents


def _cfg(model: str):
    return get_model_preset("tiny", sliding_window=WINDOW) if model == "tiny-window" else get_model_preset(model)


@functools.cache
def reference(model: str, execution: ExecutionConfig) -> tuple[Run, Bound]:
    """The oracle on the model as every layout initialises it (seed 0), and the bound its noise sets."""
    net = build_model(_cfg(model), execution=execution, rngs=nnx.Rngs(params=0))
    run = _run(*oracle(net, ROWS))
    ways = [measure(run, _run(*oracle(net, ROWS, **kw))) for kw in (dict(length=T + PAD_TAIL), dict(reverse=True))]
    return run, Bound("packing", Noise(max(w.grad for w in ways), max(w.loss for w in ways)))


def packed(model: str, mesh: str, execution: ExecutionConfig, batch=BATCH, grad_accum: int = 1, pipeline=None):
    """(the train step's loss and gradients of ``batch`` under ``mesh`` in ``grad_accum`` slices, or by
    ``pipeline`` = (schedule, microbatches, grad_reduce), a function giving the logits of a packed batch
    there)."""
    cfg = _cfg(model)
    preset = resolve_mesh_arg("data=1" if mesh == "one device" else mesh)
    devices = jax.devices()[: int(np.prod(dataclasses.astuple(preset.mesh)[:6]))]
    table = split = None
    if pipeline is not None:
        schedule, m, grad_reduce = pipeline
        table = build(schedule, preset.mesh.stage, m)
        split = check_stack(cfg, table.stages, table.virtual_stages, None, None, None)
    dims = None if split is None else split.layout_dims()
    layout = make_layout(cfg, preset, batch=B, seq=T, devices=devices, execution=execution, extra_dims=dims)
    make = lambda r: build_model(cfg, execution=execution, rngs=r)
    ts = init_train_state(make, functools.partial(make_optimizer, OPTIMIZER), layout, stack=split)
    run = dict(grad_accum=grad_accum) if table is None else dict(pipeline=table, grad_reduce=grad_reduce)
    loss, grads = make_grad_fn(ts, layout, **run)(ts.state, batch)

    @jax.jit
    def logits(state, batch):
        with layout.activate_trace():
            net, _ = nnx.merge(ts.graphdef, state)
            return net(batch["inputs"], batch["positions"], batch["segments"])

    return _run(float(loss), flat(grads)), functools.partial(logits, ts.state)


CASES = [  # (model, mesh, execution settings)
    ("tiny", "one device", {}),
    ("tiny", "fsdp=8", {}),
    ("tiny", "data=2,tensor=4", {}),
    ("tiny", "data=4,sequence=2", dict(context_parallel="ring", cp_order="zigzag")),
    ("tiny", "data=2,sequence=4", dict(context_parallel="ring", cp_order="zigzag")),
    ("tiny", "data=2,sequence=4", dict(context_parallel="ring", cp_order="contiguous")),
    ("tiny", "data=4,sequence=2", dict(context_parallel="ulysses")),
    ("tiny", "data=2,sequence=4", {}),  # GSPMD gathers the sequence for XLA's attention
    ("tiny", "one device", dict(attention_impl="splash")),
    ("tiny-window", "data=4,sequence=2", dict(context_parallel="ring", cp_order="zigzag")),
    ("tiny-moe", "one device", DROPLESS),
    ("tiny-moe", "data=2,expert=4", DROPLESS),
    ("tiny-deepseek", "one device", DROPLESS),
    ("tiny-deepseek", "data=4,sequence=2", DROPLESS | dict(context_parallel="ring", cp_order="zigzag")),
]


@pytest.mark.parametrize("model, mesh, settings", CASES, ids=[f"{m} {s} {x}" for m, s, x in CASES])
def test_packed_rows_train_as_their_documents_alone(model, mesh, settings):
    execution = ExecutionConfig(**settings)
    ref, bound = reference(model, dataclasses.replace(execution, context_parallel="none"))
    run, logits = packed(model, mesh, execution)
    check_run(run, ref, bound, f"{model} {mesh} {settings}")
    # no leakage: every row's first document changed, the other documents' logits bit for bit the same
    other = dict(BATCH)
    first = BATCH["segments"] == 0
    other["inputs"] = np.where(first, BATCH["inputs"] % 255 + 1, BATCH["inputs"]).astype(np.int32)
    a, b = np.asarray(logits(BATCH)), np.asarray(logits(other))
    assert not np.array_equal(a[first], b[first])  # the change reached the first documents
    assert np.array_equal(a[~first], b[~first])


def test_accumulated_slices_divide_by_the_whole_batchs_count():
    """4 slices of 2 rows whose trained-token counts differ: the gradient of the whole batch's
    Σ cross-entropy ÷ count, not a mean of the slices' means."""
    counts = [BATCH["mask"][i::4].sum() for i in range(4)]  # slice i: rows i, i + 4 (step._split_slices)
    assert len(set(counts)) > 1, counts
    ref, bound = reference("tiny", ExecutionConfig())
    check_run(packed("tiny", "fsdp=8", ExecutionConfig(), grad_accum=4)[0], ref, bound, "tiny fsdp=8 4 slices")


@pytest.mark.parametrize("mutation", ["segments", "mask"])
def test_a_packing_bug_is_caught(mutation):
    """The bound still catches a real bug: documents that see each other (no segments), or every target
    trained (no mask). (Positions that run on across documents are no bug under RoPE: with the segments,
    attention sees only distances within a document.)"""
    batch = {k: v for k, v in BATCH.items() if k != mutation}
    ref, bound = reference("tiny", ExecutionConfig())
    check_mutation_caught(packed("tiny", "one device", ExecutionConfig(), batch)[0], ref, bound, f"{mutation} dropped")


PIPELINES = [  # (mesh, execution settings, (schedule, microbatches, grad_reduce))
    ("stage=2,data=2,tensor=2", {}, ("1f1b", 4, "slice")),
    ("stage=2,data=2,tensor=2", {}, ("1f1b", 4, "step")),  # each stage its own action
    ("stage=2,data=2", {}, ("zero_bubble", 4, "step")),  # W from the cut pullback
    ("stage=2,data=2,sequence=2", dict(context_parallel="ring", cp_order="zigzag"), ("gpipe", 4, "slice")),
]


@pytest.mark.parametrize("mesh, settings, pipeline", PIPELINES, ids=[f"{m} {x} {p}" for m, x, p in PIPELINES])
def test_packed_microbatches_train_as_their_documents_alone(mesh, settings, pipeline):
    """Each pipeline microbatch carries its rows' positions, segments and token weights."""
    execution = ExecutionConfig(**settings)
    ref, bound = reference("tiny", dataclasses.replace(execution, context_parallel="none"))
    check_run(packed("tiny", mesh, execution, pipeline=pipeline)[0], ref, bound, f"tiny {mesh} {settings} {pipeline}")
