"""The MoE families: Mixtral, Qwen3-MoE and DeepSeek-V3.

Execution (``jaxpar.execution.ExecutionConfig``, ``Family.execution``): HF's MoE models run every routed
token (no capacity), so imports run dropless (``capacity_factor=None``) and take the balancing-loss
weight from ``router_aux_loss_coef`` (written back on export); the router z-loss is off (no HF family
here has one).
"""

from __future__ import annotations

from jaxpar.convert.fields import NO_EXTRAS, Family, dense_kw, dense_out, make_family
from jaxpar.execution import ExecutionConfig
from jaxpar.layers.mla import MLAConfig
from jaxpar.layers.moe import MoEConfig
from jaxpar.models.moe import MoEModelConfig


def _routed_execution(hf: dict) -> ExecutionConfig:
    """How HF runs Mixtral's and Qwen3-MoE's experts: every routed token, the balancing loss weighted by
    ``router_aux_loss_coef``, no router z-loss."""
    return ExecutionConfig(
        capacity_factor=None, aux_loss_weight=hf.get("router_aux_loss_coef", 0.001), router_z_loss_weight=0.0
    )


def _moe_ours(hf: dict, moe: MoEConfig, **kw) -> MoEModelConfig:
    return MoEModelConfig(**dense_kw(hf, **kw), moe=moe)


def mixtral() -> Family:
    """Mixtral: Mistral's fields and routed experts (``block_sparse_moe``)."""

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
        return dense_out(
            cfg,
            fam,
            sliding_window=cfg.sliding_window,
            num_local_experts=m.num_experts,
            num_experts_per_tok=m.top_k,
            router_aux_loss_coef=run.aux_loss_weight,
        )

    fixed = {k: v for k, v in NO_EXTRAS.items() if k not in ("attention_bias", "mlp_bias", "pretraining_tp")}
    fam = make_family(
        "mixtral",
        "MixtralForCausalLM",
        {"sliding_window", "num_local_experts", "num_experts_per_tok", "router_aux_loss_coef"},
        fixed | {"router_jitter_noise": 0.0},
        to_ours,
        to_hf,
        _routed_execution,
    )
    return fam


def qwen3_moe() -> Family:
    """Qwen3-MoE: Qwen3's fields and routed experts, every layer an MoE layer."""

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
        return dense_out(
            cfg,
            fam,
            num_experts=m.num_experts,
            num_experts_per_tok=m.top_k,
            moe_intermediate_size=m.mlp_dim,
            norm_topk_prob=m.norm_topk,
            router_aux_loss_coef=run.aux_loss_weight,
        )

    fixed = {k: v for k, v in NO_EXTRAS.items() if k not in ("mlp_bias", "pretraining_tp")}
    fixed |= {"use_sliding_window": False, "layer_types": None, "decoder_sparse_step": 1, "mlp_only_layers": []}
    fam = make_family(
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
    return fam


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


def deepseek_v3() -> Family:
    """DeepSeek-V3: MLA, YaRN, first dense layers, shared experts and sigmoid group routing."""

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
        kw = dense_kw(hf, yarn=True) | dict(num_kv_heads=heads, head_dim=hf["v_head_dim"])
        return MoEModelConfig(**kw, moe=moe, mla=mla, first_dense_layers=hf.get("first_k_dense_replace", 0))

    def to_hf(cfg, run):
        m, a = cfg.moe, cfg.mla
        out = dense_out(
            cfg,
            fam,
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
    fam = make_family("deepseek_v3", "DeepseekV3ForCausalLM", DEEPSEEK_READ, fixed, to_ours, to_hf, execution)
    return fam
