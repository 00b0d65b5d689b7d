"""The dense families: Llama, Mistral (sliding window), Qwen2 (QKV bias) and Qwen3 (QK-norm), all under
``ExecutionConfig()``."""

from __future__ import annotations

from jaxpar.convert.fields import NO_EXTRAS, Family, dense_kw, dense_out, make_family
from jaxpar.models.dense import DenseConfig


def llama() -> Family:
    """Llama 2, 3 and 3.1 (with Llama 3's rope scaling)."""
    fam = make_family(
        "llama",
        "LlamaForCausalLM",
        (),
        NO_EXTRAS,
        lambda hf: DenseConfig(**dense_kw(hf)),
        lambda cfg, run: dense_out(cfg, fam),
    )
    return fam


def mistral() -> Family:
    """Mistral: Llama's fields and a sliding window."""
    fixed = {k: v for k, v in NO_EXTRAS.items() if k != "attention_bias"}
    fam = make_family(
        "mistral",
        "MistralForCausalLM",
        {"sliding_window"},
        fixed,
        lambda hf: DenseConfig(**dense_kw(hf, sliding_window=hf.get("sliding_window"))),
        lambda cfg, run: dense_out(cfg, fam, sliding_window=cfg.sliding_window),
    )
    return fam


def qwen(model_type, architecture, **ours) -> Family:
    """Qwen2 (QKV bias, no attention_bias field) and Qwen3 (QK-norm): full attention only."""
    fixed = {k: v for k, v in NO_EXTRAS.items() if k not in ("mlp_bias", "pretraining_tp")}
    if ours.get("qkv_bias"):
        fixed.pop("attention_bias")
    fixed |= {"use_sliding_window": False, "layer_types": None}
    fam = make_family(
        model_type,
        architecture,
        {"sliding_window"},
        fixed,
        lambda hf: DenseConfig(**dense_kw(hf, **ours)),
        lambda cfg, run: dense_out(cfg, fam),
    )
    return fam
