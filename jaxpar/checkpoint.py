"""Checkpoints of a training run, on orbax's ``CheckpointManager``.

One checkpoint = one step directory with three items:
    state    the model parameters and optimizer state (``nnx.state((model, optimizer))``), each array
             written by the devices that hold its shards
    data     the data loader's position (JSON), so a resumed run reads the batches that came next
    config   the resolved run configuration (JSON), checked before anything is restored
             (``jaxpar.identity``: is this the same run?)

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

from jaxpar.errors import CheckpointError  # noqa: F401  (re-exported)

ITEMS = ("state", "data", "config")


@dataclasses.dataclass(frozen=True)
class SavedRun:
    step: int
    config: dict


def _quiet_orbax():
    logging.getLogger("absl").setLevel(logging.ERROR)


def latest(directory: Path, /) -> SavedRun | None:
    """The newest complete checkpoint in ``directory`` and its config, without creating or changing
    anything; None when there is none."""
    if not directory.is_dir():
        return None
    _quiet_orbax()
    manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True), item_names=ITEMS)
    try:
        step = manager.latest_step()
        if step is None:
            return None
        try:
            config = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
        except (KeyError, ValueError, OSError) as err:  # a step folder without a readable config item
            raise CheckpointError(f"{directory / str(step)}: not a readable checkpoint of a run ({err})") from None
        return SavedRun(step, config)
    finally:
        manager.close()


class Checkpointer:
    """Saves every ``every`` steps (and when forced), keeps the newest ``keep``."""

    def __init__(self, directory: Path, /, *, every: int, keep: int, async_save: bool = True):
        _quiet_orbax()
        self.directory = directory
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=every, max_to_keep=keep, enable_async_checkpointing=async_save
        )
        self._manager = ocp.CheckpointManager(directory, options=options, item_names=ITEMS)

    def save(self, step: int, /, *, state: Any, data: dict, config: dict, force: bool = False) -> bool:
        """Starts writing checkpoint ``step`` if it is due (or ``force``); True if it started."""
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data), config=ocp.args.JsonSave(config)
        )
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
