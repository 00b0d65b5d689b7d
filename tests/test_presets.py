"""Published presets: shapes give the published parameter counts; big ones build abstractly."""
import jax
import pytest
from flax import nnx

from jaxpar.models import PRESETS, PUBLISHED_PARAMS, build_model, get_model_preset


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_parameter_count_matches_published(name):
    cfg = PRESETS[name]
    assert abs(cfg.num_params() / PUBLISHED_PARAMS[name] - 1) < 0.005
    abstract = nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0)))      # no allocation
    built = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    assert built == cfg.num_params(padded=True)


def test_variants_switch_their_parameters():
    names = lambda cfg: {jax.tree_util.keystr(p).removesuffix(".value") for p, _ in jax.tree_util.tree_leaves_with_path(
        nnx.state(nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0))), nnx.Param))}
    base = names(get_model_preset("tiny"))
    assert {"['blocks']['attn']['q_bias']", "['blocks']['attn']['k_bias']"} <= names(get_model_preset("tiny", qkv_bias=True)) - base
    assert "['blocks']['attn']['q_norm']['scale']" in names(get_model_preset("tiny", qk_norm=True)) - base
    assert "['lm_head']" not in names(get_model_preset("tiny", tie_embeddings=True))
