"""Where each weight lives: our parameter paths (as in ``nnx.state``) and the Hugging Face tensors they
are read from and written to (``mapping.Source``), for every family."""

from __future__ import annotations

from jaxpar.convert.fields import Family
from jaxpar.convert.mapping import Source
from jaxpar.models.dense import DenseConfig
from jaxpar.models.moe import MoEModelConfig


def sources(cfg: DenseConfig, fam: Family) -> dict[tuple[str, ...], Source]:
    """Our parameter paths (as in ``nnx.state``) -> their HF sources."""
    out = {
        ("embed", "embedding"): Source(("model.embed_tokens.weight",), ("v", "d"), ("v", "d")),
        ("final_norm", "scale"): Source(("model.norm.weight",), ("d",), ("d",)),
    }
    if not cfg.tie_embeddings:
        out[("lm_head",)] = Source(("lm_head.weight",), ("d", "v"), ("v", "d"))
    moe = isinstance(cfg, MoEModelConfig)
    first = cfg.first_dense_layers if moe else cfg.num_layers
    stacks = (
        [("blocks", 0, False)]
        if not moe
        else ([("dense_blocks", 0, False)] if first else []) + [("moe_blocks", first, True)]
    )
    for stack, offset, is_moe in stacks:

        def s(names, ours, hf, offset=offset):
            return Source(tuple(f"model.layers.{{l}}.{n}" for n in names), ("L", *ours), hf, offset)

        out |= {
            (stack, "attn_norm", "scale"): s(["input_layernorm.weight"], ("d",), ("d",)),
            (stack, "mlp_norm", "scale"): s(["post_attention_layernorm.weight"], ("d",), ("d",)),
        }
        out |= {(stack, "attn", *k): v for k, v in _attention(cfg, s).items()}
        ff = _experts(cfg, fam, s) if is_moe else _mlp(s, "mlp", "mlp.")
        out |= {(stack, *k): v for k, v in ff.items()}
    return out


def _attention(cfg, s) -> dict:
    a = "self_attn."
    if cfg.mla is not None:
        out = {
            ("kv_a",): s([a + "kv_a_proj_with_mqa.weight"], ("d", "c"), ("c", "d")),
            ("kv_a_norm", "scale"): s([a + "kv_a_layernorm.weight"], ("r",), ("r",)),
            ("kv_b",): s([a + "kv_b_proj.weight"], ("r", "n", "h"), (("n", "h"), "r")),
            ("o",): s([a + "o_proj.weight"], ("n", "h", "d"), ("d", ("n", "h"))),
        }
        if cfg.mla.q_lora_rank is None:
            return out | {("q",): s([a + "q_proj.weight"], ("d", "n", "h"), (("n", "h"), "d"))}
        return out | {
            ("q_a",): s([a + "q_a_proj.weight"], ("d", "r"), ("r", "d")),
            ("q_a_norm", "scale"): s([a + "q_a_layernorm.weight"], ("r",), ("r",)),
            ("q_b",): s([a + "q_b_proj.weight"], ("r", "n", "h"), (("n", "h"), "r")),
        }
    out = {(x,): s([f"{a}{x}_proj.weight"], ("d", "n", "h"), (("n", "h"), "d")) for x in "qkv"}
    out[("o",)] = s([a + "o_proj.weight"], ("n", "h", "d"), ("d", ("n", "h")))
    if cfg.qkv_bias:
        out |= {(f"{x}_bias",): s([f"{a}{x}_proj.bias"], ("n", "h"), (("n", "h"),)) for x in "qkv"}
    if cfg.qk_norm:
        out |= {(f"{x}_norm", "scale"): s([f"{a}{x}_norm.weight"], ("h",), ("h",)) for x in "qk"}
    return out


def _mlp(s, ours: str, hf: str, gate="gate_proj", up="up_proj", down="down_proj", stack=()) -> dict:
    e = ("E",) if stack else ()
    return {
        (ours, "gate_up") if ours else ("gate_up",): s(
            [hf + gate + ".weight", hf + up + ".weight"], (*e, "d", "P", "f"), ("f", "d")
        ),
        (ours, "down") if ours else ("down",): s([hf + down + ".weight"], (*e, "f", "d"), ("d", "f")),
    }


def _experts(cfg, fam: Family, s) -> dict:
    if fam.model_type == "mixtral":
        pre, names = "block_sparse_moe.", dict(gate="w1", up="w3", down="w2")
    else:
        pre, names = "mlp.", {}
    out = {("moe", "router"): s([pre + "gate.weight"], ("d", "e"), ("e", "d"))}
    out |= {("moe", *k): v for k, v in _mlp(s, "", pre + "experts.{e}.", stack=("E",), **names).items()}
    if fam.model_type == "deepseek_v3":
        out[("moe", "router_bias")] = s([pre + "gate.e_score_correction_bias"], ("e",), ("e",))
        if cfg.moe.num_shared_experts:
            out |= {("moe", "shared", *k): v for k, v in _mlp(s, "", pre + "shared_experts.").items()}
    return out
