"""Run identity (``jaxpar.identity``): every model field of every family is part of it (the execution
settings are not model fields); the data stream must match on resume; saved arrays are checked against the abstract
model from checkpoint metadata. Refusals name every differing field. No training step is compiled here:
the checkpoints are written from abstractly-shaped zeros. The end-to-end refusals (exit status 2, files
untouched) are in tests/test_bad_input.py."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxpar.checkpoint import Checkpointer
from jaxpar.config import to_dict
from jaxpar.errors import CheckpointError
from jaxpar.execution import MOVED_FROM_MODEL, ExecutionConfig, split_saved_model
from jaxpar.identity import (
    Entry,
    abstract_arrays,
    array_differences,
    check_fits,
    model_differences,
    saved_arrays,
)
from jaxpar.layers import MoEConfig, RopeScaling
from jaxpar.models import DenseConfig, build_model, get_model_preset
from jaxpar.train.config import apply_overrides, default_config

MODELS = ("tiny", "tiny-moe", "tiny-deepseek")


def data(cfg):
    return to_dict(cfg, DenseConfig)


def changed(preset: str, *overrides: str):
    return apply_overrides(default_config(preset), list(overrides)).model


def run(preset: str, *overrides: str):
    return apply_overrides(default_config(preset), list(overrides))


# One case per family and per kind of field: sizes, choices, flags, floats, nested configs, the family.
REFUSED = [
    ("tiny", ["model.embed_dim=32"], ["model.embed_dim: saved 64, now 32"]),
    ("tiny", ["model.rope_theta=500000"], ["model.rope_theta: saved 10000.0, now 500000.0"]),
    (
        "tiny",
        ["model.qk_norm=true", "model.sliding_window=8"],
        ["model.qk_norm: saved false, now true", "model.sliding_window: saved null, now 8"],
    ),
    ("tiny", ["model.param_dtype=bfloat16"], ['model.param_dtype: saved "float32", now "bfloat16"']),
    ("tiny-moe", ["model.moe.num_experts=8"], ["model.moe.num_experts: saved 4, now 8"]),
    ("tiny-moe", ["model.moe.top_k=1"], ["model.moe.top_k: saved 2, now 1"]),
    ("tiny-moe", ["model.moe.router=sigmoid"], ['model.moe.router: saved "softmax", now "sigmoid"']),
    ("tiny-moe", ["model.moe.norm_topk=false"], ["model.moe.norm_topk: saved true, now false"]),
    ("tiny-deepseek", ["model.first_dense_layers=0"], ["model.first_dense_layers: saved 1, now 0"]),
    ("tiny-deepseek", ["model.mla.kv_lora_rank=8"], ["model.mla.kv_lora_rank: saved 16, now 8"]),
    ("tiny-deepseek", ["model.mla.rope_interleave=false"], ["model.mla.rope_interleave: saved true, now false"]),
    (
        "tiny-deepseek",
        ["model.moe.routed_scale=1.0", "model.moe.topk_groups=4"],
        ["model.moe.topk_groups: saved 2, now 4", "model.moe.routed_scale: saved 2.5, now 1.0"],
    ),
]


@pytest.mark.parametrize("preset, overrides, lines", REFUSED, ids=[" ".join(c[1]) for c in REFUSED])
def test_every_model_field_is_identity(preset, overrides, lines):
    assert model_differences(data(get_model_preset(preset)), data(changed(preset, *overrides))) == lines


def test_nested_config_and_family_changes_are_listed():
    saved = data(get_model_preset("tiny"))
    now = dataclasses.replace(get_model_preset("tiny"), rope_scaling=RopeScaling(factor=4.0))
    (line,) = model_differences(saved, data(now))
    assert line.startswith('model.rope_scaling: saved null, now {"class": "RopeScaling", "factor": 4.0')
    lines = model_differences(saved, data(get_model_preset("tiny-moe")))
    assert lines[0] == 'model.class: saved "DenseConfig", now "MoEModelConfig"'
    assert any(line.startswith("model.moe: saved (absent), now {") for line in lines)


@pytest.mark.parametrize("preset", MODELS)
def test_execution_settings_may_change(preset):
    sets = [
        "execution.remat=dots",
        "execution.dtype=bfloat16",
        "execution.attention_impl=xla",
        "execution.context_parallel=ring",
        "execution.cp_order=contiguous",
        "execution.loss_chunks=2",
    ]
    if preset != "tiny":
        sets += [
            "execution.capacity_factor=none",
            "execution.aux_loss_weight=0.1",
            "execution.router_z_loss_weight=0",
            "execution.bias_update_rate=0.01",
        ]
        assert {s.split("=")[0] for s in sets} == {f"execution.{f.name}" for f in dataclasses.fields(ExecutionConfig)}
    now = run(preset, *sets)
    assert now.execution != default_config(preset).execution
    assert model_differences(data(get_model_preset(preset)), data(now.model)) == []


@pytest.mark.parametrize("preset", MODELS)
def test_a_config_saved_with_execution_settings_under_model_is_the_same_model(preset):
    """Runs saved before the execution settings left the model config hold them under ``model``."""
    saved = data(get_model_preset(preset))
    saved |= {"remat": "dots", "dtype": "bfloat16", "attention_impl": None, "context_parallel": "ring"}
    saved |= {"cp_order": "contiguous"}
    if preset != "tiny":
        saved["moe"] = saved["moe"] | dict(capacity_factor=None, aux_loss_weight=0.1, bias_update_rate=0.01)
        saved["moe"] |= {"router_z_loss_weight": 0.0}
    assert {k for k in MOVED_FROM_MODEL if "." not in k} <= set(saved)
    assert model_differences(saved, data(get_model_preset(preset))) == []
    model, execution = split_saved_model(saved)
    assert model == data(get_model_preset(preset))  # the caller's data is left as it was
    assert saved["remat"] == "dots" and ExecutionConfig(**execution).context_parallel == "ring"
    if preset != "tiny":
        assert execution["capacity_factor"] is None and execution["bias_update_rate"] == 0.01


def test_an_untagged_config_from_before_the_class_tag_is_compared_by_its_fields():
    saved = {k: v for k, v in data(get_model_preset("tiny-moe")).items() if k != "class"}
    assert model_differences(saved, data(get_model_preset("tiny-moe"))) == []
    with pytest.raises(CheckpointError, match="cannot be read by this version of jaxpar"):
        model_differences({**saved, "mla": {"embed_dim": 64}}, data(get_model_preset("tiny-moe")))


# ------------------------------------------------------------------------------- arrays from metadata
@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A model checkpoint of tiny-moe (state of zeros with the abstract model's shapes)."""
    abstract = nnx.state(nnx.eval_shape(lambda: build_model(get_model_preset("tiny-moe"), rngs=nnx.Rngs(0))))
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract)
    directory = tmp_path_factory.mktemp("model") / "checkpoints"
    checkpoints = Checkpointer(directory, every=1, keep=1, async_save=False)
    checkpoints.save(
        0,
        state=zeros,
        data={},
        config={"format": "jaxpar-model", "model": data(get_model_preset("tiny-moe"))},
        force=True,
    )
    checkpoints.close()
    return directory, abstract


