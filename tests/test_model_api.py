"""Every family of the zoo is a ``jaxpar.model_api.LanguageModel``: each hook the Protocol states is
there, with the Protocol's signature (parameter names, kinds and defaults). Abstract models: no arrays."""

import inspect
import typing

import pytest
from flax import nnx

from jaxpar.model_api import LanguageModel
from jaxpar.models import DenseLM, MoELM, build_model, get_model_preset

# tiny: dense; tiny-moe: MoE; tiny-deepseek: MoE with a dense prefix stack and MLA
FAMILIES = {"tiny": DenseLM, "tiny-moe": MoELM, "tiny-deepseek": MoELM}


def _abstract(name: str):
    return nnx.eval_shape(lambda: build_model(get_model_preset(name), rngs=nnx.Rngs(0)))


def _hooks() -> dict[str, inspect.Signature]:
    """The Protocol's methods and their signatures (without ``self``)."""
    out = {}
    for name, member in vars(LanguageModel).items():
        if callable(member) and (not name.startswith("_") or name == "__call__"):
            sig = inspect.signature(member)
            out[name] = sig.replace(parameters=list(sig.parameters.values())[1:])
    return out


def _shape(sig: inspect.Signature) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def test_the_protocol_names_the_hooks_the_issue_lists():
    hooks = set(_hooks()) | set(typing.get_type_hints(LanguageModel, include_extras=True))
    listed = {"forward", "inputs", "embed", "prefix", "run_stack", "head", "storage_order", "pipeline_stack"}
    listed |= {"prefix_stack", "update_router_bias", "cache_stacks", "empty_cache", "empty_pages", "prefill"}
    assert listed | {"decode", "__call__", "cfg"} <= hooks


@pytest.mark.parametrize("name", FAMILIES)
def test_family_is_a_language_model(name):
    model = _abstract(name)
    assert type(model) is FAMILIES[name]
    assert isinstance(model, LanguageModel)  # every member is there (runtime_checkable)
    assert isinstance(model.pipeline_stack, str) and isinstance(getattr(model, model.pipeline_stack), nnx.Module)
    assert model.prefix_stack is None or isinstance(getattr(model, model.prefix_stack), nnx.Module)
    assert (model.prefix_stack is not None) == (name == "tiny-deepseek")


@pytest.mark.parametrize("name", FAMILIES)
def test_family_hooks_have_the_protocol_signatures(name):
    model = _abstract(name)
    for hook, want in _hooks().items():
        got = inspect.signature(getattr(model, hook))  # bound: no self (``embed``: the module's __call__)
        assert _shape(got) == _shape(want), f"{type(model).__name__}.{hook}{got} is not the Protocol's {want}"
