"""The inference boundary (``jaxpar.inference.unstack``): stacks become per-layer blocks with arrays of
their own and per-layer logical names, restacking gives the original state bit for bit, and every decode
layout places a layer as it placed that layer's row of the stack."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpar.inference.layouts import build_inference_mesh, placed_state, weight_layout
from jaxpar.inference.unstack import is_unstacked, restack, unstack
from jaxpar.models import build_model, get_model_preset

PRESETS = ("tiny", "tiny-moe", "tiny-deepseek")


def _variables(tree) -> dict:
    """{path: Variable} of a state."""
    flat = nnx.to_flat_state(tree)
    return {"/".join(map(str, path)): v for path, v in flat}


def _model(name: str):
    return build_model(get_model_preset(name), rngs=nnx.Rngs(0))


def _layer_views(layers: dict, prefix: str, rest: str, row, names):
    """[(the unstacked variable, what it must hold, its logical names)] for stacked row ``row`` (its
    names ``names``) of variable ``rest``: the row itself, and for an MLA's kv_b [Rkv, N, Hn + Hv] also the
    absorbed kv_k [N, Hn, Rkv] and kv_v [N, Rkv, Hv] (``jaxpar.layers.mla.absorb``)."""
    itself = [(layers[f"{prefix}/{rest}"], row, names)]
    if not rest.endswith("kv_b"):
        return itself
    base, (r, n, h) = rest[: -len("kv_b")], names
    k = layers[f"{prefix}/{base}kv_k"]
    hn = k[...].shape[1]
    return itself + [
        (k, None if row is None else np.einsum("rnh->nhr", row[..., :hn]), (n, h, r)),
        (layers[f"{prefix}/{base}kv_v"], None if row is None else np.einsum("rnh->nrh", row[..., hn:]), (n, r, h)),
    ]


@pytest.mark.parametrize("name", PRESETS)
def test_unstack_gives_each_layer_its_own_arrays_and_names(name):
    model = _model(name)
    flat = unstack(model)
    assert is_unstacked(flat) and not is_unstacked(model)
    assert flat.embed.embedding is not model.embed.embedding  # its own variables: placing them moves not model's
    stacked, layers = _variables(nnx.state(model)), _variables(nnx.state(flat))
    for stack in model.cache_stacks():
        blocks = getattr(flat, stack)
        depth = jax.tree.leaves(nnx.state(getattr(model, stack)))[0].shape[0]
        assert isinstance(blocks, nnx.List) and len(blocks) == depth
        for path, var in stacked.items():
            if not path.startswith(stack + "/"):
                continue
            names = var.get_metadata()["out_sharding"]
            rest = path[len(stack) + 1 :]
            buffers = set()
            for i in range(len(blocks)):
                for layer, row, want in _layer_views(layers, f"{stack}/{i}", rest, np.asarray(var[...])[i], names[1:]):
                    assert layer.get_metadata()["out_sharding"] == want, path
                    np.testing.assert_array_equal(np.asarray(layer[...]), row)
                    buffers.add(layer[...].unsafe_buffer_pointer())
            views = len(_layer_views(layers, f"{stack}/0", rest, None, names[1:]))
            assert len(buffers) == views * len(blocks) and var[...].unsafe_buffer_pointer() not in buffers, path


@pytest.mark.parametrize("name", PRESETS)
def test_restack_inverts_unstack_bit_for_bit(name):
    model = _model(name)
    back = restack(unstack(model))
    assert nnx.graphdef(back) == nnx.graphdef(model)
    want, got = _variables(nnx.state(model)), _variables(nnx.state(back))
    assert want.keys() == got.keys()
    for path, var in want.items():
        assert got[path].get_metadata() == var.get_metadata(), path
        assert got[path][...].dtype == var[...].dtype
        np.testing.assert_array_equal(np.asarray(got[path][...]), np.asarray(var[...]), err_msg=path)
    again = unstack(back)  # and the other way: unstack(restack(unstacked)) is the unstacked model
    assert nnx.graphdef(again) == nnx.graphdef(unstack(model))


@pytest.mark.parametrize(
    "name, mesh",
    [(n, m) for n in PRESETS for m in ("decode_tp", "decode_dp", "decode_ep") if (n, m) != ("tiny", "decode_ep")],
)  # decode_ep splits experts: the dense tiny has none
def test_decode_layouts_place_each_layer_as_its_row_of_the_stack(name, mesh):
    cfg = get_model_preset(name)
    mesh_name, built = build_inference_mesh(mesh, devices=jax.devices()[:2])
    layout = weight_layout(cfg, built, mesh_name)
    model = _model(name)
    stacked = _variables(placed_state(model, layout))
    layers = _variables(placed_state(unstack(model), layout))
    pad = lambda spec, n: tuple(spec) + (None,) * (n - len(spec))  # .spec drops trailing Nones
    for stack in model.cache_stacks():
        for path, var in stacked.items():
            if path.startswith(stack + "/"):
                spec = pad(var[...].sharding.spec, var[...].ndim)
                assert spec[0] is None, path
                by_name = dict(zip(var.get_metadata()["out_sharding"][1:], spec[1:]))
                for layer, _, names in _layer_views(layers, f"{stack}/0", path[len(stack) + 1 :], None, by_name):
                    got = pad(layer[...].sharding.spec, layer[...].ndim)
                    assert got == tuple(by_name[n] for n in names), path
