"""A complete one-layer Llama folder (tied embeddings, 64 tokens), written by hand with safetensors: the
conversion accepts it as is, in milliseconds, without transformers or torch. Shared by the bad-input
table and the command-line fuzz."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

HF_CONFIG = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)
LAYER = "model.layers.0."
HF_TENSORS = {
    "model.embed_tokens.weight": (64, 16),
    "model.norm.weight": (16,),
    LAYER + "input_layernorm.weight": (16,),
    LAYER + "post_attention_layernorm.weight": (16,),
    LAYER + "self_attn.q_proj.weight": (16, 16),
    LAYER + "self_attn.k_proj.weight": (8, 16),
    LAYER + "self_attn.v_proj.weight": (8, 16),
    LAYER + "self_attn.o_proj.weight": (16, 16),
    LAYER + "mlp.gate_proj.weight": (32, 16),
    LAYER + "mlp.up_proj.weight": (32, 16),
    LAYER + "mlp.down_proj.weight": (16, 32),
}


def write_hf_folder(
    folder: Path, *, config: dict | None = HF_CONFIG, drop: tuple[str, ...] = (), shapes: dict | None = None, **changes
) -> Path:
    """The Llama folder at ``folder`` (new), with config fields changed (None removes one), tensors
    dropped or reshaped; ``config=None`` writes no config.json."""
    from safetensors.numpy import save_file

    folder.mkdir()
    if config is not None:
        fields = {k: v for k, v in (config | changes).items() if v is not None}
        (folder / "config.json").write_text(json.dumps(fields))
    tensors = {
        name: np.zeros((shapes or {}).get(name, shape), np.float32)
        for name, shape in HF_TENSORS.items()
        if name not in drop
    }
    save_file(tensors, str(folder / "model.safetensors"))
    return folder
