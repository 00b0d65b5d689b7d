"""The Hugging Face families: their config.json fields in and out of ours, and where each weight lives.

Each family has an allow-list (``fields``): a config field is read, fixed at the value our implementation
computes, or metadata; any other field is refused with its name. The dense families are in
``dense_families``, the MoE ones in ``moe_families``, the RoPE fields in ``rope`` and the weights' HF
tensors in ``weights``; this module keeps the registry.

Execution (``jaxpar.execution.ExecutionConfig``, ``Family.execution``): imports of the MoE families run
dropless, as HF does (``moe_families``). Dense families run under ``ExecutionConfig()``.
"""

from __future__ import annotations

from jaxpar.convert.dense_families import llama, mistral, qwen
from jaxpar.convert.fields import Family, check_fields
from jaxpar.convert.files import ConvertError
from jaxpar.convert.moe_families import deepseek_v3, mixtral, qwen3_moe
from jaxpar.convert.weights import sources
from jaxpar.models.dense import DenseConfig
from jaxpar.models.moe import MoEModelConfig

__all__ = ["FAMILIES", "Family", "check_fields", "family_of", "guess_family", "sources"]

FAMILIES: dict[str, Family] = {
    "llama": llama(),
    "mistral": mistral(),
    "qwen2": qwen("qwen2", "Qwen2ForCausalLM", qkv_bias=True),
    "qwen3": qwen("qwen3", "Qwen3ForCausalLM", qk_norm=True),
    "mixtral": mixtral(),
    "qwen3_moe": qwen3_moe(),
    "deepseek_v3": deepseek_v3(),
}


def family_of(hf: dict, where: str) -> Family:
    """The family of a config.json (``where``: its path, for the message), refused when it is not one of ours."""
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        arch = hf.get("architectures")
        raise ConvertError(
            f"{where}: unknown architecture (model_type={model_type!r}, architectures={arch}); "
            f"supported: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]


def guess_family(cfg: DenseConfig) -> Family:
    """The HF family a jaxpar config exports as."""
    if isinstance(cfg, MoEModelConfig):
        if cfg.mla is not None or cfg.moe.router == "sigmoid":
            return FAMILIES["deepseek_v3"]
        return FAMILIES["qwen3_moe" if cfg.qk_norm else "mixtral"]
    if cfg.qk_norm:
        return FAMILIES["qwen3"]
    if cfg.qkv_bias:
        return FAMILIES["qwen2"]
    return FAMILIES["mistral" if cfg.sliding_window else "llama"]
