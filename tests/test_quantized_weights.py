"""Weights stored for serving (``model.quantize``: jaxpar.layers.codes, jaxpar.layers.quant): every value
comes back within half a step (int8 per channel, int4 per group of 128, fp8 per 128 × 128 block, its
outliers clamped, never NaN); the compiled forward holds about ½ (int8, fp8) and ¼ (int4) of the bf16
weights' bytes, for a dense and an MoE model; greedy decoding of each format agrees with the float
model's under the margin rule, with each format's logit error measured and int4's bounded; a
quantized model decodes the same tokens on ``decode_tp`` / ``decode_ep`` as on one device; and
``jaxpar convert --quantize`` writes a checkpoint that ``jaxpar generate`` runs."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx
from logprob_oracle import Forward, agree_under_margin

from jaxpar.cli import main
from jaxpar.convert import quantized_model
from jaxpar.errors import ConfigError
from jaxpar.execution import ExecutionConfig
from jaxpar.inference.generate import Generator
from jaxpar.layers.codes import FP8_MAX, dequantize, quantize, step_bound
from jaxpar.layers.lora import SPECS
from jaxpar.layers.quant import Quantized
from jaxpar.models import build_model, get_model_preset
from jaxpar.shardings import default_layout

KINDS = ("int8", "int4", "fp8")
DROPLESS = ExecutionConfig(capacity_factor=None)  # the engine routes dropless
NEW = 12
PROMPTS = [list(p) for p in np.random.default_rng(0).integers(0, 256, (8, 7))]
# Each format's logit error on these prompts as a share of the float logits' spread (std), bounded at
# about 1.5 times what it measures on this model (int8 0.030, fp8 0.133, int4 0.382; deterministic: the
# weights come from jax's counter-based PRNG, the same on every machine)
RELATIVE_ERROR = {"int8": 0.05, "fp8": 0.2, "int4": 0.5}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "name, shape", [("q", (256, 4, 128)), ("o", (4, 128, 256)), ("gate_up", (128, 2, 256)), ("down", (64, 96))]
)
def test_each_value_comes_back_within_half_a_step(kind, name, shape):
    w = np.random.default_rng(2).normal(0, 0.05, shape).astype(np.float32)
    w.flat[7] = 40.0  # an outlier: its block's scale grows, the rest round coarser, nothing overflows
    data, scale = quantize(w, SPECS[name], kind)
    back = np.asarray(dequantize(data, scale, SPECS[name], kind, np.float32))
    assert np.all(np.isfinite(back))
    assert np.all(np.abs(back - w) <= step_bound(w, SPECS[name], kind) + 2 * np.spacing(np.abs(w)))
    assert data.dtype == (np.int8 if kind == "int8" else np.uint8)  # fp8: e4m3's bits
    if kind == "fp8":  # the largest value of a block lands on e4m3's largest, ±448, times the scale
        values = np.asarray(data).view(jax.numpy.float8_e4m3fn).astype(np.float32)
        assert np.max(np.abs(values)) == FP8_MAX


def _quantized(cfg, kind: str, seed: int = 0):
    model = build_model(cfg, execution=DROPLESS, rngs=nnx.Rngs(seed))
    layout = default_layout(cfg, "dp", devices=jax.devices()[:1], execution=DROPLESS)
    return model, quantized_model(model, kind, layout)


WIDE = dict(embed_dim=512, mlp_dim=1024, num_heads=8, num_kv_heads=2, head_dim=128, param_dtype="bfloat16")
WIDE |= dict(num_layers=4)  # a whole model's dequantized copy would be 4 layers' worth


def _argument_bytes(model) -> tuple[int, int, int]:
    """(the projections' stored bytes, the compiled forward's argument and temporary bytes)."""
    graphdef, state = nnx.split(model)
    ids = np.zeros((1, 8), np.int32)
    compiled = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).lower(state, ids).compile()
    stored = 0
    for path, var in nnx.to_flat_state(state):
        last = str(path[-1])
        if isinstance(var, Quantized) or (last in SPECS and "lora" not in last):
            stored += var.get_value().nbytes
    memory = compiled.memory_analysis()
    return stored, memory.argument_size_in_bytes, memory.temp_size_in_bytes


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_the_compiled_forward_holds_a_half_and_a_quarter_of_the_bf16_weights(name):
    """And dequantizes a layer at a time: its temporaries stay under half of the whole model's weights
    dequantized (float32, the compute dtype), which a copy of every layer's would exceed."""
    cfg = dataclasses.replace(get_model_preset(name), **WIDE)
    if cfg.moe is not None:
        cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, mlp_dim=256))
    plain, _ = _quantized(cfg, "int8")
    full, args_full, _ = _argument_bytes(plain)
    for kind, low, high in (("int8", 0.5, 0.52), ("fp8", 0.5, 0.52), ("int4", 0.25, 0.28)):
        stored, args, temp = _argument_bytes(_quantized(cfg, kind)[1])
        assert low <= stored / full <= high, (kind, stored / full)
        assert args_full - args == full - stored  # the arguments shrink by exactly what the weights save
        assert temp < full, (kind, temp, full)  # full: the bf16 bytes, half of the float32 copy


