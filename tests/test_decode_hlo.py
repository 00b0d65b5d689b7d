"""The compiled decode step (issue 33): the unstacked model's step slices no layer out of a stacked array,
copies no weight and no cache, writes its cache in place, and moves within a tenth of the bytes it must.

Compiled from shapes alone (``jaxpar.analysis.copies.compile_decode``: the generator's own decode program,
one device, float32, nothing the size of the model allocated), for a dense model (llama-100m's shape),
an MoE (qwen3-30b-a3b's, two layers) and an MLA + MoE model (deepseek-v3's, two layers, one dense).
The floor a step must move: every parameter read once, except the embedding table, of which a step reads
one row per sequence (none of these ties it to the LM head), and an MLA's kv_b, which only prefill reads
(decode reads its halves, kept in the absorbed layouts); every layer's whole cache read (decode
attends over all slots, masked); one position per sequence written per layer; and what the sampler moves
compiled alone on the step's logits. Each stands against a mutation: the same step on the stacked model
(layers sliced out of the stacks inside the step) must be caught. The paged engine's step (GQA and MLA
pools) gathers no row's whole cache and copies none, against the mutation that gathers every page first."""

import functools
import math
import re

import pytest

from jaxpar.analysis.copies import cache_copies, compile_decode, large_copies
from jaxpar.layers import kvcache
from jaxpar.models import get_model_preset

CASES = {  # name: (preset, overrides, batch, cache slots)
    "tiny-b1": ("tiny", {}, 1, 64),
    "llama-100m-b1": ("llama-100m", {}, 1, 256),
    "llama-100m-b4": ("llama-100m", {}, 4, 256),
    "qwen3-30b-a3b-2l-b1": ("qwen3-30b-a3b", {"num_layers": 2}, 1, 256),
    "deepseek-v3-2l-b1": ("deepseek-v3", {"num_layers": 2, "first_dense_layers": 1}, 1, 256),
}
MOVED_BOUND = 1.1  # bytes moved ≤ 1.1 × the floor (issue 33)
PREFILLED = ("llama-100m-b1", "deepseek-v3-2l-b1")  # their prefill of 128 tokens is compiled too
SHAPED = [c for c in CASES if not c.startswith("tiny")]  # tiny's floor (~0.4 MB) is per-op overhead


def _cfg(case: str):
    preset, overrides, _, _ = CASES[case]
    return get_model_preset(preset, **overrides)


@functools.cache
def _compiled(case: str):
    """The case's decode step, compiled once for every test that reads it."""
    _, _, batch, slots = CASES[case]
    return compile_decode(_cfg(case), batch=batch, slots=slots, prefill_of=128 if case in PREFILLED else None)


@pytest.fixture(params=list(CASES))
def step(request):
    return request.param, _compiled(request.param)


def _weight_copies(s) -> list:
    """Copies and dynamic-slices as large as the smallest weight matrix."""
    return large_copies(s.compiled.as_text(), min_elements=s.smallest_weight)


def test_no_weight_is_sliced_or_copied(step):
    """No copy or dynamic-slice as large as a weight matrix: no layer sliced out of a stack, no weight
    laid out anew (MoE's experts, MLA's kv_b halves)."""
    _, s = step
    assert _weight_copies(s) == []


def test_no_cache_is_copied(step):
    """No copy of a whole cache array in any layout (a [B, S, K, H] cache was transposed for the
    attention products in every step)."""
    _, s = step
    assert cache_copies(large_copies(s.compiled.as_text(), min_elements=2), s.cache_shapes) == []


def test_prefill_copies_no_weight():
    """Prefill of a 128-token prompt reads the weights as they lie too: for the dense model no copy, slice
    or dynamic-slice as large as a weight matrix; for the MLA + MoE model none of a weight outside the
    experts (an MLA prefill reads kv_b, not the absorbed halves). The experts are left out: XLA:CPU
    lowers prefill's ``ragged_dot`` by laying every expert's weights out anew."""
    dense = _compiled("llama-100m-b1")
    assert large_copies(dense.prefill.as_text(), min_elements=dense.smallest_weight) == []
    mla = _compiled("deepseek-v3-2l-b1")
    found = large_copies(mla.prefill.as_text(), min_elements=mla.smallest_weight)
    named = [c for c in found if "state[" in c.op_name]
    assert [c for c in named if "moe'" not in c.op_name.replace("\\", "")] == []


