"""Model checkpoints: what ``jaxpar convert --from-hf`` writes, ``jaxpar train --init-from`` fine-tunes
from and ``jaxpar convert --to-hf`` exports (which also takes a training run's directory).

A model checkpoint is a folder with ``model.json`` (the jaxpar model config, the execution it was made to
run under, and where it came from) and ``checkpoints/0``, an orbax checkpoint of the same kind a training
run writes (items state, data, config) whose state is the model's alone. Restores place each array
straight into its shards.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import orbax.checkpoint as ocp
from flax import nnx

from jaxpar.checkpoint import Checkpointer, abstract_like, latest
from jaxpar.config import from_dict, to_dict
from jaxpar.convert import from_hf
from jaxpar.convert.base import adapters_only, check_base, without_base
from jaxpar.convert.files import ConvertError, is_hf_folder
from jaxpar.errors import ConfigError
from jaxpar.execution import ExecutionConfig, split_saved_model
from jaxpar.identity import Entry, check_fits
from jaxpar.layers.lora import SPECS
from jaxpar.layers.quant import quantized_like
from jaxpar.models import build_model, config_from_dict, config_to_dict

MODEL_JSON = "model.json"


def save_model(model, out: str | Path, *, source: dict) -> Path:
    """Write ``model`` as a model checkpoint in the new folder ``out`` (refused if it exists)."""
    out = Path(out).resolve()
    if out.exists():
        raise ConvertError(f"{out}: exists; conversion writes a new folder and never overwrites")
    info = {
        "format": "jaxpar-model",
        "model": config_to_dict(model.cfg),
        "execution": to_dict(model.execution),
        "source": source,
    }
    tmp = out.with_name(f".{out.name}.partial")
    checkpoints = Checkpointer(tmp / "checkpoints", every=1, keep=1, async_save=False)
    try:
        checkpoints.save(0, state=nnx.state(model), data={}, config=info, force=True)
    finally:
        checkpoints.close()
    (tmp / MODEL_JSON).write_text(json.dumps(info, indent=2) + "\n")
    tmp.rename(out)
    return out


def model_config(ckpt: str | Path):
    """(model config, step, whether ``ckpt`` is a training run) of a model checkpoint or a run folder."""
    ckpt = Path(ckpt).resolve()
    saved = latest(ckpt / "checkpoints")
    if saved is None:
        raise ConvertError(f"{ckpt}: holds no complete checkpoint (expected {ckpt / 'checkpoints'}/<step>)")
    model = saved.config.get("model") if isinstance(saved.config, dict) else None
    if not isinstance(model, dict):
        raise ConvertError(f"{ckpt}: its checkpoint config has no model section")
    try:
        cfg = config_from_dict(model)  # the family's own class (read by its fields if untagged)
    except ConfigError as err:
        raise ConvertError(f"{ckpt}: its model config cannot be read by this version of jaxpar ({err})") from None
    return cfg, saved.step, saved.config.get("format") != "jaxpar-model"


def saved_execution(ckpt: str | Path) -> ExecutionConfig:
    """The execution a model checkpoint was made to run under, or a training run ran under: its
    ``execution`` section; a run saved before the execution settings left the model config holds them
    under ``model`` (``jaxpar.execution.split_saved_model``); ``ExecutionConfig()`` for the rest."""
    ckpt = Path(ckpt).resolve()
    saved = latest(ckpt / "checkpoints")
    config = saved.config if saved is not None and isinstance(saved.config, dict) else {}
    data = config.get("execution")
    if not isinstance(data, dict):
        data = split_saved_model(config.get("model"))[1]
    try:
        return from_dict(ExecutionConfig, data, where="execution")
    except ConfigError as err:
        raise ConvertError(f"{ckpt}: its execution settings cannot be read by this version of jaxpar ({err})") from None


def base_weights(init_from: str | Path, cfg, execution: ExecutionConfig, layout, target) -> nnx.State:
    """The weights of ``init_from`` (a model checkpoint, a run, or a Hugging Face folder) restored onto
    ``layout`` for a model of ``cfg``; where ``target`` (that model's state, or its abstract arrays with
    their shardings) holds a weight quantized (QLoRA), the loaded one is quantized as it is."""
    if is_hf_folder(init_from):
        settings = {f.name: getattr(execution, f.name) for f in dataclasses.fields(execution)}
        model = from_hf(init_from, param_dtype=cfg.param_dtype, execution=settings, layout=layout)
    else:
        model, _ = load_model(init_from, layout)
    loaded = nnx.state(model)
    if cfg.stored_as != "none":  # QLoRA (or a model for serving): the weights stored quantized, as the model's are
        loaded = quantized_like(target, loaded, SPECS, cfg.stored_as)
    return loaded


def load_model(ckpt: str | Path, layout, /):
    """The model of a model checkpoint or of a training run's newest checkpoint, restored onto
    ``layout`` (a ``jaxpar.layout.Layout``); the optimizer state of a run is not read. A LoRA run that
    saved its adapters alone (``jaxpar.convert.base``) gets its base from its ``init_from``, checked."""
    cfg, step, is_run = model_config(ckpt)
    execution = saved_execution(ckpt)
    run_config = latest(Path(ckpt).resolve() / "checkpoints").config if is_run else {}
    alone = adapters_only(run_config)
    with layout.activate():
        abstract = nnx.eval_shape(lambda: build_model(cfg, execution=execution, rngs=nnx.Rngs(0)))
        graphdef, full = nnx.split(abstract)
        every = abstract_like(full, nnx.get_named_sharding(full, layout.mesh))
        abstract = without_base(full, run=False) if alone else full
        target = without_base(every, run=False) if alone else every
    check_fits(
        Entry.LOAD,
        saved_config=None,
        step=step,
        where=Path(ckpt).resolve(),
        checkpoints=Path(ckpt).resolve() / "checkpoints",
        abstract=abstract,
        prefix="0/" if is_run else "",
    )
    item = {"0": target} if is_run else target  # a run saved (model, optimizer)
    manager = ocp.CheckpointManager(
        Path(ckpt).resolve() / "checkpoints",
        options=ocp.CheckpointManagerOptions(read_only=True),
        item_names=("state", "data", "config"),
    )
    try:
        restore_args = ocp.checkpoint_utils.construct_restore_args(item)  # the target shardings
        args = ocp.args.Composite(state=ocp.args.PyTreeRestore(item, restore_args=restore_args, partial_restore=True))
        state = manager.restore(step, args=args)["state"]
    finally:
        manager.close()
    state = state["0"] if is_run else state
    if alone:
        base = base_weights(run_config["init_from"], cfg, execution, layout, every)
        check_base(Path(ckpt).resolve(), base)
        state = nnx.merge_state(base, state)
    return nnx.merge(graphdef, state), step
