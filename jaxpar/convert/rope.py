"""RoPE in config.json, in and out of ours: the classic fields (``rope_theta``, ``rope_scaling``) or
transformers 5's ``rope_parameters``; scaling ``default`` (none), ``llama3`` (``RopeScaling``) and, for
the families that allow it, ``yarn`` (``YarnScaling``)."""

from __future__ import annotations

from jaxpar.convert.files import ConvertError
from jaxpar.layers.rope import RopeScaling, YarnScaling


def rope_in(hf: dict, *, yarn: bool = False):
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


def rope_out(theta: float, scaling) -> dict:
    """The classic fields of ``theta`` and ``scaling`` (None, ``RopeScaling`` or ``YarnScaling``)."""
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
