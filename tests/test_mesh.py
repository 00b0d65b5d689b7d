"""MeshConfig forms, -1 filling, the hybrid ICI × DCN layout, and every rejected mesh input."""

import os

import jax
import numpy as np
import pytest

from jaxpar.mesh import AXES, MeshConfig, MeshError, build_mesh, simulate_cpu_devices


def test_axis_order_is_physical_tensor_innermost():
    assert AXES == ("stage", "data", "fsdp", "expert", "sequence", "tensor")
    mesh = build_mesh("data=2,fsdp=2,tensor=2")
    assert mesh.axis_names == AXES
    ids = np.vectorize(lambda d: d.id)(mesh.devices).reshape(2, 2, 2)
    assert ids[0, 0].tolist() == [0, 1]  # tensor neighbours are adjacent devices


def test_parse_str_round_trip_and_fill():
    cfg = MeshConfig.parse("data=2, fsdp=-1, tensor=2")
    assert (cfg.data, cfg.fsdp, cfg.tensor) == (2, -1, 2)
    assert MeshConfig.parse(str(cfg)) == cfg
    assert cfg.resolve(8).fsdp == 2
    assert dict(build_mesh(cfg).shape) == {"stage": 1, "data": 2, "fsdp": 2, "expert": 1, "sequence": 1, "tensor": 2}


def test_hybrid_dcn_axis_is_outermost_within_its_axis():
    mesh = build_mesh(MeshConfig.parse("dcn.data=2,fsdp=2,tensor=2"))
    assert mesh.shape["data"] == 2 and mesh.shape["fsdp"] == 2 and mesh.shape["tensor"] == 2
    ids = np.vectorize(lambda d: d.id)(mesh.devices).reshape(2, 2, 2)
    # each simulated slice is a block of 4 consecutive devices; data crosses slices
    assert sorted(ids[0].ravel().tolist()) == [0, 1, 2, 3]
    assert sorted(ids[1].ravel().tolist()) == [4, 5, 6, 7]
    mixed = build_mesh(MeshConfig.parse("dcn.data=2,data=2,tensor=2"))
    ids = np.vectorize(lambda d: d.id)(mixed.devices).reshape(4, 2)
    assert sorted(ids[:2].ravel().tolist()) == [0, 1, 2, 3]  # data = dcn(2) × ici(2), dcn outer


@pytest.mark.parametrize(
    "spec, words",
    [
        ("data=2,fsdp=2,tensor=4", ["data=2", "fsdp=2", "tensor=4", "multiply to 16", "8 devices"]),
        ("data=-1,fsdp=-1", ["data=-1", "fsdp=-1", "only one axis may be -1"]),
        ("data=2,pipeline=2", ["unknown mesh axis 'pipeline'", "data, fsdp"]),
        ("data=0,fsdp=-1", ["data=0", "positive"]),
        ("tensor=-3", ["tensor=-3", "positive"]),
        ("data=two", ["data", "'two'", "not an integer"]),
        ("fsdp=3,tensor=-1", ["cannot fill tensor=-1", "multiply to 3", "8 devices"]),
        ("dcn.data=3,fsdp=-1", ["dcn", "3", "8 devices"]),
    ],
)
def test_bad_mesh_names_field_axis_and_numbers(spec, words):
    with pytest.raises(MeshError) as err:
        build_mesh(spec)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_unknown_axis_suggests_closest():
    with pytest.raises(MeshError, match=r"did you mean 'tensor'"):
        MeshConfig.parse("tensr=2")


def test_simulate_devices_after_start_refuses_other_count():
    assert jax.device_count() == 8
    simulate_cpu_devices(8)  # same count: fine
    with pytest.raises(MeshError, match=r"asked for 4 but JAX already started with 8"):
        simulate_cpu_devices(4)


def test_cpu_runtime_env_gives_each_simulated_device_threads(monkeypatch):
    """Collectives block pool threads; one thread per device deadlocked the fsdp × ring layout."""
    from jaxpar.mesh import THREADS_PER_SIMULATED_DEVICE, cpu_runtime_env

    monkeypatch.delenv("PJRT_NPROC", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_collective_timeout_seconds=7")
    cpu_runtime_env(32)
    assert int(os.environ["PJRT_NPROC"]) >= THREADS_PER_SIMULATED_DEVICE * 32
    flags = os.environ["XLA_FLAGS"].split()
    assert "--xla_cpu_collective_timeout_seconds=7" in flags  # the user's value is kept
    assert sum(f.startswith("--xla_cpu_collective_timeout_seconds") for f in flags) == 1
    monkeypatch.setenv("PJRT_NPROC", "4096")
    cpu_runtime_env(2)
    assert os.environ["PJRT_NPROC"] == "4096"  # never lowered


def test_stage_axis_builds_and_splits_the_layers_over_it():
    """``stage`` is a mesh axis like the others (outermost); the pp presets shard ``layers`` over it."""
    from jaxpar.meshes import get_mesh_preset

    mesh = build_mesh(MeshConfig.parse("stage=2,data=-1"))
    assert dict(mesh.shape) == {"stage": 2, "data": 4, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 1}
    assert get_mesh_preset("pp_3d").rules["layers"] == ("stage",)
    assert get_mesh_preset("3d").rules["layers"] == ()
