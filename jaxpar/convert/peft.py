"""LoRA adapters as PEFT keeps them: a folder with ``adapter_config.json`` and ``adapter_model.safetensors``,
in (``adapter_config``, ``load_adapter``) and out (``save_adapter``).

PEFT names an adapter after the module it adapts, ``base_model.model.<module>.lora_A.weight`` [r, in] and
``lora_B.weight`` [out, r]. Our adapter of a weight (``jaxpar.layers.lora``) carries the weight's own
dimension labels, so each adapter's HF tensors follow from the family's map of the weight itself
(``weights.sources``): A takes the weight's input group, B its output group, and our gate and up
adapters are PEFT's ``gate_proj`` and ``up_proj`` (or a family's own names for them). Scaling:
``lora_alpha / r``; an rsLoRA adapter (``lora_alpha / √r``) is read with the equivalent alpha.

``adapter_config.json`` is checked like ``config.json`` (``fields``): a field that changes what the
adapter computes is accepted only at the value we implement (no DoRA, no bias, no per-module ranks, no
saved extra modules), and a field we do not know is refused unless it is off (null, false or empty).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxpar.convert.families import FAMILIES, Family, guess_family, sources
from jaxpar.convert.files import ConvertError
from jaxpar.convert.mapping import Source, read_shard, write_pieces
from jaxpar.layers.lora import EXPERT_TARGETS, PARTS, SPECS, LoraConfig, LoraParam, letters

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
# Fields that do not change what a loaded adapter computes (training-time settings, provenance)
IGNORED = {
    "task_type",
    "auto_mapping",
    "peft_version",
    "base_model_name_or_path",
    "revision",
    "inference_mode",
    "lora_dropout",
    "init_lora_weights",
    "loftq_config",
    "eva_config",
    "corda_config",
    "lora_ga_config",
    "megatron_core",
    "qalora_group_size",
    "ensure_weight_tying",
    "layers_pattern",
}
READ = {"peft_type", "r", "lora_alpha", "use_rslora", "target_modules"}
FIXED = {"bias": "none", "fan_in_fan_out": False, "use_dora": False, "lora_bias": False, "use_qalora": False}


def adapter_sources(cfg, fam: Family) -> dict[tuple[str, ...], Source]:
    """Our adapters' paths (``…/{name}_lora_a``, ``_b``) -> their PEFT tensors, for every weight a LoRA
    target can adapt in ``cfg``'s model but the routed experts' (``save_adapter``)."""
    out = {}
    for path, src in sources(dataclasses.replace(cfg, lora=LoraConfig()), fam).items():
        name = path[-1]
        if name not in SPECS or "E" in src.ours:
            continue
        _, w, _, contracted, shared, outs = letters(SPECS[name], PARTS.get(name, ""))
        lead = src.ours[: len(src.ours) - len(w)]  # the layers
        label = dict(zip(w, src.ours[len(lead) :]))
        hf_out, hf_in = src.hf  # nn.Linear: [out, in]

        def names(kind: str, src=src) -> tuple[str, ...]:
            return tuple(f"{PREFIX}{n.removesuffix('.weight')}.lora_{kind}.weight" for n in src.names)

        a = (*lead, *(label[c] for c in shared + contracted), "z")
        b = (*lead, *(label[c] for c in shared), "z", *(label[c] for c in outs))
        out[(*path[:-1], f"{name}_lora_a")] = Source(names("A"), a, ("z", hf_in), src.layer_offset)
        out[(*path[:-1], f"{name}_lora_b")] = Source(names("B"), b, (hf_out, "z"), src.layer_offset)
    return out


def _module(tensor: str) -> str:
    """The module name PEFT matches ``target_modules`` against: ``q_proj`` of ``….q_proj.lora_A.weight``."""
    return tensor.split(".")[-3]


def _targets(cfg, fam: Family) -> dict[str, set[str]]:
    """Our LoRA target -> the HF module names its adapters are written as."""
    found: dict[str, set[str]] = {}
    for path, src in adapter_sources(cfg, fam).items():
        found.setdefault(path[-1].removesuffix("_lora_a").removesuffix("_lora_b"), set()).update(
            _module(n) for n in src.names
        )
    return found


def _paths(keys) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", k)) for k in keys)


def _family(cfg, family: str | None) -> Family:
    if family and family not in FAMILIES:
        raise ConvertError(f"family={family!r}: not one of {', '.join(sorted(FAMILIES))}")
    return FAMILIES[family] if family else guess_family(cfg)


def save_adapter(model, folder: str | os.PathLike, *, family: str | None = None, base: str | None = None) -> Path:
    """Write ``model``'s LoRA adapters as a PEFT adapter folder (new: ``folder`` must not exist) that
    ``peft.PeftModel.from_pretrained`` loads onto the Hugging Face model ``to_hf`` writes without them.
    ``base``: recorded as ``base_model_name_or_path``."""
    cfg, out = model.cfg, Path(folder)
    if not cfg.lora.rank:
        raise ConvertError("the model has no LoRA adapters (model.lora.rank=0): nothing to write as PEFT")
    if set(EXPERT_TARGETS) & set(cfg.lora.names):
        raise ConvertError(
            f"model.lora.targets={cfg.lora.targets!r}: the routed experts' adapters are not written as PEFT "
            "(transformers fuses the experts into one parameter, which PEFT adapts in a form of its own); "
            "export the merged model (--to-hf) instead"
        )
    if out.exists():
        raise ConvertError(f"{out.resolve()}: exists; the export writes a new folder and never overwrites")
    fam = _family(cfg, family)
    table, tensors = adapter_sources(cfg, fam), {}
    for keys, var in nnx.to_flat_state(nnx.state(model, LoraParam)):
        path, array = _paths(keys), var.get_value()
        if path not in table:
            raise ConvertError(f"{'/'.join(path)}: {fam.model_type} has no PEFT module for this adapter")
        for name, x in write_pieces(table[path], lambda at, a=array: np.asarray(a[at]), array.shape, {}):
            tensors[name] = np.ascontiguousarray(x)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": cfg.lora.rank,
        "lora_alpha": cfg.lora.alpha,
        "target_modules": sorted({_module(n) for n in tensors}),
        "lora_dropout": 0.0,
        "use_rslora": False,
        "inference_mode": True,
    } | FIXED
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _read_config(folder: Path) -> dict:
    path = folder / ADAPTER_CONFIG
    if not path.is_file() or not (folder / ADAPTER_WEIGHTS).is_file():
        raise ConvertError(f"{folder}: a PEFT adapter folder has {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConvertError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise ConvertError(f"{path}: holds a JSON {type(config).__name__}, not an object")
    return config


def _check_fields(config: dict, where: Path) -> None:
    if config.get("peft_type") != "LORA":
        raise ConvertError(f"{where}: peft_type={config.get('peft_type')!r}; only LORA adapters are supported")
    for key, value in config.items():
        if key in FIXED and value != FIXED[key]:
            raise ConvertError(f"{where}: {key}={value!r} is not supported (only {FIXED[key]!r})")
        if key not in FIXED and key not in IGNORED | READ and value not in (None, False, {}, [], ""):
            raise ConvertError(
                f"{where}: unsupported field {key!r} (= {value!r}); the import refuses what it does not "
                "implement rather than guess"
            )


def adapter_config(folder: str | os.PathLike, model_cfg, *, family: str | None = None) -> LoraConfig:
    """The ``LoraConfig`` of a PEFT adapter folder for a model of ``model_cfg``, checked field by field."""
    folder = Path(folder)
    config, where = _read_config(folder), folder / ADAPTER_CONFIG
    _check_fields(config, where)
    r, alpha, modules = config.get("r"), config.get("lora_alpha"), config.get("target_modules")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ConvertError(f"{where}: r={r!r} must be a positive integer")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0:
        raise ConvertError(f"{where}: lora_alpha={alpha!r} must be a positive number")
    if not isinstance(modules, list) or not modules or not all(isinstance(m, str) for m in modules):
        raise ConvertError(
            f"{where}: target_modules={modules!r}; a list of module names is supported (not a regex or 'all-linear')"
        )
    known = _targets(model_cfg, _family(model_cfg, family))
    unknown = sorted(set(modules) - set().union(*known.values()))
    if unknown:
        raise ConvertError(f"{where}: target_modules names {unknown[0]!r}, not a module this model adapts")
    targets = [t for t, names in known.items() if names & set(modules)]
    if config.get("use_rslora"):
        alpha = alpha * math.sqrt(r)  # alpha / √r == (alpha · √r) / r
    return LoraConfig(rank=r, alpha=float(alpha), targets=",".join(targets))


def read_adapter(model, folder: str | os.PathLike, *, family: str | None = None) -> dict[tuple[str, ...], np.ndarray]:
    """The adapters of a PEFT folder as host arrays, by their path in ``model`` (built with
    ``adapter_config(folder, …)``'s LoRA config; an abstract model from ``nnx.eval_shape`` will do). A
    module the folder holds no adapter for (e.g. ``up_proj`` of an adapter on ``gate_proj`` alone) reads
    A = B = 0: the base unchanged, as in PEFT. Every tensor is checked for shape before any is read into
    place, and one the model does not read is refused."""
    folder, cfg = Path(folder), model.cfg
    file = folder / ADAPTER_WEIGHTS
    want = adapter_config(folder, cfg, family=family)
    if (cfg.lora.rank, cfg.lora.scale) != (want.rank, want.scale) or set(cfg.lora.names) != set(want.names):
        raise ConvertError(f"{folder}: the adapter is {want}, the model's model.lora is {cfg.lora}")
    table = adapter_sources(cfg, _family(cfg, family))
    with safe_open(file, framework="numpy") as f:
        stored = {n: f.get_tensor(n) for n in f.keys()}  # adapters are small: read whole
    shapes = {_paths(keys): var.get_value() for keys, var in nnx.to_flat_state(nnx.state(model, LoraParam))}
    used = set()
    for path, value in shapes.items():
        src, shape = table[path], tuple(value.shape)
        for name in src.all_hf_names(shape):
            pair = name.replace("lora_A", "lora_B") if "lora_A" in name else name.replace("lora_B", "lora_A")
            if (name in stored) != (pair in stored):
                raise ConvertError(f"{file}: {name if name not in stored else pair} is missing (its pair is there)")
            if name in stored and tuple(stored[name].shape) != src.hf_shape(shape, {}):
                raise ConvertError(
                    f"{file}: {name} has shape {list(stored[name].shape)}, not {list(src.hf_shape(shape, {}))}"
                )
            used.add(name)
    extra = sorted(set(stored) - used)
    if extra:
        raise ConvertError(f"{file}: {extra[0]} is not an adapter of this model ({len(extra)} such tensors)")
    out = {}
    for path, value in shapes.items():
        src = table[path]

        def read(name, box, src=src, shape=tuple(value.shape)):
            return stored[name][box] if name in stored else np.zeros(src.hf_shape(shape, {}), np.float32)[box]

        out[path] = read_shard(src, value.shape, [slice(None)] * value.ndim, read, {}, np.dtype(value.dtype))
    return out


def load_adapter(model, folder: str | os.PathLike, *, family: str | None = None):
    """``model`` (built with ``adapter_config(folder, …)``'s LoRA config) with its adapters read from the
    PEFT folder (``read_adapter``), each placed with its own sharding."""
    arrays = read_adapter(model, folder, family=family)
    flat = nnx.to_flat_state(nnx.state(model, LoraParam))
    for keys, var in flat:
        var.set_value(jax.device_put(arrays[_paths(keys)], var.get_value().sharding))
    nnx.update(model, nnx.from_flat_state(flat))
    return model
