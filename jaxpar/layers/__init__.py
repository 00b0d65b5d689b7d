"""NNX building blocks. They name logical axes only; ``jaxpar.rules`` maps them onto a mesh."""

from jaxpar.layers.attention import Attention, AttentionConfig, AttentionImpl
from jaxpar.layers.embed import Embed
from jaxpar.layers.mlp import SwiGLU
from jaxpar.layers.moe import MoE, MoEConfig, MoEStats, updated_bias
from jaxpar.layers.norms import RMSNorm
from jaxpar.layers.rope import RopeScaling, YarnScaling, apply_rope, rope_frequencies

__all__ = [
    "Attention",
    "AttentionConfig",
    "AttentionImpl",
    "YarnScaling",
    "Embed",
    "MoE",
    "MoEConfig",
    "MoEStats",
    "SwiGLU",
    "RMSNorm",
    "RopeScaling",
    "apply_rope",
    "rope_frequencies",
    "updated_bias",
]
