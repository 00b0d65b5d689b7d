"""Block-scaled FP8 checkpoints as DeepSeek-V3 and Qwen3-FP8 ship them (jaxpar.convert.quantized), made
here from tiny random models: every weight read from one equals the NumPy reference dequantization
(each value times its block's factor) bit for bit, whole or cut into the shards of a sharded layout,
with edge blocks where a dimension is not a multiple of the block; the logits equal those of a plain
checkpoint of the reference values. Other quantizations are refused, naming what they are."""

import json
import shutil

import ml_dtypes
import numpy as np
import pytest
from hf_build import build, save
from safetensors.numpy import load_file, save_file

from jaxpar.convert import from_hf
from jaxpar.errors import ConvertError

E4M3_MAX = 448.0  # the largest finite float8 e4m3fn
IDS = np.random.default_rng(0).integers(0, 250, (2, 12)).astype(np.int32)
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}


def _quantize(w: np.ndarray, block) -> tuple[np.ndarray, np.ndarray]:
    """(float8 e4m3 weight, float32 scale_inv): each block scaled by its absmax / 448, as the releases are."""
    *lead, out, inp = w.shape
    (bo, bi), (gr, gc) = block, (-(-out // block[0]), -(-inp // block[1]))
    padded = np.zeros((*lead, gr * bo, gc * bi), np.float32)
    padded[..., :out, :inp] = w
    blocks = padded.reshape(*lead, gr, bo, gc, bi)
    scale = np.abs(blocks).max(axis=(-3, -1)) / E4M3_MAX
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = (blocks / scale[..., :, None, :, None]).reshape(padded.shape)[..., :out, :inp]
    return q.astype(ml_dtypes.float8_e4m3fn), scale


def _reference(q: np.ndarray, scale: np.ndarray, block) -> np.ndarray:
    """NumPy: each value, in float32, times the factor of the block its row and column fall in."""
    rows, cols = np.arange(q.shape[-2]) // block[0], np.arange(q.shape[-1]) // block[1]
    return q.astype(np.float32) * scale[..., rows[:, None], cols[None, :]]


def _folders(family: str, root, block) -> tuple:
    """(the FP8 folder, a plain float32 folder of its reference values) of a tiny ``family`` model."""
    save(build(family), root / "hf")
    tensors = load_file(str(root / "hf" / "model.safetensors"))
    fp8, ref = {}, {}
    for name, w in tensors.items():
        if w.ndim >= 2 and name.endswith(("proj.weight", "proj_with_mqa.weight")):
            q, scale = _quantize(w, block)
            fp8[name], fp8[name + "_scale_inv"], ref[name] = q, scale, _reference(q, scale, block)
        else:
            fp8[name] = ref[name] = w
    config = json.loads((root / "hf" / "config.json").read_text())
    for name, tensors, extra in (("fp8", fp8, FP8 | {"weight_block_size": list(block)}), ("ref", ref, None)):
        shutil.copytree(root / "hf", root / name)
        save_file(tensors, str(root / name / "model.safetensors"), metadata={"format": "pt"})
        (root / name / "config.json").write_text(json.dumps(config | ({"quantization_config": extra} if extra else {})))
    return root / "fp8", root / "ref"


def _flat(model) -> dict[str, np.ndarray]:
    from flax import nnx

    return {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


@pytest.mark.parametrize(
    "family, block",
    [("qwen3", (128, 128)), ("deepseek_v3", (48, 40))],  # one edge block per weight; 128 = 48 + 48 + 32 rows
)
def test_an_fp8_checkpoint_reads_as_its_reference_values(tmp_path, family, block):
    fp8, ref = _folders(family, tmp_path, block)
    got, want = from_hf(fp8), from_hf(ref)
    a, b = _flat(got), _flat(want)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert np.array_equal(np.asarray(got(IDS)), np.asarray(want(IDS)))
    if family == "deepseek_v3":  # the routed experts' weights came through the same reader
        assert any("moe" in k and k.endswith("gate_up") for k in a)


def test_shards_that_start_inside_a_block_read_the_same_values(tmp_path):
    """fsdp=4 × tensor=2 cuts the weights at rows and columns that fall inside 48 × 40 blocks."""
    fp8, ref = _folders("deepseek_v3", tmp_path, (48, 40))
    got, want = _flat(from_hf(fp8, "fsdp=4,tensor=2")), _flat(from_hf(ref))
    assert all(np.array_equal(got[k], want[k]) for k in want)


def _refused(tmp_path, change, words, tensors=None):
    save(build("llama"), tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(change(config)))
    if tensors is not None:
        save_file(
            tensors(load_file(str(tmp_path / "hf" / "model.safetensors"))), str(tmp_path / "hf" / "model.safetensors")
        )
    with pytest.raises(ConvertError, match=words):
        from_hf(tmp_path / "hf")


COMPRESSED = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}},
}
Q = "model.layers.0.self_attn.q_proj.weight"
BLOCKED = FP8 | {"weight_block_size": [128, 128]}


def _fp8_q(tensors, scale_shape=(1, 1)):
    tensors[Q] = tensors[Q].astype(ml_dtypes.float8_e4m3fn)
    if scale_shape:
        tensors[Q + "_scale_inv"] = np.ones(scale_shape, np.float32)
    return tensors


@pytest.mark.parametrize(
    "quant, tensors, words",
    [
        ({"quant_method": "gptq", "bits": 4}, None, "quant_method='gptq' is not supported; only block-scaled FP8"),
        (COMPRESSED, None, r"'compressed-tensors' \(format 'pack-quantized'; group_0: weights int4 group group 128\)"),
        (FP8 | {"fmt": "e5m2", "weight_block_size": [128, 128]}, None, "fmt='e5m2'; only e4m3"),
        (FP8 | {"activation_scheme": "static", "weight_block_size": [128, 128]}, None, "activation_scheme='static'"),
        (FP8, None, "weight_block_size=None; block scales of two positive sizes"),
        (
            FP8 | {"weight_block_size": [128, 128]},
            lambda t: _fp8_q(t, (2, 1)),
            r"q_proj.weight_scale_inv has shape \[2, 1\]",
        ),
        (FP8 | {"weight_block_size": [128, 128]}, lambda t: _fp8_q(t, None), "q_proj.weight is F8_E4M3 without"),
        (None, _fp8_q, "q_proj.weight is F8_E4M3, and config.json has no quantization_config"),
    ],
)
def test_other_quantizations_are_refused_by_name(tmp_path, quant, tensors, words):
    _refused(tmp_path, lambda c: c | ({"quantization_config": quant} if quant else {}), words, tensors)
