"""Quantized Hugging Face checkpoints, read as they ship (``quantization_config`` in config.json).

* **Block-scaled FP8** (``quant_method: "fp8"``: DeepSeek-V3's and Qwen3's ``-FP8`` releases). A linear's
  ``weight`` [out, in] is float8 e4m3 beside ``weight_scale_inv`` [⌈out/bo⌉, ⌈in/bi⌉] (float32), one
  factor per bo × bi block (``weight_block_size``, [128, 128] as published); a weight with leading
  dimensions (fused experts) has a scale per leading index. The value is ``float32(weight) ·
  weight_scale_inv`` (the producers' name: the factor that undoes the quantization). Where a dimension
  is not a multiple of its block, the last block covers what remains. ``BlockFP8.read`` dequantizes the
  box a reader asks for, exactly that float32 product, and the model casts it to its parameter dtype.
  Tensors without a scale (norms, the embedding, the router, ``modules_to_not_convert``) are read as
  stored.
* Anything else is refused before a tensor is read, naming it: another ``quant_method`` (gptq, awq,
  bitsandbytes, ...), compressed-tensors in any scheme (its format and weight scheme are named), FP8
  with another format, static activation scales, or scales of another shape.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxpar.errors import ConvertError

SCALE = "_scale_inv"  # suffix of a weight's scale tensor
FP8 = {"F8_E4M3"}  # safetensors dtypes a block-FP8 weight may have
FP8_FIELDS = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert"}
FP8_FIELDS |= {"ignored_layers"}  # which modules stayed unquantized: their tensors carry no scale


@dataclasses.dataclass(frozen=True)
class BlockFP8:
    block: tuple[int, int]  # (rows, columns) of [out, in] per scale

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The scale tensor's shape for a weight of ``shape``."""
        *lead, out, inp = shape
        return (*lead, math.ceil(out / self.block[0]), math.ceil(inp / self.block[1]))

    def scale_box(self, box: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
        """The blocks of the scale tensor a box of the weight covers."""
        *lead, rows, cols = (range(*s.indices(n)) for s, n in zip(box, shape))
        grid = zip((rows, cols), self.block)
        blocks = [slice(r.start // b, -(-r.stop // b)) if len(r) else slice(0, 0) for r, b in grid]
        return (*(slice(r.start, r.stop) for r in lead), *blocks)

    def dequantize(self, data: np.ndarray, scale: np.ndarray, box: tuple[slice, ...], shape) -> np.ndarray:
        """``data`` (the weight's ``box``) times its blocks' factors (``scale``: ``scale_box``'s part), in float32."""
        rows, cols = (range(*s.indices(n)) for s, n in zip(box[-2:], shape[-2:]))
        factor = np.repeat(np.repeat(scale.astype(np.float32), self.block[0], axis=-2), self.block[1], axis=-1)
        r0, c0 = rows.start % self.block[0], cols.start % self.block[1]
        factor = factor[..., r0 : r0 + len(rows), c0 : c0 + len(cols)]
        return data.astype(np.float32) * factor


def quantization(config: dict, where: str) -> BlockFP8 | None:
    """The scheme of a config.json's ``quantization_config`` (None without one); anything this reader
    does not implement is refused by name."""
    q = config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ConvertError(f"{where}: quantization_config={q!r} is not an object")
    method = q.get("quant_method")
    if method == "compressed-tensors":
        raise ConvertError(f"{where}: {_compressed(q)} is not supported; only block-scaled FP8 (quant_method fp8)")
    if method != "fp8":
        raise ConvertError(
            f"{where}: quantization_config.quant_method={method!r} is not supported; only block-scaled FP8 "
            "(quant_method fp8, as DeepSeek-V3 and Qwen3-FP8 ship)"
        )
    for key, value in q.items():
        if key not in FP8_FIELDS and value not in (None, False, [], {}, ""):
            raise ConvertError(f"{where}: quantization_config.{key}={value!r} is not supported for fp8")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ConvertError(f"{where}: quantization_config.fmt={q['fmt']!r}; only e4m3 weights are supported")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ConvertError(
            f"{where}: quantization_config.activation_scheme={q['activation_scheme']!r}; only dynamic (no "
            "activation scales in the checkpoint) is supported"
        )
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise ConvertError(
            f"{where}: quantization_config.weight_block_size={block!r}; block scales of two positive sizes "
            "(e.g. [128, 128]) are supported, not per-tensor ones"
        )
    return BlockFP8(tuple(block))


def _compressed(q: dict) -> str:
    """What a compressed-tensors config is, in words: its format and each group's weight scheme."""
    schemes = []
    for name, group in sorted((q.get("config_groups") or {}).items()):
        w = (group or {}).get("weights") or {}
        size = f" group {w['group_size']}" if w.get("group_size") else ""
        schemes.append(f"{name}: weights {w.get('type', '?')}{w.get('num_bits', '?')} {w.get('strategy', '?')}{size}")
    return f"quant_method 'compressed-tensors' (format {q.get('format')!r}; {'; '.join(schemes) or 'no groups'})"


def check_tensors(quant: BlockFP8, dtypes: dict[str, str], shapes: dict[str, tuple], where: str) -> None:
    """Every FP8 tensor has its scale, of the block grid's shape, and every scale its weight."""
    for name, dtype in dtypes.items():
        if name.endswith(SCALE):
            weight = name.removesuffix(SCALE)
            if weight not in dtypes:
                raise ConvertError(f"{where}: {name} scales {weight}, which is not in the checkpoint")
            if shapes[name] != quant.scale_shape(shapes[weight]):
                raise ConvertError(
                    f"{where}: {name} has shape {list(shapes[name])}; {list(shapes[weight])} in blocks of "
                    f"{list(quant.block)} needs {list(quant.scale_shape(shapes[weight]))}"
                )
        elif dtype in FP8 and name + SCALE not in dtypes:
            raise ConvertError(f"{where}: {name} is {dtype} without {name + SCALE}")
        elif dtype.startswith("F8") and dtype not in FP8:
            raise ConvertError(f"{where}: {name} is {dtype}; block-FP8 weights are F8_E4M3")
