"""Is this the same run? One answer, for every model family and every entry point.

A saved run or checkpoint fits the current config when

  * the model is the same: the model config, whole — every field of every family and every nested
    config (MoE, MLA, RoPE scaling, whatever a family adds). How the model is computed or trained is not
    in it (``jaxpar.execution``: remat, compute dtype, kernels, capacity, loss weights) and may change; a
    saved config from before those settings left the model is read without them;
  * (resume only) the data stream is the same: ``batch``, ``seq``, ``seed`` and ``data.*`` except the read
    settings in ``READ_SETTINGS``, so the batches that come next are the ones that would have come;
  * every saved array has the shape and dtype the current model (and optimizer) asks for. The expected
    shapes are derived from the abstract model (``nnx.eval_shape``), the saved ones read from the
    checkpoint's metadata: no list of shape fields is kept by hand, and no array is read.

Anything else may change: the execution settings, the mesh (a restore reshards), steps, the optimizer
and its schedule, grad_accum, z-loss, checkpoint and log settings. The entry points, all through ``check_fits``:

    Entry.RESUME      ``jaxpar train`` finding a checkpoint (or a config.json) in --out
    Entry.INIT_FROM   ``jaxpar train --init-from``: the checkpoint's model against the run's, weights only
    Entry.LOAD        ``jaxpar convert --to-hf`` and ``load_model``: the saved config against its own arrays

A refusal raises ``CheckpointError`` listing every field (or array) that differs, before anything is
written.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx

from jaxpar.config import Choice, from_dict, to_dict
from jaxpar.errors import CheckpointError, ConfigError
from jaxpar.execution import split_saved_model
from jaxpar.models import DenseConfig

STREAM_FIELDS = ("batch", "seq", "seed", "data")  # what decides the batches that come next
READ_SETTINGS = ("data.num_threads", "data.prefetch")  # how fast batches are read, not which
MAX_LISTED_ARRAYS = 12


class Entry(Choice):
    RESUME = "resume"
    INIT_FROM = "init-from"
    LOAD = "load"


_MISSING = object()


def _show(value) -> str:
    return "(absent)" if value is _MISSING else json.dumps(value)


def _diff(saved, now, path: str, skip) -> list[str]:
    if path in skip:
        return []
    if isinstance(saved, dict) and isinstance(now, dict):
        keys = list(saved) + [k for k in now if k not in saved]
        return [line for k in keys for line in _diff(saved.get(k, _MISSING), now.get(k, _MISSING), f"{path}.{k}", skip)]
    return [] if saved == now else [f"{path}: saved {_show(saved)}, now {_show(now)}"]


def _normalized_model(data, where) -> dict:
    """A saved model config as the current code writes it (tagged with its class, defaults filled; the
    execution settings saved in it before they moved, left out: ``split_saved_model``)."""
    if not isinstance(data, dict):
        raise CheckpointError(f"{where} holds no jaxpar model config (a JSON object); nothing was written")
    try:
        return to_dict(from_dict(DenseConfig, split_saved_model(data)[0], where="model"), DenseConfig)
    except ConfigError as err:
        raise CheckpointError(
            f"{where}: its saved model config cannot be read by this version of jaxpar ({err}); nothing was written"
        ) from None


def model_differences(saved_model: dict, current_model: dict, /, *, where="the checkpoint") -> list[str]:
    """Every model field where the saved config and the current one (``to_dict`` data, tagged with its
    class) disagree: ``model.moe.top_k: saved 2, now 1``."""
    return _diff(_normalized_model(saved_model, where), current_model, "model", set())


def stream_differences(saved: dict, current: dict, /) -> list[str]:
    """``batch``, ``seq``, ``seed`` and ``data.*`` (less the read settings) that differ."""
    return [
        line
        for key in STREAM_FIELDS
        for line in _diff(saved.get(key, _MISSING), current.get(key, _MISSING), key, set(READ_SETTINGS))
    ]


def saved_arrays(checkpoints: Path, step: int, /) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{path: (shape, dtype)}`` of every array of checkpoint ``step``'s state, from its metadata."""
    handlers = {
        "state": ocp.StandardCheckpointHandler(),
        "data": ocp.JsonCheckpointHandler(),
        "config": ocp.JsonCheckpointHandler(),
    }
    manager = ocp.CheckpointManager(
        checkpoints, options=ocp.CheckpointManagerOptions(read_only=True), item_handlers=handlers
    )
    try:
        tree = manager.item_metadata(step)["state"]
    finally:
        manager.close()
    if tree is None:
        raise CheckpointError(f"{checkpoints / str(step)}: no array metadata in its state item")
    out = {}
    for keys, meta in jax.tree_util.tree_flatten_with_path(getattr(tree, "tree", tree))[0]:
        names = [str(getattr(k, "key", getattr(k, "idx", k))) for k in keys]
        names = names[:-1] if names and names[-1] == "value" else names  # nnx.Variable's value
        out["/".join(names)] = (tuple(meta.shape), str(meta.dtype))
    return out


