"""Checkpoints of a training run, on orbax's ``CheckpointManager``.

One checkpoint = one step directory with three items:
    state    the model parameters and optimizer state (``nnx.state((model, optimizer))``), each array
             written by the devices that hold its shards
    data     the data loader's position (JSON), so a resumed run reads the batches that came next
    config   the resolved run configuration (JSON), checked before anything is restored

Saving is asynchronous: ``save`` returns once the arrays are copied off the devices and the files are
written in the background while training goes on. Orbax writes each step into a temporary directory and
renames it when complete, so a run killed mid-save leaves no checkpoint that looks finished.

Restoring takes an abstract state whose leaves carry the *target* shardings: a checkpoint written under
one mesh loads into another (resharding happens in the read), e.g. saved under ``fsdp``, resumed under
``3d``.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxpar.rules import LayoutError

ITEMS = ("state", "data", "config")

# Model fields that decide the shapes and dtypes of the saved arrays: a checkpoint loads only into a
# model that agrees on all of them. Others (rope_theta, remat, compute dtype, ...) may change on resume.
STRUCTURAL_FIELDS = ("vocab_size", "vocab_multiple", "embed_dim", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "mlp_dim", "qkv_bias", "qk_norm", "tie_embeddings", "param_dtype")
# Run fields that decide which batches come next: changing them would not continue the same data stream.
DATA_FIELDS = ("batch", "seq", "seed", "data")
READ_SETTINGS = ("num_threads", "prefetch")      # data.* fields free to change on resume


class CheckpointError(LayoutError):
    """A checkpoint that cannot be used by this run; the message names the fields that disagree."""


@dataclasses.dataclass(frozen=True)
class SavedRun:
    step: int
    config: dict


def mismatches(saved: dict, current: dict, /) -> list[str]:
    """Fields where a saved run config and the current one disagree in a way resuming cannot bridge."""
    out = [f"model.{k}: saved {saved['model'].get(k)!r}, now {current['model'].get(k)!r}"
           for k in STRUCTURAL_FIELDS if saved["model"].get(k) != current["model"].get(k)]
    stream = [(k, _stream(saved.get(k)), _stream(current.get(k))) for k in DATA_FIELDS]
    out += [f"{k}: saved {a!r}, now {b!r}" for k, a, b in stream if a != b]
    return out


def _stream(value):
    """A run-config value without the data settings that only change how fast batches are read."""
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if k not in READ_SETTINGS}
    return value


def check_compatible(saved: SavedRun, current: dict, where: Path, /) -> None:
    if not isinstance(saved.config, dict) or not isinstance(saved.config.get("model"), dict):
        raise CheckpointError(f"{where} holds no jaxpar run config (a JSON object with a model section); "
                              "nothing was written. Use another --out.")
    bad = mismatches(saved.config, current)
    if bad:
        raise CheckpointError(
            f"{where} holds a checkpoint (step {saved.step}) of a run this one cannot resume:\n  " + "\n  ".join(bad)
            + "\nNothing was written. Use another --out, or the saved settings to resume.")


def _quiet_orbax():
    logging.getLogger("absl").setLevel(logging.ERROR)


def latest(directory: Path, /) -> SavedRun | None:
    """The newest complete checkpoint in ``directory`` and its config, without creating or changing
    anything; None when there is none."""
    if not directory.is_dir():
        return None
    _quiet_orbax()
    manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True),
                                    item_names=ITEMS)
    try:
        step = manager.latest_step()
        if step is None:
            return None
        try:
            config = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
        except (KeyError, ValueError, OSError) as err:     # a step folder without a readable config item
            raise CheckpointError(f"{directory / str(step)}: not a readable checkpoint of a run ({err})") from None
        return SavedRun(step, config)
    finally:
        manager.close()


class Checkpointer:
    """Saves every ``every`` steps (and when forced), keeps the newest ``keep``."""

    def __init__(self, directory: Path, /, *, every: int, keep: int, async_save: bool = True):
        _quiet_orbax()
        self.directory = directory
        options = ocp.CheckpointManagerOptions(save_interval_steps=every, max_to_keep=keep,
                                               enable_async_checkpointing=async_save)
        self._manager = ocp.CheckpointManager(directory, options=options, item_names=ITEMS)

    def save(self, step: int, /, *, state: Any, data: dict, config: dict, force: bool = False) -> bool:
        """Starts writing checkpoint ``step`` if it is due (or ``force``); True if it started."""
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data),
                                  config=ocp.args.JsonSave(config))
        return self._manager.save(step, args=args, force=force)

    def restore(self, step: int, abstract_state: Any, /) -> tuple[Any, dict]:
        """``(state, data position)`` of checkpoint ``step``; ``abstract_state``'s leaves are
        ``jax.ShapeDtypeStruct`` with the target shardings."""
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore())
        restored = self._manager.restore(step, args=args)
        return restored["state"], restored["data"]

    @property
    def steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def wait(self) -> None:
        """Returns when every write started so far is complete on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for writes in flight, then releases the manager."""
        self._manager.wait_until_finished()
        self._manager.close()


def abstract_like(shapes: Any, shardings: Any, /) -> Any:
    """``shapes`` (from ``jax.eval_shape``) with ``shardings`` attached: the target of a restore."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings)
