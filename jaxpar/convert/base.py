"""LoRA runs whose checkpoints hold the adapters alone; the frozen base is read again from ``init_from``.

A LoRA run started ``--init-from`` a model (``checkpoint.adapters_only``, on by default) never changes
the base's weights, so writing them at every checkpoint would copy the base model each time (a 70B base:
140 GB per save). Its checkpoints hold what training changes: the adapters, the optimizer's state (which
holds only the adapters'), and any other state of the model (an MoE router's bias). Resuming, and
``load_model`` (``jaxpar generate``, ``serve``, ``convert --to-hf``/``--to-peft`` of the run), read the
base from ``init_from`` again, quantized as the run stores it (QLoRA).

So that the adapters are never put on another base, the run records ``base.json`` beside its checkpoints
when it starts: ``init_from`` and two checksums of every frozen array. Each is computed on the devices,
over the array's bits as unsigned integers, with wrap-around: the sum of the bits, and the sum of the
bits times each element's place (+1). Integer sums do not depend on the order of their terms, so the
checksums are exact under any mesh, and the second also changes when values trade places. A base whose
checksums differ is refused, naming the array.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.checkpoint import CheckpointError
from jaxpar.layers.lora import LoraParam
from jaxpar.layers.quant import Quantized

BASE_JSON = "base.json"


def adapters_only(config: dict) -> bool:
    """Whether a run of ``config`` (``to_dict`` of a ``TrainConfig``) saves its adapters alone."""
    lora = (config.get("model") or {}).get("lora") or {}
    checkpoint = config.get("checkpoint") or {}
    return bool(config.get("init_from")) and bool(lora.get("rank")) and checkpoint.get("adapters_only", True)


def is_base(var) -> bool:
    """A frozen base array of a model with adapters: a weight (or its quantized data and scales)."""
    return isinstance(var, (nnx.Param, Quantized)) and not isinstance(var, LoraParam)


def without_base(state, *, run: bool = True):
    """``state`` without the frozen base (``is_base``): of a run's (model, optimizer) state (``run``), or
    of a model's. Works on arrays, abstract arrays and shardings alike."""
    keep = [(p, v) for p, v in nnx.to_flat_state(state) if (run and str(p[0]) != "0") or not is_base(v)]
    return nnx.from_flat_state(keep)


def _bits(x: jax.Array) -> jax.Array:
    """``x``'s elements as unsigned integers of their own width, widened to uint32."""
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{x.dtype.itemsize * 8}")).astype(jnp.uint32)


@jax.jit
def _checksums(arrays: dict) -> dict:
    def pair(x):
        bits = _bits(x).reshape(-1)
        place = jnp.arange(1, bits.size + 1, dtype=jnp.uint32)
        return jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * place, dtype=jnp.uint32)])

    return {k: pair(v) for k, v in arrays.items()}


def checksums(model_state) -> dict[str, list[int]]:
    """The base's checksums (module doc), by array path, of a model's state."""
    arrays = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(model_state) if is_base(v)}
    return {k: [int(c) for c in np.asarray(v)] for k, v in _checksums(arrays).items()}


def base_record(init_from: str, model_state) -> dict:
    """What ``base.json`` holds for a run started from ``init_from`` with the base ``model_state``."""
    return {"init_from": str(Path(init_from).resolve()), "checksums": checksums(model_state)}


def check_base(run: Path, model_state) -> None:
    """Refuses a base (``model_state``, read from the run's ``init_from``) that is not the one the run
    recorded in ``base.json`` when it started."""
    path = Path(run) / BASE_JSON
    try:
        recorded = json.loads(path.read_text())["checksums"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"{path}: cannot be read ({err}); a run that saves its adapters alone needs it to check its base"
        ) from None
    found = checksums(model_state)
    differ = sorted(k for k in recorded.keys() | found.keys() if recorded.get(k) != found.get(k))
    if differ:
        more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
        raise CheckpointError(
            f"{path}: the base read from init_from is not the one this run's adapters were trained on: "
            f"{differ[0]} differs{more}. The checkpoints hold the adapters alone; put the run's base back "
            "at its init_from. Nothing was written."
        )
