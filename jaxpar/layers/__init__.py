"""NNX building blocks. They name logical axes only; ``jaxpar.rules`` maps them onto a mesh."""
from jaxpar.layers.attention import Attention, AttentionConfig
from jaxpar.layers.embed import Embed
from jaxpar.layers.mlp import SwiGLU
from jaxpar.layers.norms import RMSNorm
from jaxpar.layers.rope import RopeScaling, apply_rope, rope_frequencies

__all__ = ["Attention", "AttentionConfig", "Embed", "SwiGLU", "RMSNorm", "RopeScaling", "apply_rope",
           "rope_frequencies"]
