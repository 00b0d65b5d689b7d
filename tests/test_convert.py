"""Hugging Face conversion: for every family, our logits equal ``transformers``' (fp32, within a multiple
of the HF model's own noise: its distance from the same model in float64, tests/noise.py) on one
device, under fsdp=4 × tensor=2 and into a pipeline layout (stage=2 × fsdp=2 × tensor=2, each stage
holding its half of the layer stack); HF → jaxpar → HF gives the same tensors and a folder transformers
loads with the same logits; bad folders are refused with the file, tensor or field named."""

import json
import struct

import hf_models
import jax
import numpy as np
import pytest
from flax import nnx
from noise import record

from jaxpar.convert import ConvertError, from_hf, to_hf

pytest.importorskip("transformers")  # test-only dependency, installed by the [dev] extra
FAMILIES = sorted(hf_models.CONFIGS)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> (HF folder, reference logits); mixtral is saved in several shards with an index."""
    out = {}
    for family in FAMILIES:
        model = hf_models.build(family)
        folder = tmp_path_factory.mktemp(family)
        hf_models.save(model, folder, max_shard_size="200KB" if family == "mixtral" else "5GB")
        out[family] = folder, hf_models.logits(model, hf_models.IDS), hf_models.own_noise(model, hf_models.IDS)
    return out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mesh", [None, "fsdp=4,tensor=2", "stage=2,fsdp=2,tensor=2"])
def test_logits_match_transformers(folders, family, mesh):
    folder, want, noise = folders[family]
    model = from_hf(folder, mesh=mesh)
    with model.layout.activate():  # a sharded model is traced inside its layout (else: NoLayoutError)
        got = np.asarray(jax.jit(lambda m, ids: m(ids))(model, hf_models.IDS))
    assert got.dtype == np.float32 and got.shape == want.shape
    err, tol = float(np.max(np.abs(got - want))), hf_models.logit_bound(noise)
    record(
        "generation",
        f"{family} logits on {mesh or 'one device'} vs transformers",
        noise=dict(logit=noise),
        tolerance=dict(logit=tol),
        error=dict(logit=err),
    )
    assert err <= tol, (err, tol, noise)
    if mesh:
        embed = model.embed.embedding[...]
        assert len(embed.sharding.device_set) == 8 and embed.addressable_shards[0].data.size < embed.size
    if mesh and "stage" in mesh:  # each stage holds its layers: the stack's leading axis split
        for leaf in jax.tree.leaves(nnx.state(getattr(model, model.pipeline_stack), nnx.Param)):
            assert leaf.sharding.spec[0] == "stage", leaf.sharding.spec


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_gives_the_same_tensors_and_transformers_loads_it(folders, family, tmp_path):
    import torch
    import transformers
    from safetensors.numpy import load_file

    folder, want, _ = folders[family]
    out = to_hf(from_hf(folder), tmp_path / "export", max_shard_bytes=300_000)

    def tensors(d):
        return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}

    theirs, ours = tensors(folder), tensors(out)
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    np.testing.assert_array_equal(hf_models.logits(reloaded, hf_models.IDS), want)  # the same program and tensors


# --------------------------------------------------------------------------------------- bad input
@pytest.fixture()
def llama(folders, tmp_path):
    """A copy of the llama folder to spoil."""
    import shutil

    dst = tmp_path / "llama"
    shutil.copytree(folders["llama"][0], dst)
    return dst


def _edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text()) | changes
    path.write_text(json.dumps(config))


def test_missing_config(llama):
    (llama / "config.json").unlink()
    with pytest.raises(ConvertError, match=r"config\.json: missing"):
        from_hf(llama)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(model_type="gpt2", architectures=["GPT2LMHeadModel"]), r"unknown architecture \(model_type='gpt2'"),
        (dict(attention_bias=True), r"attention_bias=True is not supported for llama"),
        (dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
        (dict(partial_rotary_factor=0.5), r"unsupported field 'partial_rotary_factor'"),
        (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), r"rope_scaling type 'dynamic' is not supported"),
    ],
)
def test_unsupported_config_is_refused_by_name(llama, changes, message):
    _edit_config(llama, **changes)
    with pytest.raises(ConvertError, match=message):
        from_hf(llama)


def _rewrite_tensor(folder, name, transform):
    from safetensors.numpy import load_file, save_file

    file = next(f for f in folder.glob("*.safetensors") if name in load_file(f))
    tensors = load_file(file)
    tensors[name] = transform(tensors[name])
    save_file(tensors, str(file), metadata={"format": "pt"})
    return file


def test_shape_mismatch_names_the_tensor(llama):
    file = _rewrite_tensor(llama, "model.layers.1.self_attn.k_proj.weight", lambda w: w[:8])
    with pytest.raises(
        ConvertError,
        match=rf"{file.name}: tensor model.layers.1.self_attn.k_proj.weight has "
        r"shape \[8, 64\], the config says \[16, 64\]",
    ):
        from_hf(llama)


def test_missing_tensor_is_named(llama):
    _rewrite_tensor(llama, "model.layers.0.mlp.down_proj.weight", lambda w: w)
    file = next(llama.glob("*.safetensors"))
    from safetensors.numpy import load_file, save_file

    tensors = load_file(file)
    tensors["model.layers.0.mlp.extra_proj.weight"] = tensors.pop("model.layers.0.mlp.down_proj.weight")
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(
        ConvertError,
        match=r"tensor model.layers.0.mlp.down_proj.weight is missing \(needed for "
        r"blocks/mlp/down\)",
    ):
        from_hf(llama)


def test_unexpected_tensor_is_named(llama):
    from safetensors.numpy import load_file, save_file

    file = next(llama.glob("*.safetensors"))
    tensors = load_file(file)
    tensors["model.layers.0.mlp.extra_proj.weight"] = np.zeros((4, 4), np.float32)
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ConvertError, match=rf"{file.name}: tensor model.layers.0.mlp.extra_proj.weight is not part"):
        from_hf(llama)


def test_truncated_safetensors_names_the_file(llama):
    file = next(llama.glob("*.safetensors"))
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ConvertError, match=rf"{file.name}: truncated safetensors file"):
        from_hf(llama)
    n = struct.unpack("<Q", data[:8])[0]
    file.write_bytes(data[: 8 + n // 2])
    with pytest.raises(ConvertError, match=rf"{file.name}: truncated safetensors file \(header of"):
        from_hf(llama)


def test_pickle_checkpoints_are_never_loaded(llama):
    for f in llama.glob("*.safetensors"):
        f.rename(f.with_suffix(".bin"))
    with pytest.raises(ConvertError, match=r"no \*\.safetensors files \(found model\.bin: pickle formats are never"):
        from_hf(llama)


def test_export_never_overwrites(folders, tmp_path):
    model = from_hf(folders["qwen3"][0])
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(ConvertError, match="exists; the export writes a new folder"):
        to_hf(model, tmp_path / "taken")
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