def _greedy(model) -> tuple[list, list]:
    out = Generator(model).generate(PROMPTS, max_new_tokens=NEW, return_logits=True)
    return out.tokens, out.logits


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_decoding_agrees_with_the_float_model_under_the_margin_rule(kind):
    """The float model's tokens are kept wherever its top-two gap exceeds twice the quantized model's
    logit error (measured on the float model's own sequences, teacher-forced): only there could the
    quantization swap the top two."""
    cfg = get_model_preset("tiny")
    plain, quant = _quantized(cfg, kind)
    want, want_logits = _greedy(plain)
    got, _ = _greedy(quant)
    forward_f, forward_q = Forward(plain, 32), Forward(quant, 32)
    error, spread, compared = 0.0, 0.0, 0
    for prompt, tokens in zip(PROMPTS, want):
        seq = prompt + tokens
        rows = slice(len(prompt) - 1, len(seq) - 1)
        f, q = forward_f.logits(seq)[rows], forward_q.logits(seq)[rows]
        error, spread = max(error, float(np.abs(f - q).max())), max(spread, float(f.std()))
    for tokens, logits, got_tokens in zip(want, want_logits, got):
        top2 = np.sort(np.asarray(logits), axis=-1)[:, -2:]
        compared += agree_under_margin(tokens, list(top2[:, 1] - top2[:, 0]), got_tokens, margin=2 * error)
    print(f"{kind}: logit error {error:.3e} ({error / spread:.3f} of the logits' std), {compared} steps compared")
    assert compared >= NEW  # at least one whole row
    assert error / spread <= RELATIVE_ERROR[kind]


@pytest.mark.parametrize("name, mesh, devices", [("tiny", "decode_tp", 8), ("tiny-moe", "decode_ep", 4)])
def test_a_quantized_model_decodes_the_same_tokens_on_every_layout(name, mesh, devices):
    _, quant = _quantized(get_model_preset(name), "int4")
    one = Generator(quant).generate(PROMPTS, max_new_tokens=NEW, return_logits=True)
    split = Generator(quant, mesh, devices=jax.devices()[:devices]).generate(
        PROMPTS, max_new_tokens=NEW, return_logits=True
    )
    for tokens, logits, got in zip(one.tokens, one.logits, split.tokens):
        top2 = np.sort(np.asarray(logits), axis=-1)[:, -2:]
        assert agree_under_margin(tokens, list(top2[:, 1] - top2[:, 0]), got, margin=1e-4) >= 1


