"""The run configuration: --set parsing, suggestions, JSON round trip, schedules. No devices needed."""
import dataclasses

import numpy as np
import pytest

from jaxpar.models import Remat
from jaxpar.rules import LayoutError
from jaxpar.train.config import (ConfigError, TrainConfig, apply_overrides, default_config, describe_fields,
                                 field_paths, from_dict, to_dict)
from jaxpar.train.optim import OptimizerConfig, make_schedule


def test_every_field_is_settable_and_parsed_by_type():
    cfg = apply_overrides(default_config("tiny"), [
        "optimizer.learning_rate=1e-3", "steps=7", "model.remat=dots", "optimizer.clip_norm=none",
        "checkpoint.async_save=false", "data.source=files", "model.sliding_window=32", "mesh=fsdp"])
    assert cfg.optimizer.learning_rate == 1e-3 and cfg.steps == 7 and cfg.model.remat is Remat.DOTS
    assert cfg.optimizer.clip_norm is None and cfg.checkpoint.async_save is False
    assert cfg.data.source == "files" and cfg.model.sliding_window == 32 and cfg.mesh == "fsdp"
    paths = field_paths()
    for must in ("model.embed_dim", "optimizer.schedule", "data.path", "log.profile_steps", "microbatches", "z_loss"):
        assert must in paths
    help_text = describe_fields()
    assert all(p in help_text for p in paths)


@pytest.mark.parametrize("item, message", [
    ("optimizer.learnig_rate=1", "did you mean optimizer.learning_rate"),
    ("learning_rate=1", "did you mean optimizer.learning_rate"),
    ("stepz=3", "did you mean steps"),
    ("steps=three", "steps=three: expected int"),
    ("model.remat=some", "expected one of none, full, dots, attn"),
    ("checkpoint.async_save=maybe", "expected true or false"),
    ("steps", "expected key=value"),
    ("model.rope_scaling.factor=2", "rope_scaling is None"),
])
def test_bad_overrides_name_the_field(item, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        apply_overrides(default_config("tiny"), [item])


def test_json_round_trip():
    cfg = apply_overrides(default_config("llama3-8b"), ["model.remat=attn", "optimizer.schedule=wsd"])
    back = from_dict(TrainConfig, to_dict(cfg))
    assert back == cfg


@pytest.mark.parametrize("fields, message", [
    (dict(seq=4096), "seq=4096 is longer than model.max_seq_len=1024"),
    (dict(batch=10, microbatches=4), "batch=10 is not divisible by microbatches=4"),
    (dict(steps=0), "steps=0 must be"),
    (dict(z_loss=-1.0), "z_loss=-1.0"),
    (dict(optimizer=OptimizerConfig(schedule="cosin")), "did you mean 'cosine'"),
    (dict(optimizer=OptimizerConfig(warmup_steps=-1)), "optimizer.warmup_steps=-1"),
])
def test_validate_names_the_field(fields, message):
    with pytest.raises(LayoutError, match=message):
        dataclasses.replace(default_config("tiny"), **fields).validate()


def test_schedules():
    lr = lambda **kw: np.array([float(make_schedule(OptimizerConfig(learning_rate=1.0, **kw), 100)(s))
                                for s in (0, 5, 10, 50, 79, 80, 90, 99, 100)])
    np.testing.assert_allclose(lr(schedule="constant", warmup_steps=10), [0, .5, 1, 1, 1, 1, 1, 1, 1], atol=1e-6)
    cosine = lr(schedule="cosine", warmup_steps=10, min_lr_ratio=0.1)
    np.testing.assert_allclose(cosine[:3], [0, .5, 1], atol=1e-6)
    assert cosine[3] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * 40 / 90)), rel=1e-5)
    assert cosine[-1] == pytest.approx(0.1, rel=1e-5)
    wsd = lr(schedule="wsd", warmup_steps=10, min_lr_ratio=0.0, decay_fraction=0.2)
    np.testing.assert_allclose(wsd, [0, .5, 1, 1, 1, 1, .5, 0.05, 0], atol=1e-6)
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
    cfg = default_config("tiny").model     # D64 L2 N8 K2 H8 F128, V256
    matmul = 2 * (64 * 8 * (2 * 8 + 2 * 2) + 3 * 64 * 128) + 256 * 64
    assert cfg.flops_per_token(128) == 6 * matmul + 6 * 2 * 8 * 8 * 128
