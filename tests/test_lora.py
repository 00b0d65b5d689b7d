"""LoRA adapters (jaxpar.layers.lora): a fresh adapter leaves the base model's logits bit for bit, a
merged adapter gives the unmerged logits, training moves the adapters alone (the optimizer holds
nothing else and the base is bit for bit unchanged), and the adapters' gradients are the one-device
ones on the parallel layouts, within the measured noise."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from adapter_models import with_random_b
from flax import nnx
from invariance import OPTIMIZER, reference, train_steps
from noise import check_mutation_caught, check_run

from jaxpar.errors import ConfigError
from jaxpar.execution import ExecutionConfig
from jaxpar.layers.lora import LoraConfig, LoraParam, merged_state
from jaxpar.layout import make_layout
from jaxpar.meshes import resolve_mesh_arg
from jaxpar.models import build_model, get_model_preset
from jaxpar.pipeline import build
from jaxpar.train.optim import make_optimizer
from jaxpar.train.step import init_train_state, make_train_step

ALL = "q,k,v,o,gate_up,down"
MLA_ALL = "q_a,q_b,kv_a,kv_b,o,gate_up,down"  # DeepSeek: MLA's projections, the dense layers' and shared experts' MLPs
EXPERTS = "expert_gate_up,expert_down"  # the routed experts' weights
IDS = np.random.default_rng(0).integers(0, 256, (4, 16)).astype(np.int32)
B, T, STEPS = 8, 16, 3
TOKENS = np.random.default_rng(1).integers(0, 256, (STEPS, B, T + 1), dtype=np.int32)


def _lora(name: str = "tiny", **fields):
    cfg = get_model_preset(name)
    return dataclasses.replace(cfg, lora=LoraConfig(**({"rank": 4, "targets": ALL} | fields)))


def test_a_fresh_adapter_leaves_the_base_logits_bit_for_bit():
    model = build_model(_lora(), rngs=nnx.Rngs(params=0))
    base = build_model(get_model_preset("tiny"), rngs=nnx.Rngs(params=1))
    nnx.update(base, nnx.state(model, nnx.Not(LoraParam)))  # the same base weights, no adapters
    assert np.array_equal(np.asarray(model(IDS)), np.asarray(base(IDS)))
    assert not np.array_equal(np.asarray(with_random_b(model)(IDS)), np.asarray(base(IDS)))


@pytest.mark.parametrize(
    "name, fields",
    [
        ("tiny", dict(targets=ALL)),
        ("tiny-moe", dict(targets="q,k,v,o")),
        ("tiny-moe", dict(targets=EXPERTS)),
        ("tiny-moe", dict(targets=EXPERTS, experts="shared")),
        ("tiny-deepseek", dict(targets=MLA_ALL + "," + EXPERTS)),
    ],
)
def test_merged_adapters_give_the_unmerged_logits(name, fields):
    model = with_random_b(build_model(_lora(name, **fields), rngs=nnx.Rngs(params=0)))
    base = build_model(get_model_preset(name), rngs=nnx.Rngs(params=1))
    nnx.update(base, merged_state(model))
    np.testing.assert_allclose(np.asarray(base(IDS)), np.asarray(model(IDS)), rtol=0, atol=1e-5)


def test_training_moves_the_adapters_alone():
    cfg, execution = _lora(), ExecutionConfig()
    layout = make_layout(cfg, resolve_mesh_arg("fsdp=8"), batch=B, seq=T, execution=execution)
    ts = init_train_state(lambda r: build_model(cfg, rngs=r), functools.partial(make_optimizer, OPTIMIZER), layout)
    model, opt = nnx.merge(ts.graphdef, ts.state)
    base = jax.tree.map(np.asarray, nnx.state(model, nnx.Not(LoraParam)))
    adapters = {p: v.get_value().shape for p, v in nnx.to_flat_state(nnx.state(model, LoraParam))}
    moments = [x.shape for x in jax.tree.leaves(nnx.state(opt, nnx.OptState)) if x.ndim]
    assert sorted(moments) == sorted(2 * list(adapters.values()))  # Adam's two moments, of adapters only
    step, state, losses = make_train_step(ts, layout), ts.state, []
    for i in range(STEPS):
        state, metrics = step(state, {"inputs": TOKENS[i, :, :-1], "targets": TOKENS[i, :, 1:]})
        losses.append(float(metrics.loss))
    model, _ = nnx.merge(ts.graphdef, state)
    after = jax.tree.map(np.asarray, nnx.state(model, nnx.Not(LoraParam)))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(base)))
    moved = [
        np.abs(np.asarray(v.get_value())).max()
        for p, v in nnx.to_flat_state(nnx.state(model, LoraParam))
        if str(p[-1]).endswith("_b")
    ]
    assert min(moved) > 0  # every B left zero


def _device_bytes(arrays, shardings) -> int:
    """Bytes of device 0's shards of ``arrays`` under ``shardings`` (matching pytrees)."""
    pairs = zip(jax.tree.leaves(arrays), jax.tree.leaves(shardings))
    return sum(int(np.prod(s.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize for x, s in pairs)


def test_the_compiled_step_holds_an_adapter_sized_optimizer_state():
    """Read from the compiled program's input shardings: Adam's state on a device is two adapters'
    worth and its step counts, nothing of the base weights."""
    cfg = _lora("tiny")
    layout = make_layout(cfg, resolve_mesh_arg("fsdp=8"), batch=B, seq=T)
    ts = init_train_state(lambda r: build_model(cfg, rngs=r), functools.partial(make_optimizer, OPTIMIZER), layout)
    batch = {"inputs": TOKENS[0, :, :-1], "targets": TOKENS[0, :, 1:]}
    compiled = make_train_step(ts, layout).lower(ts.state, batch).compile()
    model, opt = nnx.merge(ts.graphdef, ts.state)
    model_sh, opt_sh = nnx.merge(ts.graphdef, compiled.input_shardings[0][0])
    adapters = _device_bytes(nnx.state(model, LoraParam), nnx.state(model_sh, LoraParam))
    moments = _device_bytes(nnx.state(opt, nnx.OptState), nnx.state(opt_sh, nnx.OptState))
    counts = sum(x.dtype.itemsize for x in jax.tree.leaves(nnx.state(opt, nnx.OptState)) if x.ndim == 0)
    assert moments == 2 * adapters + counts  # Adam's two moments of each adapter, its step counts


@pytest.fixture(scope="module")
def lora_reference():
    return reference(_lora(), TOKENS, "lora")


@pytest.mark.parametrize(
    "mesh, settings",
    [
        ("fsdp=8", {}),
        ("data=2,tensor=4", {}),
        ("data=2,sequence=4", dict(context_parallel="ring")),
        ("data=4,sequence=2", dict(context_parallel="ulysses")),
    ],
)
def test_adapter_gradients_equal_one_device(lora_reference, mesh, settings):
    ref, bound = lora_reference
    run = train_steps(_lora(), resolve_mesh_arg(mesh), TOKENS, execution=ExecutionConfig(**settings))
    assert set(ref.grads[0]) == set(run.grads[0]) and all("lora" in p for p in run.grads[0])
    check_run(run, ref, bound, f"lora {mesh} {settings}")


@pytest.fixture(scope="module")
def lora_reference_4():
    """The one-device reference accumulated over 4 microbatches, as a pipeline's schedule runs."""
    return reference(_lora(), TOKENS, "lora", grad_accum=4)


@pytest.mark.parametrize(
    "mesh, schedule, settings",
    [
        ("stage=2,data=4", "1f1b", {}),
        ("stage=2,fsdp=4", "gpipe", dict(fsdp_gather="step")),
        ("stage=2,data=2,tensor=2", "zero_bubble", {}),
        ("stage=2,data=2,tensor=2", "1f1b", dict(grad_reduce="step")),
    ],
)
def test_adapter_gradients_under_a_pipeline_equal_one_device(lora_reference_4, mesh, schedule, settings):
    """The executor differentiates the adapters alone; the frozen base rides in each stage's state."""
    ref, bound = lora_reference_4
    run = train_steps(_lora(), resolve_mesh_arg(mesh), TOKENS, pipeline=build(schedule, 2, 4), **settings)
    assert set(ref.grads[0]) == set(run.grads[0]) and all("lora" in p for p in run.grads[0])
    check_run(run, ref, bound, f"lora pipeline {schedule} on {mesh} {settings}")


@pytest.mark.parametrize(
    "mesh, settings, experts",
    [
        ("data=2,expert=4", {}, "each"),  # capacity: the all-to-all kernel
        ("data=2,expert=4", dict(capacity_factor=None), "each"),  # dropless: the ragged exchange
        ("data=2,expert=2,tensor=2", {}, "shared"),
    ],
)
def test_expert_adapter_gradients_equal_one_device(mesh, settings, experts):
    """The routed experts' adapters (one per expert, split over the expert axis with the experts, or one
    shared by all) and the attention's, on expert-parallel layouts, against one device."""
    cfg = _lora("tiny-moe", targets="q,v," + EXPERTS, experts=experts)
    execution = ExecutionConfig(**settings)
    ref, bound = reference(cfg, TOKENS, "lora", execution=execution)
    run = train_steps(cfg, resolve_mesh_arg(mesh), TOKENS, execution=execution)
    assert any("['moe']['gate_up_lora_a']" in p for p in run.grads[0]) and all("lora" in p for p in run.grads[0])
    check_run(run, ref, bound, f"lora experts={experts} {mesh} {settings}")


def test_a_wrong_adapter_gradient_is_caught(lora_reference):
    """The bound catches an adapter scaled wrong (alpha 32 for 16: the update's size doubles)."""
    ref, bound = lora_reference
    check_mutation_caught(
        train_steps(_lora(alpha=32.0), resolve_mesh_arg("fsdp=8"), TOKENS), ref, bound, "alpha doubled"
    )


@pytest.mark.parametrize(
    "fields, words",
    [
        (dict(rank=-1), "model.lora.rank=-1"),
        (dict(targets="q,attn"), "model.lora.targets='q,attn'"),
        (dict(alpha=0.0), "model.lora.alpha=0.0"),
    ],
)
def test_bad_adapters_are_refused_by_name(fields, words):
    with pytest.raises(ConfigError, match=words):
        _lora(**fields)


@pytest.mark.parametrize(
    "name, targets, words",
    [
        (
            "tiny-deepseek",
            "q,kv_b",
            "q is not a projection of this model; its MLA attention and dense MLPs take q_a, q_b",
        ),
        ("tiny-deepseek", "k", "k is not a projection"),
        ("tiny", "q,kv_a", "kv_a is not a projection of this model; its GQA attention and dense MLPs take q, k, v, o"),
    ],
)
def test_targets_the_attention_does_not_have_are_refused(name, targets, words):
    with pytest.raises(ConfigError, match=words):
        _lora(name, targets=targets)


@pytest.mark.parametrize(
    "name, targets, dropped",
    [
        ("tiny-deepseek", "q_a,kv_b,o", ("kv_b_lora_b",)),  # the absorbed decode: kv_b's through its factors
        ("tiny-moe", "q," + EXPERTS, ("moe", "gate_up_lora_b")),  # a decode step runs every expert
    ],
)
def test_the_engine_decodes_with_the_adapters_the_forward_has(name, targets, dropped):
    """MLA's decode never forms per-head keys: kv_b's adapter enters through the query's latent and the
    output (``jaxpar.layers.mla``); an MoE decode step runs every expert, with their adapters. The
    engine's logits at every generated position equal the training forward's on the same tokens, within
    a multiple of the forward's own noise (merged against unmerged adapters); with one adapter dropped
    (the mutation: its B zeroed) they miss it widely."""
    from noise import MULTIPLE, MUTATION_GAP, record

    from jaxpar.inference.engine import Engine
    from jaxpar.inference.scheduler import Request

    dropless = ExecutionConfig(capacity_factor=None)  # as the engine routes
    cfg = _lora(name, targets=targets)
    model = with_random_b(build_model(cfg, execution=dropless, rngs=nnx.Rngs(params=0)))
    merged = build_model(get_model_preset(name), execution=dropless, rngs=nnx.Rngs(params=1))
    nnx.update(merged, merged_state(model))
    prompt = IDS[0, :6].tolist()

    def decoded(m):
        engine = Engine(m, max_slots=2, page_size=4, max_length=32, chunk=16, record_logits=True)
        request = Request(0, prompt, 6)
        engine.run([request])
        return np.stack(engine.logits[0])[1:], request.tokens  # the decode steps' rows

    rows, tokens = decoded(model)
    ids = np.asarray([tokens[:-1]], np.int32)
    forward = np.asarray(model(ids))[0, len(prompt) :]
    noise = np.abs(np.asarray(merged(ids))[0, len(prompt) :] - forward).max()
    bound = float(MULTIPLE * max(noise, 2.0**-23))
    error = float(np.abs(rows - forward).max())
    record(
        "lora",
        "mla absorbed decode",
        noise=dict(logit=float(noise)),
        tolerance=dict(logit=bound),
        error=dict(logit=error),
    )
    assert error <= bound
    without = nnx.clone(model)
    for path, var in nnx.to_flat_state(nnx.state(without, LoraParam)):  # one B zeroed: its adapter gone
        if tuple(map(str, path[-len(dropped) :])) == dropped:
            var.set_value(np.zeros(var.get_value().shape, np.float32))
    wrong, _ = decoded(without)
    factor = float(np.abs(wrong - forward).max()) / bound
    record("lora", f"mutation: {name} {dropped[-1]} dropped", tolerance=dict(logit=bound), factor=factor)
    assert factor >= MUTATION_GAP
