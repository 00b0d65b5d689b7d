"""What an engine places on its devices: its checked decode layout, each model's weights and page pools
there, and how many pages a memory budget holds (``jaxpar.inference.engine`` runs them)."""

from __future__ import annotations

import dataclasses
import math

import jax
from flax import nnx

from jaxpar.errors import ConfigError, LayoutError
from jaxpar.inference.layouts import build_inference_mesh, check_inference_layout, placed_state
from jaxpar.layers.kvcache import map_arrays
from jaxpar.meshes import Phase, compose_rules
from jaxpar.model_api import LanguageModel


def page_bytes(model: LanguageModel, page_size: int, /) -> int:
    """Bytes one page takes in every layer's pool together (K and V, or latent and rope key)."""
    one = jax.eval_shape(lambda: model.empty_pages(1, page_size))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(one))


def pages_for_budget(model: LanguageModel, page_size: int, budget_bytes: int, max_length: int, /) -> int:
    """The most pages (null page included) whose pools fit in ``budget_bytes``: at least one full
    sequence of ``max_length`` positions and the null page, or a ConfigError naming the least budget."""
    one = page_bytes(model, page_size)
    pages, least = budget_bytes // one, max_length // page_size + 1
    if pages < least:
        raise ConfigError(
            f"memory_budget={budget_bytes} bytes holds {pages} pages of {page_size} positions ({one} bytes "
            f"each in all layers); one sequence of max_length={max_length} positions and the null page need "
            f"{least}, {least * one} bytes"
        )
    return int(pages)


def engine_layout(cfg, mesh: str | None, devices=None, *, slots: int, length: int, flag: str = "mesh"):
    """The checked decode layout of an engine for ``cfg`` with ``slots`` rows on ``mesh`` over
    ``devices`` (None: one device). Refuses a ``sequence`` split (positions are never split) and a pool
    that the layout would replicate (more kv-head ways than kv heads: a dense cache moves them to its
    batch, a page pool has none)."""
    if mesh is None:
        devices = list(jax.devices() if devices is None else devices)[:1]
    name, built = build_inference_mesh(mesh or "decode_dp", devices=devices, flag=flag)
    if built.shape["sequence"] > 1:
        raise LayoutError(
            f"{flag} {mesh}: sequence={built.shape['sequence']}; the engine never splits positions "
            f"(use tensor, data or expert)"
        )
    layout = check_inference_layout(cfg, built, name, batch=slots, prompt=1, slots=length)
    wanted = compose_rules(name, {a for a, n in built.shape.items() if n > 1}, phase=Phase.DECODE)
    ways = math.prod(built.shape[a] for a in wanted["cache_kv_heads"])
    if not cfg.uses_mla and cfg.num_kv_heads % ways:
        raise LayoutError(
            f"{flag} {mesh}: model.num_kv_heads={cfg.num_kv_heads} cannot be split {ways} ways "
            f"({'×'.join(wanted['cache_kv_heads'])}); the page pools would be replicated. Use a "
            f"tensor size that divides {cfg.num_kv_heads}, and data replicas for the rest"
        )
    return layout


@dataclasses.dataclass
class Weights:
    """One model's weights and page pools (the target's, or the draft's, on the same page tables)."""

    graphdef: object
    state: object
    pools: dict

    @classmethod
    def of(cls, model: LanguageModel, num_pages: int, page_size: int, layout) -> Weights:
        """``model``'s weights moved onto ``layout`` (an ``InferenceLayout``), its pools made there."""
        graphdef, state = nnx.graphdef(model), placed_state(model, layout.phase("decode"))

        place = lambda x, names: jax.device_put(x, layout.sharding(names))  # by their logical names
        pools = {
            k: [map_arrays(c, place) for c in layers] for k, layers in model.empty_pages(num_pages, page_size).items()
        }
        return cls(graphdef, state, pools)
