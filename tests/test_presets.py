"""Published presets: shapes give the published parameter counts exactly; big ones build abstractly; the
tables of docs/models.md, rendered by docs/render.py, state the counts we compute and the published ones."""

import re

import jax
import pytest
from flax import nnx

from jaxpar.layers.moe import RouterBias
from jaxpar.models import PRESETS, PUBLISHED_PARAMS, build_model, get_model_preset

# Values a published checkpoint stores that we keep as non-trained state, not parameters: DeepSeek-V3's
# routers' selection biases (e_score_correction_bias), 256 experts × 58 MoE layers.
SELECTION_BIASES = {"deepseek-v3": 256 * (61 - 3)}


def _sizes(cfg):
    """(parameters, router-bias entries) of the model built abstractly (no allocation)."""
    abstract = nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0)))
    size = lambda kind: sum(x.size for x in jax.tree.leaves(nnx.state(abstract, kind)))
    return size(nnx.Param), size(RouterBias)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_parameter_count_is_the_published_one(name):
    cfg = PRESETS[name]
    params, router_biases = _sizes(cfg)
    assert cfg.num_params() == cfg.num_params(padded=True) == params  # no vocabulary padding here
    stored = SELECTION_BIASES.get(name, 0)
    assert params + stored == PUBLISHED_PARAMS[name]
    if stored:
        assert router_biases == stored


def _docs_rows():
    """(preset, parameters, published) of every row of the model tables docs/models.md renders."""
    from rendered import render, table_rows

    number = lambda cell: int(cell.replace(",", "")) if re.fullmatch(r"[\d,]+", cell) else None
    return [
        (re.fullmatch(r"`([^`]+)`.*", name).group(1), number(ours), number(published.split(" ")[0]))
        for table in (render.models_dense(), render.models_moe())
        for name, ours, published in table_rows(table)
    ]


def test_docs_tables_state_our_counts():
    rows = _docs_rows()
    assert sorted(name for name, _, _ in rows) == sorted(PRESETS)
    for name, ours, published in rows:
        assert ours == PRESETS[name].num_params(), name
        assert published == PUBLISHED_PARAMS.get(name), name
        if published is not None and published != ours:  # the values a checkpoint keeps as state
            assert published - ours == SELECTION_BIASES[name], name


def test_variants_switch_their_parameters():
    names = lambda cfg: {
        jax.tree_util.keystr(p).removesuffix(".value")
        for p, _ in jax.tree_util.tree_leaves_with_path(
            nnx.state(nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0))), nnx.Param)
        )
    }
    base = names(get_model_preset("tiny"))
    assert {"['blocks']['attn']['q_bias']", "['blocks']['attn']['k_bias']"} <= names(
        get_model_preset("tiny", qkv_bias=True)
    ) - base
    assert "['blocks']['attn']['q_norm']['scale']" in names(get_model_preset("tiny", qk_norm=True)) - base
    assert "['lm_head']" not in names(get_model_preset("tiny", tie_embeddings=True))
