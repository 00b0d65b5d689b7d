"""The inference boundary: a model's stacks of layers as one block per layer, and back.

Training creates each stack of layers once with a leading stacked axis (logical name ``layers``, or
``prefix_layers`` for DeepSeek's dense prefix) and scans over it, so compile time does not grow with
depth. A decode step reads every weight once; slicing layer i out of a stacked array inside the step
copies it, and a stacked cache carried through a scan is copied too. So generation unstacks a model once,
when it is loaded (``jaxpar.inference.generate.for_generation``): each stack (``cache_stacks``) becomes an
``nnx.List`` of per-layer blocks, each holding arrays of its own whose logical names are the stacked ones
less the leading stacked axis. A decode layout never splits that axis, so it places every layer as it
placed the stack. The model's generation hooks then run the layers unrolled, each with its own cache.

MLA layers also get their decode weights (``jaxpar.layers.mla.absorb``: kv_b's halves as the two arrays
the absorbed decode reads), which ``restack`` drops.

``restack`` is the inverse: ``restack(unstack(model))`` has ``model``'s structure, metadata and values
bit for bit. Checkpoints, conversion and training only ever see stacked models.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.layers.mla import ABSORBED, MLA, absorb
from jaxpar.model_api import LanguageModel
from jaxpar.models import build_model
from jaxpar.models.stacks import split_stack


def is_unstacked(model: LanguageModel) -> bool:
    """Whether every stack of ``model`` is a sequence of per-layer blocks."""
    return all(isinstance(getattr(model, name), nnx.List) for name in model.cache_stacks())


def unstack(model: LanguageModel) -> LanguageModel:
    """``model`` with every stack as an ``nnx.List`` of per-layer blocks, each layer's arrays its own
    (copied out of the stacked ones once). The other parts (embedding, final norm, head) share ``model``'s
    arrays in variables of their own, so ``model`` is left as it is, also when the result is resharded
    (``jaxpar.inference.layouts.reshard`` updates variables in place). Abstract models (``nnx.eval_shape``)
    give abstract layers."""
    graphdef, state = nnx.split(model)
    out = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))  # new variables (placing them moves no caller's)
    for name in out.cache_stacks():
        blocks = getattr(out, name)
        if not isinstance(blocks, nnx.List):
            layers = split_stack(blocks)
            for _, module in nnx.iter_graph(layers):
                if isinstance(module, MLA):
                    absorb(module)
            setattr(out, name, nnx.List(layers))
    return out


def _unabsorbed(tree):
    """A layer's pure dict without the absorbed MLA decode weights (``absorb``'s copies of kv_b)."""
    if not isinstance(tree, dict):
        return tree
    return {k: _unabsorbed(v) for k, v in tree.items() if k not in ABSORBED}


def restack(model: LanguageModel) -> LanguageModel:
    """The stacked (training) form of an unstacked ``model``: each stack's per-layer arrays stacked on a
    new leading axis, under the stacked structure and logical names, which come from the config rebuilt
    abstractly (``build_model`` under ``model.execution``)."""
    abstract = nnx.eval_shape(lambda: build_model(model.cfg, execution=model.execution, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    pure = nnx.to_pure_dict(nnx.state(model))
    for name in model.cache_stacks():
        if isinstance(getattr(model, name), nnx.List):
            layers = [_unabsorbed(pure[name][i]) for i in range(len(pure[name]))]
            pure[name] = jax.tree.map(lambda *rows: jnp.stack(rows), *layers)
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)