def test_convert_quantize_writes_a_checkpoint_generate_runs(tmp_path, capsys):
    from hf_build import build, save

    save(build("llama"), tmp_path / "hf")
    out = tmp_path / "int8"
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--quantize", "int8", "--out", str(out)]) == 0
    assert json.loads((out / "model.json").read_text())["model"]["quantize"] == "int8"
    capsys.readouterr()
    assert main(["generate", "--from", str(out), "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["tokens"][0]) == 4
    with pytest.raises(ConfigError, match="model.quantize=int8: weights stored for serving do not train"):
        from jaxpar.train.config import default_config

        dataclasses.replace(default_config("tiny"), model=get_model_preset("tiny", quantize="int8")).validate()


def test_the_serving_plan_prices_the_smaller_weights():
    """``jaxpar plan --inference --quantize``: the weights each device holds and each decode step reads
    shrink by what the projections save; the embedding and LM head stay bfloat16."""
    from jaxpar.analysis.inference_plan import plan_inference

    kw = dict(batch=8, context=256, hardware="h100", devices=8)
    plans = {k: plan_inference("llama3.2-1b", "decode_tp", **kw, quantize=k) for k in ("none", "int8", "int4")}
    cfg = get_model_preset("llama3.2-1b")
    projections = 2 * (cfg.num_params() - cfg.vocab_size * cfg.embed_dim - (2 * cfg.num_layers + 1) * cfg.embed_dim)
    saved = plans["none"].weight_bytes_per_device - plans["int8"].weight_bytes_per_device
    assert 0.98 * projections / 2 / 8 <= saved <= projections / 2 / 8  # half the projections, less the scales
    assert plans["int4"].weight_bytes_per_device < plans["int8"].weight_bytes_per_device
    reads = [plans[k].decode_bytes_read_per_device for k in ("none", "int8", "int4")]
    assert reads[0] - reads[1] == saved and reads[1] > reads[2]


def test_jaxpar_serve_runs_a_quantized_checkpoint_with_adapters(tmp_path):
    """``jaxpar serve --from`` an int8 checkpoint with ``--adapter``: the bank of adapters sits over the
    int8 weights, and the engine decodes the quantized model's tokens (a fresh adapter changes none)."""
    from serve_inprocess import word_tokenizer

    from jaxpar.cli import build_parser
    from jaxpar.convert import save_adapter
    from jaxpar.convert.store import save_model
    from jaxpar.inference import serve_command
    from jaxpar.inference.scheduler import Request
    from jaxpar.layers.lora import LoraConfig

    plain, quant = _quantized(get_model_preset("tiny"), "int8")
    save_model(quant, tmp_path / "int8", source={"test": True})
    word_tokenizer().save(str(tmp_path / "int8" / "tokenizer.json"))
    lora = dataclasses.replace(plain.cfg, lora=LoraConfig(rank=4, targets="q,v"))
    save_adapter(build_model(lora, rngs=nnx.Rngs(1)), tmp_path / "terse")
    argv = ["serve", "--from", str(tmp_path / "int8"), "--adapter", f"terse={tmp_path / 'terse'}", "--port", "0"]
    args = build_parser().parse_args(argv + ["--cpu-devices", "1", "--replicas", "1", "--max-length", "64"])
    cfg, eos, _ = serve_command.model_config("jaxpar", args.source)
    assert cfg.quantize == "int8"
    service = serve_command.build_service(args, cfg, eos, "jaxpar", word_tokenizer(), str(tmp_path / "int8"))
    engine = service.workers[0].engine
    requests = [Request(i, p, NEW, adapter=i % 2) for i, p in enumerate(PROMPTS[:4])]
    engine.run(requests)
    want = Generator(quant).generate(PROMPTS[:4], max_new_tokens=NEW).tokens
    for r, tokens in zip(requests, want):  # the base rows, and the adapter's (fresh: B = 0, the base's)
        assert r.tokens[len(r.prompt) :] == tokens
