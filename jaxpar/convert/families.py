"""The Hugging Face families: their config.json fields in and out of ours, and where each weight lives.

Each family has an allow-list. A config field is either *read* (it sets something of ours), *fixed*
(accepted only at the value our implementation computes: ``hidden_act: "silu"``, ``mlp_bias: false``,
...), or *metadata* that does not change the function the model computes (token ids, dtype, version).
Any other field, and any fixed field with another value, is refused with its name: a field we do not
understand may change the model, and a silently wrong conversion is worse than none.

Execution (``jaxpar.execution.ExecutionConfig``, ``Family.execution``): HF's MoE models run every routed
token (no capacity), so imports run dropless (``capacity_factor=None``) and take the balancing-loss
weight from ``router_aux_loss_coef`` (written back on export); the router z-loss is off (no HF family
here has one). Dense families run under ``ExecutionConfig()``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jaxpar.convert.files import ConvertError
from jaxpar.convert.mapping import Source
from jaxpar.execution import ExecutionConfig
from jaxpar.layers.mla import MLAConfig
from jaxpar.layers.moe import MoEConfig
from jaxpar.layers.rope import RopeScaling, YarnScaling
from jaxpar.models.dense import DenseConfig
from jaxpar.models.moe import MoEModelConfig

METADATA = {
    "architectures",
    "model_type",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "use_cache",
    "initializer_range",
    "_name_or_path",
    "tokenizer_class",
    "output_router_logits",
    "max_window_layers",
    "return_dict",
    "output_hidden_states",
    "output_attentions",
    "tie_word_embeddings",
}  # tie_word_embeddings is read (below), listed so every family allows it
DENSE_READ = {
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "max_position_embeddings",
}
NO_EXTRAS = {
    "hidden_act": "silu",
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "attention_bias": False,
}


@dataclasses.dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str
    read: frozenset
    fixed: dict
    to_ours: Callable[[dict], DenseConfig]
    to_hf: Callable[[DenseConfig, ExecutionConfig], dict]
    execution: Callable[[dict], ExecutionConfig] = lambda hf: ExecutionConfig()  # how HF runs the model


def check_fields(hf: dict, fam: Family, where: str) -> None:
    for key, value in hf.items():
        if key in fam.fixed:
            if value != fam.fixed[key] and not (key == "layer_types" and set(value) <= {"full_attention"}):
                raise ConvertError(
                    f"{where}: {key}={value!r} is not supported for {fam.model_type} (only {fam.fixed[key]!r})"
                )
        elif key not in fam.read and key not in METADATA:
            raise ConvertError(
                f"{where}: unsupported field {key!r} (= {value!r}) for {fam.model_type}; the "
                "conversion refuses what it does not implement rather than guess"
            )


# ------------------------------------------------------------------------------------------ rope
def _rope_in(hf: dict, *, yarn: bool = False):
    """(theta, scaling) from either the classic fields (rope_theta, rope_scaling) or transformers 5's
    ``rope_parameters``."""
    params = dict(hf.get("rope_parameters") or {})
    spec = dict(hf.get("rope_scaling") or params)
    theta = float(hf.get("rope_theta", params.get("rope_theta", spec.get("rope_theta", 10_000.0))))
    kind = spec.pop("rope_type", spec.pop("type", "default"))
    spec.pop("rope_theta", None)
    if kind == "default" and not spec:
        return theta, None
    if kind == "llama3":
        known = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
        _only(spec, known, "rope_scaling")
        return theta, RopeScaling(
            float(spec["factor"]),
            float(spec["low_freq_factor"]),
            float(spec["high_freq_factor"]),
            int(spec["original_max_position_embeddings"]),
        )
    if kind == "yarn" and yarn:
        known = {
            "factor",
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "attention_factor",
            "truncate",
        }
        _only(spec, known, "rope_scaling")
        d = YarnScaling()
        return theta, YarnScaling(
            float(spec.get("factor", d.factor)),
            int(spec.get("original_max_position_embeddings", d.original_max_position)),
            float(spec.get("beta_fast", d.beta_fast)),
            float(spec.get("beta_slow", d.beta_slow)),
            float(spec.get("mscale", d.mscale)),
            float(spec.get("mscale_all_dim", d.mscale_all_dim)),
            spec.get("attention_factor"),
            bool(spec.get("truncate", True)),
        )
    raise ConvertError(
        f"config.json: rope_scaling type {kind!r} is not supported (default, llama3{', yarn' if yarn else ''})"
    )


def _only(spec: dict, known: set, where: str) -> None:
    extra = sorted(set(spec) - known)
    if extra:
        raise ConvertError(f"config.json: unsupported field {where}.{extra[0]}")


def _rope_out(theta: float, scaling) -> dict:
    if scaling is None:
        return {"rope_theta": theta, "rope_scaling": None}
    if isinstance(scaling, RopeScaling):
        return {
            "rope_theta": theta,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": scaling.factor,
                "low_freq_factor": scaling.low_freq_factor,
                "high_freq_factor": scaling.high_freq_factor,
                "original_max_position_embeddings": scaling.original_max_position,
            },
        }
    s = {
        "rope_type": "yarn",
        "factor": scaling.factor,
        "original_max_position_embeddings": scaling.original_max_position,
        "beta_fast": scaling.beta_fast,
        "beta_slow": scaling.beta_slow,
        "mscale": scaling.mscale,
        "mscale_all_dim": scaling.mscale_all_dim,
    }
    return {
        "rope_theta": theta,
        "rope_scaling": s
        | ({"attention_factor": scaling.attention_factor} if scaling.attention_factor is not None else {}),
    }


# ------------------------------------------------------------------------------------- configs
def _dense_kw(hf: dict, *, yarn: bool = False, **extra) -> dict:
    theta, scaling = _rope_in(hf, yarn=yarn)
    heads = hf["num_attention_heads"]
    return (
        dict(
            vocab_size=hf["vocab_size"],
            embed_dim=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            mlp_dim=hf["intermediate_size"],
            rope_theta=theta,
            rope_scaling=scaling,
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_seq_len=hf.get("max_position_embeddings", 2048),
        )
        | extra
    )


def _dense_out(cfg: DenseConfig, fam: Family, **extra) -> dict:
    return (
        {
            "architectures": [fam.architecture],
            "model_type": fam.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.embed_dim,
            "intermediate_size": cfg.mlp_dim,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "rms_norm_eps": cfg.norm_eps,
            "max_position_embeddings": cfg.max_seq_len,
            "tie_word_embeddings": cfg.tie_embeddings,
            "torch_dtype": "float32",
            **_rope_out(cfg.rope_theta, cfg.rope_scaling),
        }
        | {k: v for k, v in fam.fixed.items() if k != "layer_types"}
        | extra
    )


def _family(model_type, architecture, read, fixed, to_ours, to_hf, execution=None) -> Family:
    read = frozenset(DENSE_READ | set(read))
    if execution is None:
        return Family(model_type, architecture, read, fixed, to_ours, to_hf)
    return Family(model_type, architecture, read, fixed, to_ours, to_hf, execution)


def _routed_execution(hf: dict) -> ExecutionConfig:
    """How HF runs Mixtral's and Qwen3-MoE's experts: every routed token, the balancing loss weighted by
    ``router_aux_loss_coef``, no router z-loss."""
    return ExecutionConfig(
        capacity_factor=None, aux_loss_weight=hf.get("router_aux_loss_coef", 0.001), router_z_loss_weight=0.0
    )


def _llama() -> Family:
    return _family(
        "llama",
        "LlamaForCausalLM",
        (),
        NO_EXTRAS,
        lambda hf: DenseConfig(**_dense_kw(hf)),
        lambda cfg, run: _dense_out(cfg, FAMILIES["llama"]),
    )


def _mistral() -> Family:
    fixed = {k: v for k, v in NO_EXTRAS.items() if k != "attention_bias"}
    return _family(
        "mistral",
        "MistralForCausalLM",
        {"sliding_window"},
        fixed,
        lambda hf: DenseConfig(**_dense_kw(hf, sliding_window=hf.get("sliding_window"))),
        lambda cfg, run: _dense_out(cfg, FAMILIES["mistral"], sliding_window=cfg.sliding_window),
    )


def _qwen(model_type, architecture, **ours) -> Family:
    """Qwen2 (QKV bias, no attention_bias field) and Qwen3 (QK-norm): full attention only."""
    fixed = {k: v for k, v in NO_EXTRAS.items() if k not in ("mlp_bias", "pretraining_tp")}
    if ours.get("qkv_bias"):
        fixed.pop("attention_bias")
    fixed |= {"use_sliding_window": False, "layer_types": None}
    return _family(
        model_type,
        architecture,
        {"sliding_window"},
        fixed,
        lambda hf: DenseConfig(**_dense_kw(hf, **ours)),
        lambda cfg, run: _dense_out(cfg, FAMILIES[model_type]),
    )


# --------------------------------------------------------------------------------------- MoE
def _moe_ours(hf: dict, moe: MoEConfig, **kw) -> MoEModelConfig:
    return MoEModelConfig(**_dense_kw(hf, **kw), moe=moe)


def _mixtral() -> Family:
    def to_ours(hf):
        return _moe_ours(
            hf,
            MoEConfig(
                num_experts=hf["num_local_experts"],
                top_k=hf["num_experts_per_tok"],
                mlp_dim=hf["intermediate_size"],
            ),
            sliding_window=hf.get("sliding_window"),
        )

    def to_hf(cfg, run):
        m = cfg.moe
        return _dense_out(
            cfg,
            FAMILIES["mixtral"],
            sliding_window=cfg.sliding_window,
            num_local_experts=m.num_experts,
            num_experts_per_tok=m.top_k,
            router_aux_loss_coef=run.aux_loss_weight,
        )

    fixed = {k: v for k, v in NO_EXTRAS.items() if k not in ("attention_bias", "mlp_bias", "pretraining_tp")}
    return _family(
        "mixtral",
        "MixtralForCausalLM",
        {"sliding_window", "num_local_experts", "num_experts_per_tok", "router_aux_loss_coef"},
        fixed | {"router_jitter_noise": 0.0},
        to_ours,
        to_hf,
        _routed_execution,
    )


def _qwen3_moe() -> Family:
    def to_ours(hf):
        experts = hf.get("num_experts", hf.get("num_local_experts"))  # transformers 5 writes the latter
        return _moe_ours(
            hf,
            MoEConfig(
                num_experts=experts,
                top_k=hf["num_experts_per_tok"],
                mlp_dim=hf["moe_intermediate_size"],
                norm_topk=bool(hf.get("norm_topk_prob", False)),
            ),
            qk_norm=True,
        )

    def to_hf(cfg, run):
        m = cfg.moe
        return _dense_out(
            cfg,
            FAMILIES["qwen3_moe"],
            num_experts=m.num_experts,
            num_experts_per_tok=m.top_k,
            moe_intermediate_size=m.mlp_dim,
            norm_topk_prob=m.norm_topk,
            router_aux_loss_coef=run.aux_loss_weight,
        )

    fixed = {k: v for k, v in NO_EXTRAS.items() if k not in ("mlp_bias", "pretraining_tp")}
    fixed |= {"use_sliding_window": False, "layer_types": None, "decoder_sparse_step": 1, "mlp_only_layers": []}
    return _family(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        {
            "sliding_window",
            "num_experts",
            "num_local_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "norm_topk_prob",
            "router_aux_loss_coef",
        },
        fixed,
        to_ours,
        to_hf,
        _routed_execution,
    )


DEEPSEEK_READ = {
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "first_k_dense_replace",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "norm_topk_prob",
    "rope_interleave",
    "qk_head_dim",
    "num_nextn_predict_layers",
}  # MTP layers' tensors are skipped


def _deepseek_v3() -> Family:
    def to_ours(hf):
        heads = hf["num_attention_heads"]
        mla = MLAConfig(
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            rope_interleave=bool(hf.get("rope_interleave", True)),
        )
        moe = MoEConfig(
            num_experts=hf["n_routed_experts"],
            top_k=hf["num_experts_per_tok"],
            mlp_dim=hf["moe_intermediate_size"],
            router="sigmoid",
            norm_topk=bool(hf.get("norm_topk_prob", True)),
            num_groups=hf.get("n_group", 1),
            topk_groups=hf.get("topk_group", 1),
            routed_scale=float(hf.get("routed_scaling_factor", 1.0)),
            num_shared_experts=hf.get("n_shared_experts") or 0,
            shared_mlp_dim=hf["moe_intermediate_size"] if hf.get("n_shared_experts") else 0,
        )
        kw = _dense_kw(hf, yarn=True) | dict(num_kv_heads=heads, head_dim=hf["v_head_dim"])
        return MoEModelConfig(**kw, moe=moe, mla=mla, first_dense_layers=hf.get("first_k_dense_replace", 0))

    def to_hf(cfg, run):
        m, a = cfg.moe, cfg.mla
        out = _dense_out(
            cfg,
            FAMILIES["deepseek_v3"],
            q_lora_rank=a.q_lora_rank,
            kv_lora_rank=a.kv_lora_rank,
            qk_nope_head_dim=a.qk_nope_head_dim,
            qk_rope_head_dim=a.qk_rope_head_dim,
            v_head_dim=a.v_head_dim,
            n_routed_experts=m.num_experts,
            n_shared_experts=m.num_shared_experts,
            num_experts_per_tok=m.top_k,
            moe_intermediate_size=m.mlp_dim,
            first_k_dense_replace=cfg.first_dense_layers,
            n_group=m.num_groups,
            topk_group=m.topk_groups,
            routed_scaling_factor=m.routed_scale,
            norm_topk_prob=m.norm_topk,
            rope_interleave=a.rope_interleave,
        )
        out |= {"head_dim": a.qk_rope_head_dim, "num_key_value_heads": cfg.num_heads, "num_nextn_predict_layers": 0}
        return out

    fixed = dict(NO_EXTRAS) | {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1, "ep_size": 1}
    # every routed token; no balancing loss, router z-loss or bias updates (the bias is a loaded tensor)
    execution = lambda hf: ExecutionConfig(capacity_factor=None, aux_loss_weight=0.0, router_z_loss_weight=0.0)
    return _family("deepseek_v3", "DeepseekV3ForCausalLM", DEEPSEEK_READ, fixed, to_ours, to_hf, execution)


FAMILIES: dict[str, Family] = {}
FAMILIES.update(
    {
        "llama": _llama(),
        "mistral": _mistral(),
        "qwen2": _qwen("qwen2", "Qwen2ForCausalLM", qkv_bias=True),
        "qwen3": _qwen("qwen3", "Qwen3ForCausalLM", qk_norm=True),
        "mixtral": _mixtral(),
        "qwen3_moe": _qwen3_moe(),
        "deepseek_v3": _deepseek_v3(),
    }
)


def family_of(hf: dict, where: str) -> Family:
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


# ------------------------------------------------------------------------------------- weights
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
