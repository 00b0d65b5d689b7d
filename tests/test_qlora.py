"""QLoRA (jaxpar.layers.quant, ``model.lora.quantize``): each value comes back within half a quantization
step (int8 per channel, NF4 per group); a quantized base computes what its dequantized weights do; the
compiled step holds about ½ (int8) and ¼ (NF4) of the bfloat16 base weights' bytes; training moves the
adapters and leaves the quantized base bit for bit; the adapters' gradients are the one-device ones on
``fsdp``, and DeepSeek's (MLA's five weights and every expert's stored quantized) on ``expert`` and
``tensor``; the engine decodes a quantized base as its dequantized copy; a merged export is the adapted
model; a Hugging Face base is quantized on ``--init-from``."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from adapter_models import with_random_b
from flax import nnx
from invariance import OPTIMIZER, reference, train_steps
from noise import check_mutation_caught, check_run

from jaxpar.cli import main
from jaxpar.errors import ConfigError, LayoutError
from jaxpar.layers.lora import SPECS, LoraConfig, LoraParam, merged_state
from jaxpar.layers.quant import Quantized, dequantize, dequantize_weights, nf4_values, quantize, step_bound
from jaxpar.layout import make_layout
from jaxpar.meshes import resolve_mesh_arg
from jaxpar.models import build_model, get_model_preset
from jaxpar.train.optim import make_optimizer
from jaxpar.train.step import init_train_state, make_train_step

IDS = np.random.default_rng(0).integers(0, 256, (4, 16)).astype(np.int32)
B, T, STEPS = 8, 16, 3
TOKENS = np.random.default_rng(1).integers(0, 256, (STEPS, B, T + 1), dtype=np.int32)
ALL = "q,k,v,o,gate_up,down"


# DeepSeek: MLA's projections, the dense layer's and shared experts' MLPs, and the routed experts' weights
DEEPSEEK_ALL = "q_a,q_b,kv_a,kv_b,o,gate_up,down,expert_gate_up,expert_down"
# the weights QLoRA stores quantized in every DeepSeek layer (MLA's five) and MoE layer (the experts')
DEEPSEEK_QUANTIZED = {"q_a", "q_b", "kv_a", "kv_b", "o", "gate_up", "down"}


def _qlora(kind: str, **fields):
    cfg = get_model_preset("tiny")
    return dataclasses.replace(cfg, **fields, lora=LoraConfig(rank=4, targets=ALL, quantize=kind))


def _deepseek(kind: str, **moe):
    """tiny-deepseek widened so that nf4 groups every weight along a dimension its own (64 divides it)."""
    base = get_model_preset("tiny-deepseek")
    moe = dataclasses.replace(base.moe, **dict(dict(mlp_dim=64, shared_mlp_dim=64), **moe))
    mla = dataclasses.replace(base.mla, q_lora_rank=64, kv_lora_rank=64)
    lora = LoraConfig(rank=4, targets=DEEPSEEK_ALL, quantize=kind)
    return dataclasses.replace(base, embed_dim=128, moe=moe, mla=mla, lora=lora)


MODELS = {"tiny": _qlora, "tiny-deepseek": _deepseek}


@pytest.mark.parametrize("kind", ["int8", "nf4"])
@pytest.mark.parametrize(
    "name, shape", [("q", (128, 4, 16)), ("o", (4, 16, 128)), ("gate_up", (64, 2, 128)), ("down", (128, 64))]
)
def test_each_value_comes_back_within_half_a_step(kind, name, shape):
    w = np.random.default_rng(2).normal(0, 0.05, shape).astype(np.float32)
    data, scale = quantize(w, SPECS[name], kind)
    back = np.asarray(dequantize(data, scale, SPECS[name], kind, np.float32))
    assert np.all(np.abs(back - w) <= step_bound(w, SPECS[name], kind) * (1 + 1e-6))
    assert data.dtype == (np.int8 if kind == "int8" else np.uint8)


def test_nf4_codes_are_normal_quantiles_with_an_exact_zero():
    values = nf4_values()
    assert len(values) == 16 and values[0] == -1 and values[-1] == 1 and 0.0 in values
    assert np.all(np.diff(values) > 0) and (values > 0).sum() == 8


def _dequantized(model):
    """A copy of ``model`` with every quantized weight back as a float32 ``nnx.Param``."""
    plain = nnx.clone(model)
    for _, module in nnx.iter_graph(plain):
        if isinstance(module, nnx.Module):
            dequantize_weights(module, SPECS)
    assert not any(isinstance(v, Quantized) for _, v in nnx.iter_graph(plain))
    return plain


@pytest.mark.parametrize("name, kind", [("tiny", "int8"), ("tiny", "nf4"), ("tiny-deepseek", "int8")])
def test_a_quantized_base_computes_its_dequantized_weights(name, kind):
    """Bit for bit; and the merged export (adapters with random B) is the adapted model. DeepSeek: MLA's
    weights, the dense and shared experts' MLPs and every routed expert's matrices are stored quantized."""
    cfg = MODELS[name](kind)
    model = with_random_b(build_model(cfg, rngs=nnx.Rngs(params=0)))
    if name == "tiny-deepseek":
        paths = [tuple(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, Quantized))]
        assert {p[-1].rsplit("_", 1)[0] for p in paths} == DEEPSEEK_QUANTIZED
        assert ("moe", "gate_up_data") in {p[-2:] for p in paths}  # the routed experts' matrices
    assert np.array_equal(np.asarray(model(IDS)), np.asarray(_dequantized(model)(IDS)))
    merged = build_model(dataclasses.replace(cfg, lora=LoraConfig()), rngs=nnx.Rngs(params=1))
    nnx.update(merged, merged_state(model))
    np.testing.assert_allclose(np.asarray(merged(IDS)), np.asarray(model(IDS)), rtol=0, atol=1e-5)


WIDE = dict(embed_dim=512, mlp_dim=1024, num_heads=8, num_kv_heads=2, head_dim=64, param_dtype="bfloat16")


def _base_bytes(kind: str) -> tuple[int, int]:
    """(device 0's bytes of the projections' stored base, the compiled step's argument bytes) for a
    wider tiny (its per-channel and per-group scales then weigh what they do in real models) with
    bfloat16 parameters on fsdp=8, read from the compiled program."""
    lora = LoraConfig(rank=4, targets=ALL, quantize=kind)
    cfg = dataclasses.replace(get_model_preset("tiny"), **WIDE, lora=lora)
    layout = make_layout(cfg, resolve_mesh_arg("fsdp=8"), batch=B, seq=T)
    ts = init_train_state(lambda r: build_model(cfg, rngs=r), functools.partial(make_optimizer, OPTIMIZER), layout)
    batch = {"inputs": TOKENS[0, :, :-1], "targets": TOKENS[0, :, 1:]}
    compiled = make_train_step(ts, layout).lower(ts.state, batch).compile()
    flat = zip(jax.tree.leaves(ts.state), jax.tree.leaves(compiled.input_shardings[0][0]))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(ts.state)]
    base = 0
    for path, (x, s) in zip(paths, flat):
        last = path.rsplit("'", 2)[-2]
        if last in SPECS or last.removesuffix("_data") in SPECS or last.removesuffix("_scale") in SPECS:
            base += int(np.prod(s.shard_shape(x.shape))) * x.dtype.itemsize
    return base, compiled.memory_analysis().argument_size_in_bytes


def test_the_compiled_step_holds_a_half_and_a_quarter_of_the_bf16_base():
    full, args_full = _base_bytes("none")
    for kind, low, high in (("int8", 0.5, 0.6), ("nf4", 0.25, 0.32)):
        stored, args = _base_bytes(kind)
        assert low <= stored / full <= high, (kind, stored / full)
        assert args_full - args == full - stored  # the arguments shrink by exactly what the base saves


def test_training_moves_the_adapters_and_leaves_the_quantized_base():
    cfg = _qlora("nf4")
    layout = make_layout(cfg, resolve_mesh_arg("fsdp=8"), batch=B, seq=T)
    ts = init_train_state(lambda r: build_model(cfg, rngs=r), functools.partial(make_optimizer, OPTIMIZER), layout)
    before = jax.tree.map(np.asarray, nnx.state(nnx.merge(ts.graphdef, ts.state)[0], Quantized))
    step, state = make_train_step(ts, layout), ts.state
    for i in range(STEPS):
        state, metrics = step(state, {"inputs": TOKENS[i, :, :-1], "targets": TOKENS[i, :, 1:]})
        assert np.isfinite(float(metrics.loss))
    model = nnx.merge(ts.graphdef, state)[0]
    after = jax.tree.map(np.asarray, nnx.state(model, Quantized))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)))
    moved = [
        np.abs(np.asarray(v.get_value())).max()
        for p, v in nnx.to_flat_state(nnx.state(model, LoraParam))
        if str(p[-1]).endswith("_b")
    ]
    assert min(moved) > 0


@pytest.fixture(scope="module")
def qlora_reference():
    return reference(_qlora("nf4"), TOKENS, "lora")


def test_adapter_gradients_over_a_quantized_base_equal_one_device(qlora_reference):
    ref, bound = qlora_reference
    check_run(train_steps(_qlora("nf4"), resolve_mesh_arg("fsdp=8"), TOKENS), ref, bound, "qlora nf4 fsdp=8")


def test_mla_and_expert_adapters_over_a_quantized_base_equal_one_device():
    """DeepSeek's adapters (MLA, dense and shared MLPs, one per routed expert) over an nf4 base, with the
    experts split over ``expert`` and the heads and MLPs over ``tensor``."""
    cfg = _deepseek("nf4")
    ref, bound = reference(cfg, TOKENS, "lora")
    run = train_steps(cfg, resolve_mesh_arg("data=2,expert=2,tensor=2"), TOKENS)
    assert any("['moe']['gate_up_lora_a']" in p for p in run.grads[0]) and all("lora" in p for p in run.grads[0])
    check_run(run, ref, bound, "qlora nf4 deepseek data=2,expert=2,tensor=2")


def test_int8_in_place_of_nf4_is_caught(qlora_reference):
    """The bound tells one base quantization from another (the same weights, int8 instead of nf4)."""
    ref, bound = qlora_reference
    check_mutation_caught(train_steps(_qlora("int8"), resolve_mesh_arg("fsdp=8"), TOKENS), ref, bound, "int8 for nf4")


def test_nf4_groups_that_do_not_divide_the_mesh_are_refused_by_name():
    with pytest.raises(LayoutError, match=r"model.mlp_dim / 64 \(the groups of model.lora.quantize=nf4\)=2"):
        train_steps(_qlora("nf4"), resolve_mesh_arg("data=2,tensor=4"), TOKENS)


def test_expert_groups_that_do_not_divide_the_mesh_are_refused_by_name():
    """The routed experts' width (128: two groups) bounds ``mlp`` with the dense layer's (128) and the
    shared experts' packed pairs (one group of 64: 32 pairs)."""
    with pytest.raises(
        LayoutError,
        match=r"gcd\(model.mlp_dim / 64, model.moe.mlp_dim / 64, .*\) \(the groups of model.lora.quantize=nf4\)=2",
    ):
        make_layout(_deepseek("nf4", mlp_dim=128), resolve_mesh_arg("data=2,tensor=4"), batch=B, seq=T)


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ConfigError, match="model.lora.quantize='int4'"):
        LoraConfig(rank=4, quantize="int4")
    with pytest.raises(ConfigError, match="model.lora.quantize=nf4: a quantized base trains adapters"):
        LoraConfig(rank=0, quantize="nf4")