def test_the_stacked_model_is_caught():
    """The mutation: the same step on the stacked model (each layer sliced out of its stack inside the
    step) copies every layer's weights, and its bytes break the bound."""
    cfg = _cfg("llama-100m-b1")
    s = compile_decode(cfg, batch=1, slots=256, unstacked=False)
    weight = _compiled("llama-100m-b1").smallest_weight  # a stack's norms are 2-D: not weights
    found = large_copies(s.compiled.as_text(), min_elements=weight)
    assert len(found) >= cfg.num_layers, found
    assert s.bytes_moved / (s.floor_bytes + s.sampler_bytes) > MOVED_BOUND


def test_writing_without_the_dependency_is_caught(monkeypatch):
    """The mutation: without ``after`` (the write made to wait for the attention that reads the cache)
    XLA:CPU keeps a copy of every layer's cache to write into."""
    monkeypatch.setattr(kvcache, "after", lambda x, done: x)
    s = compile_decode(_cfg("llama-100m-b1"), batch=1, slots=256)
    assert len(cache_copies(large_copies(s.compiled.as_text(), min_elements=2), s.cache_shapes)) >= 2


def test_the_cache_is_donated_and_updated_in_place(step):
    """Every layer's cache arrays are aliased to the step's outputs (decode donates the cache)."""
    name, s = step
    header = s.compiled.as_text().split("\n", 1)[0]
    assert header.count("may-alias") + header.count("must-alias") == 2 * _cfg(name).num_layers


@pytest.mark.parametrize("case", SHAPED)
def test_bytes_moved_within_a_tenth_of_the_floor(case):
    """XLA's bytes accessed of one step (scatters into the donated cache and gathers of embedding rows
    counted as what they move: ``cost_overcount``) ≤ 1.1 × the floor plus the sampler."""
    s = _compiled(case)
    floor = s.floor_bytes + s.sampler_bytes
    ratio = s.bytes_moved / floor
    print(
        f"{case}: XLA {s.bytes_accessed:.4g}, moved {s.bytes_moved:.4g}; weights {s.weight_bytes:.4g} + cache "
        f"{s.cache_bytes:.4g} + new {s.new_bytes:.4g} + sampler {s.sampler_bytes:.4g} = {floor:.4g}; {ratio:.3f}"
    )
    assert s.bytes_moved >= s.weight_bytes + s.cache_bytes
    assert ratio <= MOVED_BOUND


# ---------------------------------------------------------------------------------- the paged engine
def _engine_step_text(preset: str, features=None) -> tuple[str, tuple[int, ...], int]:
    """The paged engine's decode step (``preset``, 4 slots of 2048 positions, pages of 16: a cache large
    enough to be read in several blocks, ``pages_per_step``) compiled: (its HLO, one row-gathered dense
    cache's dims, [B, W·page, K, H] or an MLA latent's [B, W·page, R], its number of pool arrays)."""
    import numpy as np
    from flax import nnx

    from jaxpar.inference import logprobs
    from jaxpar.inference.engine import Engine
    from jaxpar.inference.sampling import SamplingParams
    from jaxpar.models import build_model

    cfg = get_model_preset(preset)
    engine = Engine(build_model(cfg, rngs=nnx.Rngs(0)), max_slots=4, max_length=2048, page_size=16)
    m, b = engine.models["target"], engine.slots
    host = (
        np.zeros((b, 1), np.int32),
        np.full((b, 1), 40, np.int32),
        np.arange(b * engine.width, dtype=np.int32).reshape(b, engine.width) + 1,
        np.zeros(b, np.int32),
        SamplingParams.greedy(b),
        logprobs.StepExtras.build([], b, 1, engine.max_length),
        np.zeros(b, np.int32),  # every row on the base model (no adapter bank)
    )
    program = engine._program("target", 1, False, features or logprobs.Features())
    text = program.lower(m.state, m.pools, *host).compile().as_text()
    row = (cfg.mla.kv_lora_rank,) if cfg.uses_mla else (cfg.num_kv_heads, cfg.head_dim)
    return text, (b, engine.max_length, *row), 2 * cfg.num_layers


def _cache_sized_copies(text: str, gathered: tuple[int, ...]) -> list:
    """Gathers and copies as large as a row-gathered cache, in any shape (pages stay a dim): every row's
    pages gathered at once, or laid out anew."""
    return large_copies(text, min_elements=math.prod(gathered), kinds=("copy", "gather"))


@pytest.mark.parametrize("preset", ["tiny", "tiny-deepseek"])
def test_the_engine_reads_its_pages_where_they_lie(preset):
    """The engine's step (GQA and MLA pools) attends over each row's pages a block of page columns at a
    time: no gather or copy as large as a row-gathered dense cache (so none of a pool either), and every
    pool updated in place (donated)."""
    text, gathered, pools = _engine_step_text(preset)
    assert _cache_sized_copies(text, gathered) == []
    header = text.split("\n", 1)[0]
    assert header.count("may-alias") + header.count("must-alias") == pools


