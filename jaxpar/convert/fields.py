"""The config.json fields the families share, and ``Family``, what each family declares.

Each family has an allow-list. A config field is either *read* (it sets something of ours), *fixed*
(accepted only at the value our implementation computes: ``hidden_act: "silu"``, ``mlp_bias: false``,
...), or *metadata* that does not change the function the model computes (token ids, dtype, version).
Any other field, and any fixed field with another value, is refused with its name: a field we do not
understand may change the model, and a silently wrong conversion is worse than none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jaxpar.convert.files import ConvertError
from jaxpar.convert.rope import rope_in, rope_out
from jaxpar.execution import ExecutionConfig
from jaxpar.models.dense import DenseConfig

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
    "quantization_config",
}  # tie_word_embeddings is read (below), listed so every family allows it; quantization_config is
# checked, and its tensors dequantized, by the reader (jaxpar.convert.files.HFFolder)
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
    """One Hugging Face family: its names, its allow-list (``read``, ``fixed``), its config in both
    directions, and how Hugging Face runs its models (``execution``, from its config.json)."""

    model_type: str
    architecture: str
    read: frozenset
    fixed: dict
    to_ours: Callable[[dict], DenseConfig]
    to_hf: Callable[[DenseConfig, ExecutionConfig], dict]
    execution: Callable[[dict], ExecutionConfig] = lambda hf: ExecutionConfig()  # how HF runs the model


def check_fields(hf: dict, fam: Family, where: str) -> None:
    """Refuses, by name, a field of ``hf`` that ``fam`` neither reads nor fixes nor counts as metadata,
    and a fixed field with another value (``where``: the file, for the message)."""
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


def dense_kw(hf: dict, *, yarn: bool = False, **extra) -> dict:
    """``DenseConfig``'s fields from the config.json fields every family shares (``yarn``: the family
    allows YaRN rope scaling), with ``extra``."""
    theta, scaling = rope_in(hf, yarn=yarn)
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


def dense_out(cfg: DenseConfig, fam: Family, **extra) -> dict:
    """The config.json of ``cfg`` as ``fam`` writes it: the shared fields, the family's fixed ones, ``extra``."""
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
            **rope_out(cfg.rope_theta, cfg.rope_scaling),
        }
        | {k: v for k, v in fam.fixed.items() if k != "layer_types"}
        | extra
    )


def make_family(model_type, architecture, read, fixed, to_ours, to_hf, execution=None) -> Family:
    """A ``Family`` that reads ``DENSE_READ`` and ``read``; ``execution`` defaults to ``ExecutionConfig()``."""
    read = frozenset(DENSE_READ | set(read))
    if execution is None:
        return Family(model_type, architecture, read, fixed, to_ours, to_hf)
    return Family(model_type, architecture, read, fixed, to_ours, to_hf, execution)
