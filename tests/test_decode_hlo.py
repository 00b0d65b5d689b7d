"""The compiled decode step (issue 33): the unstacked model's step slices no layer out of a stacked array
and copies no weight, and XLA's cost analysis of it against weights + cache read + new entries.

Compiled from shapes alone (``jaxpar.analysis.copies.compile_decode``): tiny and llama-100m's shape, one
device, float32. The floor a step must move: every parameter read once, except the embedding table, of
which a step reads one row per sequence (llama-100m and tiny do not tie it to the LM head); every layer's
whole cache read (decode attends over all slots, masked); one position per sequence written per layer."""

import pytest

from jaxpar.analysis.copies import compile_decode, large_copies
from jaxpar.models import get_model_preset

SHAPES = {"tiny": (2, 64), "llama-100m": (1, 256)}  # batch, cache slots


@pytest.fixture(scope="module", params=list(SHAPES))
def step(request):
    batch, slots = SHAPES[request.param]
    return request.param, compile_decode(get_model_preset(request.param), batch=batch, slots=slots)


def test_no_weight_is_sliced_or_copied(step):
    """No weight-sized ``dynamic-slice`` (a layer out of a stack: unstacked, there is none) and no
    weight-sized ``copy`` of a model variable (XLA names the variable in its op_name)."""
    _, s = step
    found = large_copies(s.compiled.as_text(), min_elements=s.smallest_weight)
    assert [c for c in found if c.kind == "dynamic-slice"] == []
    assert [c for c in found if "state[" in c.op_name] == []


def test_the_cache_is_donated_and_updated_in_place(step):
    """Every layer's K and V arrays are aliased to the step's outputs (decode donates the cache)."""
    name, s = step
    header = s.compiled.as_text().split("\n", 1)[0]
    assert header.count("may-alias") + header.count("must-alias") == 2 * get_model_preset(name).num_layers


def test_no_weight_sized_copy_at_all(step, request):
    """No copy of anything as large as the smallest weight matrix. tiny's smallest weight (k: 64 × 2 × 8)
    is smaller than one layer's cache, and XLA:CPU transposes each layer's K and V cache [B, S, K, H] to
    [B, K, S, H] for the batched score product in every step."""
    name, s = step
    if name == "tiny":
        request.applymarker(pytest.mark.xfail(strict=True, reason="issue 33, next step: the cache transposes"))
    assert large_copies(s.compiled.as_text(), min_elements=s.smallest_weight) == []


def test_bytes_accessed_within_a_tenth_of_the_floor(step, request):
    """XLA's ``bytes accessed`` of one step ≤ 1.1 × the floor. Holds for llama-100m (measured 1.066). Not
    for tiny (measured 2.06): its per-layer cache transposes, its activations (comparable to its weights)
    and the embedding gather, which XLA counts as reading the whole table at batch 2."""
    name, s = step
    ratio = s.bytes_accessed / s.floor_bytes
    print(
        f"{name}: bytes accessed {s.bytes_accessed:.4g}; weights {s.weight_bytes:.4g} + cache {s.cache_bytes:.4g} "
        f"+ new {s.new_bytes:.4g} = {s.floor_bytes:.4g}; ratio {ratio:.3f}"
    )
    assert s.bytes_accessed >= s.weight_bytes + s.cache_bytes
    if name == "tiny":
        request.applymarker(pytest.mark.xfail(strict=True, reason="issue 33, next step: tiny's ratio is ~2"))
    assert ratio <= 1.1
