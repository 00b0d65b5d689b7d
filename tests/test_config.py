"""The run configuration: --set parsing, suggestions, JSON round trip (every preset keeps its family's
config class), string choices checked at construction, error classes, schedules. No devices needed."""

import dataclasses
import json

import numpy as np
import pytest

from jaxpar import errors
from jaxpar.data import DataConfig
from jaxpar.execution import ExecutionConfig
from jaxpar.layers import AttentionConfig, MoEConfig
from jaxpar.models import PRESETS, DenseConfig, MoEModelConfig, Remat, get_model_preset
from jaxpar.train.config import (
    ConfigError,
    TrainConfig,
    apply_overrides,
    default_config,
    describe_fields,
    field_paths,
    from_dict,
    to_dict,
)
from jaxpar.train.optim import OptimizerConfig, make_schedule


def test_every_field_is_settable_and_parsed_by_type():
    cfg = apply_overrides(
        default_config("tiny"),
        [
            "optimizer.learning_rate=1e-3",
            "steps=7",
            "execution.remat=dots",
            "optimizer.clip_norm=none",
            "checkpoint.async_save=false",
            "data.source=files",
            "model.sliding_window=32",
            "mesh=fsdp",
        ],
    )
    assert cfg.optimizer.learning_rate == 1e-3 and cfg.steps == 7 and cfg.execution.remat is Remat.DOTS
    assert cfg.optimizer.clip_norm is None and cfg.checkpoint.async_save is False
    assert cfg.data.source == "files" and cfg.model.sliding_window == 32 and cfg.mesh == "fsdp"
    paths = field_paths(TrainConfig)
    for must in ("model.embed_dim", "optimizer.schedule", "data.path", "log.profile_steps", "grad_accum", "z_loss"):
        assert must in paths
    help_text = describe_fields()
    assert all(p in help_text for p in paths)


@pytest.mark.parametrize(
    "item, message",
    [
        ("optimizer.learnig_rate=1", "did you mean optimizer.learning_rate"),
        ("learning_rate=1", "did you mean optimizer.learning_rate"),
        ("stepz=3", "did you mean steps"),
        ("steps=three", "steps=three: expected int"),
        ("execution.remat=some", "--set execution.remat='some': choose one of none, full, dots, attn"),
        ("model.remat=full", "--set model.remat: moved: execution settings left the model config; use execution.remat"),
        (
            "model.moe.capacity_factor=2",
            "moved: execution settings left the model config; use execution.capacity_factor",
        ),
        ("checkpoint.async_save=maybe", "expected true or false"),
        ("steps", "expected PATH=VALUE"),
        ("model.rope_scaling.factor=2", "rope_scaling is None"),
    ],
)
def test_bad_overrides_name_the_field(item, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        apply_overrides(default_config("tiny"), [item])


def test_json_round_trip():
    cfg = apply_overrides(default_config("llama3-8b"), ["execution.remat=attn", "optimizer.schedule=wsd"])
    back = from_dict(TrainConfig, to_dict(cfg))
    assert back == cfg


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_round_trips_through_json_with_its_class(preset):
    cfg = default_config(preset)
    data = json.loads(json.dumps(to_dict(cfg)))
    assert data["model"]["class"] == type(cfg.model).__name__
    back = from_dict(TrainConfig, data)
    assert back == cfg and type(back.model) is type(cfg.model)


def test_set_keeps_the_family_and_reaches_its_fields():
    cfg = apply_overrides(
        default_config("tiny-deepseek"),
        ["model.moe.top_k=1", "model.mla.kv_lora_rank=8", "model.moe.router=softmax", "execution.dtype=bfloat16"],
    )
    assert type(cfg.model) is MoEModelConfig and cfg.model.moe.top_k == 1 and cfg.model.mla.kv_lora_rank == 8
    assert cfg.model.moe.router == "softmax" and cfg.execution.dtype == "bfloat16"
    assert from_dict(TrainConfig, json.loads(json.dumps(to_dict(cfg)))) == cfg
    with pytest.raises(ConfigError, match=r"--set model\.moe\.top_k: unknown field"):
        apply_overrides(default_config("tiny"), ["model.moe.top_k=1"])


def test_untagged_model_data_is_read_by_its_fields():
    """config.json written before the class tag: the smallest config class that has every key."""
    for preset in ("tiny", "tiny-moe"):
        data = to_dict(get_model_preset(preset))
        assert type(from_dict(DenseConfig, data)) is type(get_model_preset(preset))
    with pytest.raises(ConfigError, match=r"model\.class='Nope'"):
        from_dict(DenseConfig, {"class": "Nope"}, where="model")
    with pytest.raises(ConfigError, match="unknown field"):
        from_dict(DenseConfig, {**to_dict(get_model_preset("tiny")), "colour": 1})


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: ExecutionConfig(context_parallel="rings"), "execution.context_parallel='rings'"),
        (lambda: ExecutionConfig(cp_order="zag"), "execution.cp_order='zag'"),
        (lambda: ExecutionConfig(dtype="float8"), "execution.dtype='float8'"),
        (lambda: get_model_preset("tiny", param_dtype="int8"), "model.param_dtype='int8'"),
        (lambda: ExecutionConfig(attention_impl="flash"), "execution.attention_impl='flash'"),
        (lambda: ExecutionConfig(remat="some"), "execution.remat='some'"),
        (lambda: MoEConfig(num_experts=4, top_k=2, mlp_dim=8, router="topk"), "model.moe.router='topk'"),
        (lambda: OptimizerConfig(schedule="cosin"), "optimizer.schedule='cosin'"),
        (lambda: DataConfig(source="web"), "data.source='web'"),
        (lambda: DataConfig(dtype="int64"), "data.dtype='int64'"),
        (lambda: dataclasses.replace(default_config("tiny"), nonfinite="ignore"), "nonfinite='ignore'"),
        (lambda: AttentionConfig(8, 2, 2, 4, context_parallel="x"), "execution.context_parallel='x'"),
    ],
)
def test_choices_are_enums_checked_when_built(make, field):
    with pytest.raises(ConfigError, match=field + ": choose one of"):
        make()
    with pytest.raises(ConfigError, match=r"did you mean 'cosine'\?"):
        OptimizerConfig(schedule="cosin")


