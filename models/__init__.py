"""The model zoo: families and their published presets.

Shapes follow the published configs. ``PUBLISHED_PARAMS`` holds the parameter counts the model cards and
checkpoints state; ``tests/test_presets.py`` checks ours against them. A preset is what a model is;
``EXECUTION_PRESETS`` holds the execution a few presets are meant to run under (the others run under
``ExecutionConfig()``): the test models' roomy expert capacity, DeepSeek's router balancing.
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from jaxpar.config import from_dict, to_dict
from jaxpar.errors import ConfigError, suggest
from jaxpar.execution import MOVED_FROM_MODEL, ExecutionConfig, split_saved_model
from jaxpar.layers.mla import MLAConfig
from jaxpar.layers.moe import MoEConfig
from jaxpar.layers.rope import RopeScaling, YarnScaling
from jaxpar.models.dense import DenseConfig, DenseLM, Remat
from jaxpar.models.moe import MoELM, MoEModelConfig

_LLAMA31 = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)


_LLAMA32 = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)


def _llama3(d, layers, heads, mlp, head_dim=128, scaling=_LLAMA31, tied=False):
    return DenseConfig(
        vocab_size=128_256,
        embed_dim=d,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=8,
        head_dim=head_dim,
        mlp_dim=mlp,
        rope_theta=500_000.0,
        rope_scaling=scaling,
        norm_eps=1e-5,
        max_seq_len=131_072,
        tie_embeddings=tied,
    )


PRESETS: dict[str, DenseConfig] = {
    # Tests: every dimension divides 8 except kv_heads (2: replicated over tensor=8, sharded over 2).
    "tiny": DenseConfig(
        vocab_size=256,
        embed_dim=64,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=8,
        mlp_dim=128,
        rope_theta=10_000.0,
        max_seq_len=1024,
    ),
    # ~100M for benchmarks.
    "llama-100m": DenseConfig(
        vocab_size=32_000,
        embed_dim=768,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=96,
        mlp_dim=2048,
        rope_theta=10_000.0,
    ),
    "llama2-7b": DenseConfig(
        vocab_size=32_000,
        embed_dim=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        head_dim=128,
        mlp_dim=11_008,
        rope_theta=10_000.0,
        max_seq_len=4096,
    ),
    "llama3.2-1b": _llama3(2048, 16, 32, 8192, head_dim=64, scaling=_LLAMA32, tied=True),  # the GPU checks' ~1B
    "llama3-8b": _llama3(4096, 32, 32, 14_336),  # Llama 3.1 8B
    "llama3-70b": _llama3(8192, 80, 64, 28_672),  # Llama 3.1 70B
    "llama3-405b": _llama3(16_384, 126, 128, 53_248),  # Llama 3.1 405B
    "mistral-7b": DenseConfig(
        vocab_size=32_000,
        embed_dim=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        mlp_dim=14_336,
        rope_theta=10_000.0,
        sliding_window=4096,
        max_seq_len=32_768,
    ),  # v0.1
    "qwen2-7b": DenseConfig(
        vocab_size=152_064,
        embed_dim=3584,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        mlp_dim=18_944,
        rope_theta=1_000_000.0,
        norm_eps=1e-6,
        qkv_bias=True,
        max_seq_len=131_072,
    ),
    "qwen3-8b": DenseConfig(
        vocab_size=151_936,
        embed_dim=4096,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        mlp_dim=12_288,
        rope_theta=1_000_000.0,
        norm_eps=1e-6,
        qk_norm=True,
        max_seq_len=40_960,
    ),
}


def _moe(vocab, d, layers, heads, kv, mlp_dense, moe, **kw):
    return MoEModelConfig(
        vocab_size=vocab,
        embed_dim=d,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=128,
        mlp_dim=mlp_dense,
        moe=moe,
        **kw,
    )


PRESETS.update(
    {
        # Tests: 4 experts, top-2 (Mixtral-like); and 8 experts in 4 groups with a shared expert, sigmoid
        # group-limited routing and a first dense layer (DeepSeek-like, with GQA attention).
        "tiny-moe": MoEModelConfig(
            vocab_size=256,
            embed_dim=64,
            num_layers=2,
            num_heads=8,
            num_kv_heads=2,
            head_dim=8,
            mlp_dim=128,
            max_seq_len=1024,
            moe=MoEConfig(num_experts=4, top_k=2, mlp_dim=64),
        ),
        "tiny-deepseek": MoEModelConfig(
            vocab_size=256,
            embed_dim=64,
            num_layers=3,
            num_heads=8,
            num_kv_heads=8,
            head_dim=8,
            mlp_dim=128,
            max_seq_len=1024,
            first_dense_layers=1,
            moe=MoEConfig(
                num_experts=8,
                top_k=2,
                mlp_dim=32,
                router="sigmoid",
                num_groups=4,
                topk_groups=2,
                routed_scale=2.5,
                num_shared_experts=1,
                shared_mlp_dim=32,
            ),
            mla=MLAConfig(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8),
        ),
        "mixtral-8x7b": _moe(
            32_000,
            4096,
            32,
            32,
            8,
            14_336,
            MoEConfig(num_experts=8, top_k=2, mlp_dim=14_336),
            rope_theta=1_000_000.0,
            max_seq_len=32_768,
        ),
        "mixtral-8x22b": _moe(
            32_768,
            6144,
            56,
            48,
            8,
            16_384,
            MoEConfig(num_experts=8, top_k=2, mlp_dim=16_384),
            rope_theta=1_000_000.0,
            max_seq_len=65_536,
        ),
        "qwen3-30b-a3b": _moe(
            151_936,
            2048,
            48,
            32,
            4,
            6144,
            MoEConfig(num_experts=128, top_k=8, mlp_dim=768),
            rope_theta=1_000_000.0,
            norm_eps=1e-6,
            qk_norm=True,
            max_seq_len=40_960,
        ),
        "qwen3-235b-a22b": _moe(
            151_936,
            4096,
            94,
            64,
            4,
            12_288,
            MoEConfig(num_experts=128, top_k=8, mlp_dim=1536),
            rope_theta=1_000_000.0,
            norm_eps=1e-6,
            qk_norm=True,
            max_seq_len=40_960,
        ),
        # DeepSeek-V3 (671B): MLA, 3 dense layers, 256 routed experts (top 8 in the best 4 of 8 groups,
        # sigmoid scores, routed scale 2.5) plus one shared expert; without the multi-token-prediction module.
        "deepseek-v3": MoEModelConfig(
            vocab_size=129_280,
            embed_dim=7168,
            num_layers=61,
            num_heads=128,
            num_kv_heads=128,
            head_dim=128,
            mlp_dim=18_432,
            first_dense_layers=3,
            norm_eps=1e-6,
            max_seq_len=163_840,
            rope_scaling=YarnScaling(),
            moe=MoEConfig(
                num_experts=256,
                top_k=8,
                mlp_dim=2048,
                router="sigmoid",
                num_groups=8,
                topk_groups=4,
                routed_scale=2.5,
                num_shared_experts=1,
                shared_mlp_dim=2048,
            ),
            mla=MLAConfig(
                q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
            ),
        ),
    }
)

# Parameter counts of the published checkpoints (sum of tensor sizes in their safetensors).
PUBLISHED_PARAMS = {
    "llama3.2-1b": 1_235_814_400,
    "llama2-7b": 6_738_415_616,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
    "mistral-7b": 7_241_732_096,
    "qwen2-7b": 7_615_616_512,
    "qwen3-8b": 8_190_735_360,
    "mixtral-8x7b": 46_702_792_704,
    "mixtral-8x22b": 140_630_071_296,
    "qwen3-30b-a3b": 30_532_122_624,
    "qwen3-235b-a22b": 235_093_634_560,
    # DeepSeek-V3's safetensors (main model, no MTP) hold 671,026,419,200 values; 14,848 of them are the
    # routers' selection biases, which we keep as non-trained state, not parameters.
    "deepseek-v3": 671_026_419_200,
}


# The execution each preset is meant to run under, where it is not ``ExecutionConfig()``: the test models
# route with room to spare (capacity 2: no token dropped in the tests' batches), DeepSeek balances its
# routers by the selection bias (auxiliary-loss-free, rate 1e-3 as published).
EXECUTION_PRESETS: dict[str, ExecutionConfig] = {
    "tiny-moe": ExecutionConfig(capacity_factor=2.0),
    "tiny-deepseek": ExecutionConfig(capacity_factor=2.0, bias_update_rate=1e-3),
    "deepseek-v3": ExecutionConfig(bias_update_rate=1e-3),
}


def get_model_preset(name: str, /, **overrides) -> DenseConfig:
    """A preset by name, with model config field overrides (e.g. ``num_layers=4``); execution settings
    are not model fields (``get_execution_preset``, ``build_model(..., execution=...)``)."""
    try:
        cfg = PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"--model: unknown model preset {name!r}{suggest(name, PRESETS)}; presets are {', '.join(PRESETS)}"
        ) from None
    moved = sorted(set(overrides) & {f.rpartition(".")[2] for f in MOVED_FROM_MODEL})
    if moved:
        raise ConfigError(
            f"{', '.join(moved)}: execution settings, not model config fields; give them as "
            f"ExecutionConfig({', '.join(f'{m}=...' for m in moved)}) (jaxpar.execution)"
        )
    fields = [f.name for f in dataclasses.fields(cfg)]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ConfigError(f"{unknown[0]}: not a field of the {name} model's config{suggest(unknown[0], fields)}")
    try:
        return dataclasses.replace(cfg, **overrides)
    except ConfigError:  # a config's own check, naming its field
        raise
    except (TypeError, ValueError) as err:  # an unnamed one
        raise ConfigError(f"{', '.join(f'{k}={v!r}' for k, v in overrides.items())}: {err}") from None


def get_execution_preset(name: str, /, **overrides) -> ExecutionConfig:
    """The execution model preset ``name`` is meant to run under (``EXECUTION_PRESETS``, else the
    defaults), with field overrides (e.g. ``remat='dots'``)."""
    get_model_preset(name)  # an unknown name is refused as there
    return dataclasses.replace(EXECUTION_PRESETS.get(name, ExecutionConfig()), **overrides)


def config_to_dict(cfg: DenseConfig, /) -> dict:
    """A model config as JSON-ready data, tagged with its class (``jaxpar.config.to_dict``)."""
    return to_dict(cfg, DenseConfig)


def config_from_dict(data: dict, /) -> DenseConfig:
    """Inverse of ``config_to_dict``: the family's own config class (``jaxpar.config.from_dict``). Data
    saved before the execution settings left the model config is read without them
    (``jaxpar.execution.split_saved_model`` maps them to their new home)."""
    return from_dict(DenseConfig, split_saved_model(data)[0], where="model")


def build_model(cfg: DenseConfig, /, *, rngs: nnx.Rngs, execution: ExecutionConfig | None = None) -> DenseLM:
    """The family's model of ``cfg``, run as ``execution`` says (default ``ExecutionConfig()``)."""
    family = MoELM if isinstance(cfg, MoEModelConfig) else DenseLM
    return family(cfg, execution=execution, rngs=rngs)


__all__ = [
    "DenseConfig",
    "DenseLM",
    "MoEConfig",
    "MoELM",
    "MoEModelConfig",
    "Remat",
    "ExecutionConfig",
    "EXECUTION_PRESETS",
    "PRESETS",
    "PUBLISHED_PARAMS",
    "get_model_preset",
    "get_execution_preset",
    "build_model",
    "config_to_dict",
    "config_from_dict",
]