def test_a_hugging_face_base_is_quantized_on_init_from(tmp_path):
    from hf_models import build, save

    save(build("llama"), tmp_path / "hf")
    args = ["train", "--init-from", str(tmp_path / "hf"), "--out", str(tmp_path / "run"), "--steps", "2"]
    args += ["--batch", "8", "--seq", "16", "--mesh", "fsdp=8"]
    sets = ["model.lora.rank=4", f"model.lora.targets={ALL}", "model.lora.quantize=nf4", "log.progress=false"]
    sets += ["log.tensorboard=false", "log.eval_every=0"]
    assert main(args + [x for s in sets for x in ("--set", s)]) == 0
    from jaxpar.convert import from_hf
    from jaxpar.convert.store import load_model
    from jaxpar.shardings import default_layout

    base = from_hf(tmp_path / "hf")
    layout = default_layout(base.cfg, "dp", devices=jax.devices()[:1], execution=base.execution)
    run, _ = load_model(tmp_path / "run", layout)
    q = run.blocks.attn.q_data[...]
    want, _ = jax.vmap(functools.partial(quantize, spec=SPECS["q"], kind="nf4"))(base.blocks.attn.q[...])
    assert np.array_equal(np.asarray(q), np.asarray(want))  # the folder's weights, quantized


@pytest.mark.parametrize("name", MODELS)
def test_the_engine_serves_a_quantized_base(name):
    """Greedy decoding on a QLoRA model gives its dequantized copy's tokens (the same logits); DeepSeek's
    absorbed decode reads kv_b's dequantized halves."""
    from jaxpar.inference.engine import Engine
    from jaxpar.inference.scheduler import Request

    cfg = MODELS[name]("nf4")
    model = with_random_b(build_model(cfg, rngs=nnx.Rngs(params=0)))
    plain = build_model(dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, quantize="none")), rngs=nnx.Rngs(1))
    nnx.update(plain, nnx.state(_dequantized(model)))  # the dequantized weights, in a model built without quantizing
    runs = []
    for m in (model, plain):
        requests = [Request(i, IDS[i, : 4 + i].tolist(), 6) for i in range(4)]
        Engine(m, max_slots=4, page_size=4, max_length=16).run(requests)
        runs.append([r.tokens for r in requests])
    assert runs[0] == runs[1]