def _gqa_gathered_first(q, cache, positions, window):
    """The mutation for GQA: every page of a row gathered at once and laid out as the dense cache."""
    import jax.numpy as jnp

    from jaxpar.parallel import decode

    b, slots = cache.table.shape[0], cache.table.shape[1] * cache.v.shape[2]
    kv, h = cache.k.shape[1:3]
    keys = jnp.einsum("bwkhp->bkhwp", cache.k[cache.table]).reshape(b, kv, h, slots)
    values = jnp.einsum("bwkph->bkwph", cache.v[cache.table]).reshape(b, kv, slots, h)
    held = jnp.arange(slots)[None, :] < decode.first_positions(positions)[:, None]
    values = jnp.where(held[:, None, :, None], values, 0)
    scores = jnp.einsum("bkgth,bkhs->bkgts", q, keys) * q.shape[-1] ** -0.5
    ok = decode.old_visible(positions, 0, slots, slots, window)[:, None, None]
    return decode.block(scores, ok, values, "bkgts,bksh->bkgth")


def _mla_gathered_first(ql, qr, cache, positions, scale):
    """The mutation for MLA: every page of a row gathered at once into the dense cache's layout."""
    import jax.numpy as jnp

    from jaxpar.parallel import decode

    b = cache.table.shape[0]
    c, kr = (p[cache.table].reshape(b, -1, p.shape[-1]) for p in (cache.latent, cache.rope_key))
    slots = c.shape[1]
    c = jnp.where((jnp.arange(slots)[None, :] < decode.first_positions(positions)[:, None])[..., None], c, 0)
    ok = decode.old_visible(positions, 0, slots, slots, None)[:, None]
    return decode.block(kvcache._mla_scores(ql, qr, c, kr, scale), ok, c, "bnts,bsr->bntr")


@pytest.mark.parametrize(
    "preset,name,mutation",
    [("tiny", "_gqa_pages", _gqa_gathered_first), ("tiny-deepseek", "_mla_pages", _mla_gathered_first)],
)
def test_gathering_every_page_first_is_caught(preset, name, mutation, monkeypatch):
    """The mutation: every page of a row gathered first into a dense cache (then attended as one block)
    gathers (or lays out anew) a row-sized cache in every layer in every step."""
    monkeypatch.setattr(kvcache, name, mutation)
    text, gathered, pools = _engine_step_text(preset)
    assert len(_cache_sized_copies(text, gathered)) >= pools // 2  # two pools a layer


# ------------------------------------------------------------------------------------ no conditional
def _conditionals(text: str) -> int:
    """``conditional`` instructions in an optimized HLO text. On a GPU each reads its predicate back to
    the host, which waits there for the step's forward and splits XLA's command buffer."""
    return len(re.findall(r"= \S+ conditional\(", text))


def test_the_decode_step_runs_no_conditional(step):
    """The generator's step, greedy (the one every case compiles) and sampling, holds no conditional."""
    case, s = step
    assert _conditionals(s.compiled.as_text()) == 0
    if case == "tiny-b1":
        _, _, batch, slots = CASES[case]
        sampled = compile_decode(_cfg(case), batch=batch, slots=slots, draws=True)
        assert _conditionals(sampled.compiled.as_text()) == 0


def test_a_conditional_sampler_is_caught(monkeypatch):
    """The mutation: the sampler choosing greedy or drawing with a ``lax.cond`` at run time."""
    import jax
    import jax.numpy as jnp

    from jaxpar.inference import generate, sampling

    def choosing(logits, params, positions, *, draws):
        greedy = lambda: jnp.argmax(logits, -1).astype(jnp.int32)
        drawn = lambda: sampling.sample(logits, params, positions, draws=True)
        return jax.lax.cond(jnp.all(params.temperature == 0), greedy, drawn)

    monkeypatch.setattr(generate, "sample", choosing)
    _, _, batch, slots = CASES["tiny-b1"]
    assert _conditionals(compile_decode(_cfg("tiny-b1"), batch=batch, slots=slots).compiled.as_text()) == 1


def test_the_engine_step_runs_no_conditional():
    """The engine's step with every feature on (sampling, penalties, token and prompt log-probs) holds no
    conditional, nor does its greedy step."""
    from jaxpar.inference.logprobs import Features

    for features in (Features(), Features(True, True, True, True)):
        text, _, _ = _engine_step_text("tiny", features)
        assert _conditionals(text) == 0