def abstract_of(cfg):
    return nnx.state(nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0))))


def test_saved_arrays_are_read_from_metadata_and_match_the_abstract_model(saved_model):
    directory, abstract = saved_model
    saved = saved_arrays(directory, 0)
    assert saved == abstract_arrays(abstract)
    assert saved["moe_blocks/moe/gate_up"] == ((2, 4, 64, 2, 64), "float32")
    assert saved["moe_blocks/moe/router_bias"] == ((2, 4), "float32")  # state, not a parameter


def test_array_differences_name_each_array(saved_model):
    directory, _ = saved_model
    cfg = changed("tiny-moe", "model.moe.num_experts=8", "model.param_dtype=bfloat16")
    lines = array_differences(saved_arrays(directory, 0), abstract_arrays(abstract_of(cfg)))
    assert "moe_blocks/moe/gate_up: saved float32[2, 4, 64, 2, 64], now bfloat16[2, 8, 64, 2, 64]" in lines
    with pytest.raises(CheckpointError, match="its arrays do not fit the model its config describes") as err:
        check_fits(
            Entry.LOAD,
            saved_config=None,
            step=0,
            where=directory.parent,
            checkpoints=directory,
            abstract=abstract_of(cfg),
        )
    assert "moe_blocks/moe/router: saved float32[2, 64, 4], now float32[2, 64, 8]" in str(err.value)


def test_init_from_refuses_another_model_and_accepts_execution_changes(saved_model):
    directory, _ = saved_model
    saved = data(get_model_preset("tiny-moe"))
    kw = dict(step=0, where=directory.parent, checkpoints=directory)
    ok = changed("tiny-moe", "execution.capacity_factor=none", "execution.remat=none")
    check_fits(Entry.INIT_FROM, saved_config=saved, current=data(ok), abstract=abstract_of(ok), **kw)
    bad = changed("tiny-moe", "model.moe.top_k=1")
    with pytest.raises(
        CheckpointError,
        match=r"its model is not the one this run asks for:\n"
        r"  model\.moe\.top_k: saved 2, now 1\n",
    ):
        check_fits(Entry.INIT_FROM, saved_config=saved, current=data(bad), abstract=abstract_of(bad), **kw)


def test_moe_config_without_experts_is_not_a_model():
    with pytest.raises(TypeError):
        MoEConfig(top_k=2, mlp_dim=8)