def abstract_arrays(state, /, *, prefix: str = "") -> dict[str, tuple[tuple[int, ...], str]]:
    """``{path: (shape, dtype)}`` of an abstract ``nnx.State`` (from ``nnx.eval_shape``)."""
    out = {}
    for keys, var in nnx.to_flat_state(state):
        value = var.get_value()
        out[prefix + "/".join(map(str, keys))] = (tuple(value.shape), str(value.dtype))
    return out


def array_differences(saved: dict, expected: dict, /) -> list[str]:
    """Arrays missing, extra, or of another shape or dtype (at most ``MAX_LISTED_ARRAYS`` listed)."""

    def show(a):
        return f"{a[1]}{list(a[0])}"

    lines = [
        f"{path}: saved {show(saved[path]) if path in saved else '(absent)'}, now "
        f"{show(expected[path]) if path in expected else '(absent)'}"
        for path in sorted(saved.keys() | expected.keys())
        if saved.get(path) != expected.get(path)
    ]
    if len(lines) > MAX_LISTED_ARRAYS:
        lines = lines[:MAX_LISTED_ARRAYS] + [f"... and {len(lines) - MAX_LISTED_ARRAYS} more arrays"]
    return lines


def check_fits(
    entry: Entry,
    /,
    *,
    saved_config: dict,
    current=None,
    step: int | None,
    where: Path,
    checkpoints: Path | None = None,
    abstract=None,
    prefix: str = "",
) -> None:
    """Raises ``CheckpointError`` listing every difference between a saved run and the current one.

    ``saved_config``: the saved run's config (RESUME: the whole run config; INIT_FROM: the model's);
    ``current``: the current one as ``jaxpar.config.to_dict`` data (RESUME: the run config; INIT_FROM: the
    model config, tagged with its class); ``checkpoints``/``step``/``abstract``: compare the saved arrays
    with an abstract ``nnx.State`` (``prefix``, e.g. ``"0/"``, selects the model part of a run's
    (model, optimizer) state)."""
    lines = []
    if entry == Entry.RESUME:
        if not isinstance(saved_config, dict) or not isinstance(saved_config.get("model"), dict):
            raise CheckpointError(
                f"{where} holds no jaxpar run config (a JSON object with a model section); "
                "nothing was written. Use another --out."
            )
        lines = model_differences(saved_config["model"], current["model"], where=where)
        lines += stream_differences(saved_config, current)
    elif entry == Entry.INIT_FROM:
        lines = model_differences(saved_config, current, where=where)
    if not lines and abstract is not None and checkpoints is not None:
        saved = saved_arrays(checkpoints, step)
        if prefix:
            saved = {p: a for p, a in saved.items() if p.startswith(prefix)}
        lines = array_differences(saved, abstract_arrays(abstract, prefix=prefix))
    if lines:
        raise CheckpointError(_refusal(entry, where, step) + "\n  " + "\n  ".join(lines) + "\n" + _advice(entry))


def _refusal(entry: Entry, where: Path, step: int | None) -> str:
    held = f"a checkpoint (step {step}) of a run" if step is not None else "the config of a run"
    return {
        Entry.RESUME: f"{where} holds {held} this one cannot resume:",
        Entry.INIT_FROM: f"--init-from {where}: its model is not the one this run asks for:",
        Entry.LOAD: f"{where}: its arrays do not fit the model its config describes:",
    }[entry]


def _advice(entry: Entry) -> str:
    return {
        Entry.RESUME: "Nothing was written. Use another --out, or the saved settings to resume (these may "
        "change on resume: the execution settings, execution.*, and the mesh, steps, optimizer, checkpoint "
        "and log settings).",
        Entry.INIT_FROM: "Nothing was written. The model config may not change; the execution settings "
        "(execution.*) may.",
        Entry.LOAD: "Nothing was written. The checkpoint was edited or written by another program.",
    }[entry]
