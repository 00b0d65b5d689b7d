"""The layout check of a model whose weights are stored quantized (``model.quantize``, or QLoRA's
``model.lora.quantize``): the weights each config lists (``quantized_weights``), and the group and block
counts their scales and packed pairs split dimensions into (``jaxpar.layers.codes.stored_shapes``),
which must divide the mesh axes as the dimensions themselves do."""

from __future__ import annotations

import math

from jaxpar.layers.lora import SPECS
from jaxpar.layers.quant import stored_shapes
from jaxpar.rules import Dim


def mlp_weights(d: int, f: int, field: str) -> list[tuple]:
    """A SwiGLU's two weights of width ``f`` (config field ``field``) as ``quantized_weights`` lists them."""
    return [
        ((d, 2, f), ("embed", None, "mlp"), ("embed_dim", None, field), SPECS["gate_up"]),
        ((f, d), ("mlp", "embed"), (field, "embed_dim"), SPECS["down"]),
    ]


def mla_weights(cfg, d: int, n: int) -> list[tuple]:
    """An MLA layer's weights as ``DenseConfig.quantized_weights`` lists them."""
    hq, hkv = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim
    rq, rkv, heads = cfg.q_lora_rank, cfg.kv_lora_rank, ("heads", "head_dim")
    qf = ("num_heads", "mla.qk_nope_head_dim + qk_rope_head_dim")
    kvf = ("num_heads", "mla.qk_nope_head_dim + v_head_dim")
    if rq is None:
        q = [((d, n, hq), ("embed", *heads), ("embed_dim", *qf), SPECS["q"])]
    else:
        q = [
            ((d, rq), ("embed", "q_lora"), ("embed_dim", "mla.q_lora_rank"), SPECS["q_a"]),
            ((rq, n, hq), ("q_lora", *heads), ("mla.q_lora_rank", *qf), SPECS["q_b"]),
        ]
    return [
        *q,
        ((d, rkv + cfg.qk_rope_head_dim), ("embed", None), ("embed_dim", None), SPECS["kv_a"]),
        ((rkv, n, hkv), ("kv_lora", *heads), ("mla.kv_lora_rank", *kvf), SPECS["kv_b"]),
        ((n, cfg.v_head_dim, d), (*heads, "embed"), ("num_heads", "mla.v_head_dim", "embed_dim"), SPECS["o"]),
    ]


def with_stored_groups(cfg, dims: dict[str, Dim]) -> dict[str, Dim]:
    """``dims`` with each dimension that ``cfg``'s stored weights split also bound by the parts
    (``stored_groups``): their count where it divides the dimension (a mesh size dividing it then
    divides both), else their gcd with it."""
    for name, groups in stored_groups(cfg).items():
        have = dims.get(name)
        if have is not None and have.size % groups.size:
            groups = Dim(math.gcd(have.size, groups.size), f"gcd({have.field}, {groups.field})")
        dims[name] = groups
    return dims


def stored_groups(cfg) -> dict[str, Dim]:
    """A quantized weight's scales split dimensions into groups or blocks, and a 4-bit format packs one
    in pairs, sharded as the dimension is. Per logical name, their gcd (a mesh size divides every count
    exactly when it divides their gcd); a scale of one group along a dimension is not split there."""
    kind = cfg.stored_as
    if kind in ("none", "int8"):
        return {}
    setting = f"model.lora.quantize={kind}" if cfg.lora.quantize != "none" else f"model.quantize={kind}"
    found: dict[str, dict[str, int]] = {}
    for shape, names, fields, spec in cfg.quantized_weights():
        data, scale = stored_shapes(shape, spec, kind)
        for a, name in enumerate(names):
            # groups split a dimension more finely than packing's pairs, where there are several
            part = scale[a] if 1 < scale[a] < shape[a] else data[a]
            if name is not None and part != shape[a]:
                found.setdefault(name, {})[f"model.{fields[a]} / {shape[a] // part}"] = part
    dims = {}
    for name, counts in found.items():
        text = ", ".join(counts) if len(counts) == 1 else f"gcd({', '.join(counts)})"
        dims[name] = Dim(math.gcd(*counts.values()), f"{text} (the groups of {setting})")
    return dims