def test_choices_parse_into_their_enums():
    cfg = apply_overrides(
        default_config("tiny-moe"),
        ["execution.context_parallel=ring", "nonfinite=skip", "optimizer.schedule=wsd", "data.source=files"],
    )
    for value in (
        cfg.execution.context_parallel,
        cfg.model.moe.router,
        cfg.nonfinite,
        cfg.optimizer.schedule,
        cfg.data.source,
        cfg.execution.dtype,
        cfg.execution.cp_order,
    ):
        assert type(value).__mro__[1].__name__ == "Choice", value


def test_an_moe_model_needs_its_moe_config():
    dense = dataclasses.asdict(get_model_preset("tiny"))
    with pytest.raises(TypeError, match="moe"):
        MoEModelConfig(**dense)
    with pytest.raises(ConfigError, match=r"model\.moe: an MoE model needs its MoEConfig"):
        MoEModelConfig(**dense, moe=None)


def test_error_classes_say_what_they_are():
    assert not issubclass(errors.NonFiniteError, errors.LayoutError)
    assert not issubclass(errors.LaunchError, errors.MeshError)
    assert not issubclass(errors.ConfigError, errors.LayoutError)
    for name in (
        "ConfigError",
        "MeshError",
        "LayoutError",
        "DataError",
        "CheckpointError",
        "ConvertError",
        "LaunchError",
        "NonFiniteError",
        "NoLayoutError",
    ):
        assert issubclass(getattr(errors, name), errors.JaxparError), name


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(seq=4096), "seq=4096 is longer than model.max_seq_len=1024"),
        (dict(batch=10, grad_accum=4), "batch=10 is not divisible by grad_accum=4"),
        (dict(steps=0), "steps=0 must be"),
        (dict(z_loss=-1.0), "z_loss=-1.0"),
        (dict(optimizer=OptimizerConfig(warmup_steps=-1)), "optimizer.warmup_steps=-1"),
    ],
)
def test_validate_names_the_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(default_config("tiny"), **fields).validate()


def test_schedules():
    lr = lambda **kw: np.array(
        [
            float(make_schedule(OptimizerConfig(learning_rate=1.0, **kw), 100)(s))
            for s in (0, 5, 10, 50, 79, 80, 90, 99, 100)
        ]
    )
    np.testing.assert_allclose(lr(schedule="constant", warmup_steps=10), [0, 0.5, 1, 1, 1, 1, 1, 1, 1], atol=1e-6)
    cosine = lr(schedule="cosine", warmup_steps=10, min_lr_ratio=0.1)
    np.testing.assert_allclose(cosine[:3], [0, 0.5, 1], atol=1e-6)
    assert cosine[3] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * 40 / 90)), rel=1e-5)
    assert cosine[-1] == pytest.approx(0.1, rel=1e-5)
    wsd = lr(schedule="wsd", warmup_steps=10, min_lr_ratio=0.0, decay_fraction=0.2)
    np.testing.assert_allclose(wsd, [0, 0.5, 1, 1, 1, 1, 0.5, 0.05, 0], atol=1e-6)
    with pytest.raises(ValueError, match="needs the run's total steps"):
        make_schedule(OptimizerConfig(schedule="cosine"), None)


def test_peak_flops_and_throughput():
    from jaxpar.train.metrics import peak_flops, throughput

    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12 and peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA B200") == 2250e12 and peak_flops("TPU v5 lite") == 197e12
    assert peak_flops("TPU v5p") == 459e12 and peak_flops("TPU v6 lite") == 918e12
    assert peak_flops("cpu") is None and peak_flops("NVIDIA A100-SXM4-80GB") is None
    t = throughput(tokens=1000, seconds=2.0, flops_per_token=4e12, num_devices=2, device_kind="NVIDIA H200")
    assert t["tokens_per_s"] == 500 and t["tflops_per_device"] == 1000 and t["mfu"] == pytest.approx(1000e12 / 989e12)
    assert "mfu" not in throughput(tokens=1, seconds=1, flops_per_token=1, num_devices=1, device_kind="cpu")


def test_flops_per_token_by_hand():
    cfg = default_config("tiny").model  # D64 L2 N8 K2 H8 F128, V256
    matmul = 2 * (64 * 8 * (2 * 8 + 2 * 2) + 3 * 64 * 128) + 256 * 64
    assert cfg.flops_per_token(128) == 6 * matmul + 6 * 2 * 8 * 8 * 128
