"""Tiny random Hugging Face models of every family we convert, built with ``transformers`` + ``torch``
(test-only dependencies) and saved as safetensors folders (their reference logits: tests/hf_models.py).

Every weight is random, norms included (a fresh model's norms are all ones and would hide a mapping
that mixes them up); every dimension divides the ``fsdp=4 × tensor=2`` mesh of the sharded tests.
"""

from __future__ import annotations

COMMON = dict(
    vocab_size=250,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)

CONFIGS = {
    "llama": (
        "LlamaConfig",
        dict(
            COMMON,
            rope_theta=50_000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "mistral": ("MistralConfig", dict(COMMON, sliding_window=5)),
    "qwen2": ("Qwen2Config", dict(COMMON, tie_word_embeddings=True, rms_norm_eps=1e-6)),
    "qwen3": ("Qwen3Config", dict(COMMON, rope_theta=1_000_000.0)),
    "mixtral": ("MixtralConfig", dict(COMMON, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            COMMON,
            num_hidden_layers=3,
            num_key_value_heads=8,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        ),
    ),
}


def build(family: str, seed: int = 0):
    """A tiny random HF model of ``family`` (torch, float32, eval mode)."""
    import torch
    import transformers

    cls, kw = CONFIGS[family]
    config = getattr(transformers, cls)(**kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norms and biases: away from 1 and 0
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.08)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's selection bias: make it matter
                b.copy_(0.05 * torch.randn_like(b))
    return model


def save(model, folder, *, max_shard_size: str | int = "5GB") -> None:
    model.save_pretrained(folder, safe_serialization=True, max_shard_size=max_shard_size)
