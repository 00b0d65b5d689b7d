"""What stops a run early, and how it stops cleanly: preemption notices and non-finite steps.

Preemption (``Preemption``): schedulers announce an eviction with SIGTERM and kill with SIGKILL a grace
period later. The run finishes the step in flight, saves a checkpoint of it, waits for the write and
exits 0, so the next start resumes there.
  * one process: a Python SIGTERM handler sets a flag, read after every step;
  * several processes (``jax.distributed``): a notice may reach one process, or reach them at different
    steps, and a checkpoint needs all of them at the same step. jax's preemption service (started by
    ``jax.distributed.initialize``) catches SIGTERM in any process and agrees on a step; every process
    asks ``multihost_utils.reached_preemption_sync_point(step)`` after each step and stops together.

Non-finite steps (``NonFiniteGuard``): a NaN or inf loss or gradient norm is garbage that spreads into
every parameter. Policy ``stop`` ends the run with an error that names the step and the last good
checkpoint; the check runs before any checkpoint is written, so a non-finite state is never saved.
Policy ``skip`` leaves the state unchanged inside the step (``make_train_step(skip_nonfinite=True)``),
logs the step as skipped, and stops after ``max_skips`` skipped steps in a row.
"""

from __future__ import annotations

import math
import signal
import threading

import jax

from jaxpar.config import Choice
from jaxpar.errors import NonFiniteError  # noqa: F401  (re-exported)


class NonFinite(Choice):
    """What a run does with a step whose loss or gradient norm is NaN or inf (``nonfinite``)."""

    STOP = "stop"  # end the run, naming the step and the last good checkpoint
    SKIP = "skip"  # leave the state unchanged for that step and go on (at most max_skips in a row)


class Preemption:
    """``requested(step)``: has a preemption notice arrived, so that the run should stop after ``step``?"""

    def __init__(self):
        self.multiprocess = jax.process_count() > 1
        self._notice = False
        self._previous = None
        if not self.multiprocess and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        self._notice = True

    def requested(self, step: int, /) -> bool:
        if self.multiprocess:  # every process calls this at every step (the protocol)
            from jax.experimental import multihost_utils  # deferred: only with several processes

            return multihost_utils.reached_preemption_sync_point(step)
        return self._notice

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


class NonFiniteGuard:
    """Checks each step's fetched loss and gradient norm under the run's ``nonfinite`` policy."""

    def __init__(self, policy: NonFinite, max_skips: int, checkpoints):
        self.policy, self.max_skips, self.checkpoints = policy, max_skips, checkpoints
        self.in_a_row = 0

    def check(self, step: int, loss: float, grad_norm: float) -> bool:
        """True when the step is fine; False when it was skipped; raises ``NonFiniteError`` to stop."""
        if math.isfinite(loss) and math.isfinite(grad_norm):  # the step's own test, on the host
            self.in_a_row = 0
            return True
        what = f"step {step}: loss {loss}, gradient norm {grad_norm}"
        if self.policy == "skip":
            self.in_a_row += 1
            if self.in_a_row <= self.max_skips:
                return False
            raise NonFiniteError(
                f"{what}: {self.in_a_row} non-finite steps in a row, more than "
                f"max_skips={self.max_skips}; stopping. {self._last_good()}"
            )
        raise NonFiniteError(
            f"{what}: not finite; stopping (nonfinite=stop). {self._last_good()} "
            "To skip such steps instead: --set nonfinite=skip"
        )

    def _last_good(self) -> str:
        self.checkpoints.wait()
        steps = self.checkpoints.steps
        where = self.checkpoints.directory
        return (
            f"The last good checkpoint is step {max(steps)} in {where}."
            if steps
            else f"No checkpoint was written to {where}."
        )
