"""A run that is killed, killed again in the middle of a checkpoint write, preempted, and finally let
finish, logs exactly the per-step losses of a run that was never interrupted.

One run directory, four processes of `jaxpar train` (2 simulated CPU devices each, 40 steps):
  A  SIGKILL between two saves (a checkpoint complete, none being written, a later step logged);
  B  resumed, saving every step; SIGKILL while a checkpoint's temporary directory is on disk;
     that checkpoint is never listed nor loaded.
  Both moments are checked again with the process stopped (SIGSTOP) before the kill lands;
  C  resumed; SIGTERM: it finishes the step, saves it, exits 0;
  D  resumed from C's checkpoint, to the end.
Each resume must start from the newest *complete* checkpoint, and the last logged loss of every step
must equal the reference run's bit for bit.
"""

import re
import signal

from live_runs import (
    checkpoint_entries,
    finish,
    kill_when,
    last_step,
    losses,
    records,
    start,
    train_command,
    wait_until,
)

STEPS, EVERY = 40, 10
DEVICES = ["--cpu-devices", "2", "--mesh", "data=2"]


def test_killed_and_preempted_run_logs_the_uninterrupted_losses(tmp_path):
    ref, out, log = tmp_path / "ref", tmp_path / "run", tmp_path / "run.log"
    reference = start(train_command(ref, *DEVICES, steps=STEPS, every=EVERY), tmp_path / "ref.log")

    # A: killed between saves: a checkpoint complete, none being written, a later step logged
    a = start(train_command(out, *DEVICES, steps=STEPS, every=EVERY), log)
    kill_when(lambda: (saved := checkpoint_entries(out))[0] and not saved[1] and last_step(out) > max(saved[0]), a, log)
    done_a, unfinished = checkpoint_entries(out)
    assert done_a and not unfinished and last_step(out) < STEPS

    # B: killed during a save (every step saves, so one is nearly always being written)
    b = start(train_command(out, *DEVICES, steps=STEPS, every=1), log)
    kill_when(lambda: last_step(out) > max(done_a) + 1 and checkpoint_entries(out)[1], b, log)
    done_b, unfinished = checkpoint_entries(out)
    assert unfinished, "the kill was meant to land during a checkpoint write"
    assert max(done_b) < STEPS

    # C: preempted
    logged = len(records(out))
    c = start(train_command(out, *DEVICES, steps=STEPS, every=EVERY), log)
    wait_until(lambda: len(records(out)) >= logged + 3, c, log)  # C's own steps, not B's records
    c.send_signal(signal.SIGTERM)
    assert finish(c, log) == 0
    stopped = int(re.findall(r"preempted: stopped after step (\d+); checkpoint \1 is saved", log.read_text())[-1])
    assert max(checkpoint_entries(out)[0]) == stopped == records(out)[-1]["step"] < STEPS

    # D: to the end
    assert finish(start(train_command(out, *DEVICES, steps=STEPS, every=EVERY), log), log) == 0
    assert finish(reference, tmp_path / "ref.log") == 0
    text = log.read_text()
    for resumed_at in (max(done_a), max(done_b), stopped):  # B, C, D began at the newest complete one
        assert f"resumed from {out / 'checkpoints'} at step {resumed_at}\n" in text
    want, got = losses(ref), losses(out)
    assert sorted(want) == list(range(1, STEPS + 1))
    assert got == want  # every step, bit for bit
