"""Where model, batch and mesh meet: divisibility, kv-head replication, unknown presets."""

import pytest

from jaxpar.errors import ConfigError
from jaxpar.layout import make_layout
from jaxpar.meshes import get_mesh_preset, resolve_mesh_arg
from jaxpar.models import get_model_preset
from jaxpar.rules import LayoutError, Rules

TINY = get_model_preset("tiny")


def _fails(model, mesh, *, batch=8, seq=16):
    with pytest.raises(LayoutError) as err:
        make_layout(model, resolve_mesh_arg(mesh), batch=batch, seq=seq)
    return str(err.value)


def test_heads_not_divisible_by_tensor():
    msg = _fails(get_model_preset("tiny", num_heads=6, num_kv_heads=2), "fsdp=2,tensor=4")
    for word in ("model.num_heads=6", "'heads'", "tensor=4"):
        assert word in msg, msg


def test_kv_heads_fewer_than_tensor_are_replicated():
    layout = make_layout(TINY, get_mesh_preset("tp"), batch=8, seq=16)  # kv_heads=2 < tensor=8
    assert layout.rules["kv_heads"] == () and layout.rules["act_kv_heads"] == ()
    assert layout.rules["heads"] == ("tensor",)
    sharded = make_layout(TINY, get_mesh_preset("fsdp_tp"), batch=8, seq=16)  # 2 kv heads over tensor=2
    assert sharded.rules["kv_heads"] == ("tensor",)


def test_kv_heads_that_neither_divide_nor_replicate():
    msg = _fails(get_model_preset("tiny", num_heads=12, num_kv_heads=3, mlp_dim=128), "fsdp=4,tensor=2")
    for word in ("model.num_kv_heads=3", "'kv_heads'", "tensor=2", "replicated only when"):
        assert word in msg, msg


def test_batch_not_divisible_by_data_times_fsdp():
    msg = _fails(TINY, "hsdp", batch=6)
    for word in ("batch=6", "'batch'", "data=2", "fsdp=4", "= 8"):
        assert word in msg, msg


def test_sequence_not_divisible_under_sequence_parallel_tp():
    msg = _fails(TINY, "tp", seq=12)
    assert "seq=12" in msg and "'length'" in msg and "tensor=8" in msg, msg


def test_vocab_is_padded_to_a_shardable_multiple():
    cfg = get_model_preset("tiny", vocab_size=250)
    assert cfg.padded_vocab == 256
    make_layout(cfg, get_mesh_preset("tp"), batch=8, seq=16)  # 256 divides tensor=8


def test_idle_mesh_axis_is_refused():
    """A preset's rules on a mesh with an axis they never use (here: dp's rules with tensor=2)."""
    import dataclasses

    from jaxpar.mesh import MeshConfig

    preset = dataclasses.replace(get_mesh_preset("dp"), mesh=MeshConfig.parse("data=4,tensor=2"))
    with pytest.raises(LayoutError) as err:
        make_layout(TINY, preset, batch=8, seq=16)
    assert "tensor=2" in str(err.value) and "no rule" in str(err.value), str(err.value)


@pytest.mark.parametrize("name, closest", [("fsdp-tp", "fsdp_tp"), ("hsd", "hsdp"), ("3D", "3d")])
def test_unknown_mesh_preset_suggests_closest(name, closest):
    with pytest.raises(LayoutError, match=rf"unknown mesh preset '{name}' \(did you mean '{closest}'\?\)"):
        get_mesh_preset(name)


def test_unknown_model_preset_suggests_closest():
    with pytest.raises(ConfigError, match=r"unknown model preset 'llama3-8' \(did you mean 'llama3-8b'\?\)"):
        get_model_preset("llama3-8")


def test_rule_tables_are_complete():
    with pytest.raises(LayoutError, match="missing"):
        Rules.from_mapping("partial", {"batch": "data"})
