"""Two processes × 4 simulated CPU devices on localhost (jax.distributed, gloo between the processes)
train the tiny model like one process × 8 devices; a SIGTERM to one process stops both after the same
step with a checkpoint; that checkpoint, written by two processes, resumes in one.

Losses match to rtol 1e-6, not bit for bit: gloo's all-reduce across processes adds in another order
than XLA:CPU's in-process one (measured: differences of 1 in the 7th digit).
"""

import dataclasses
import signal
import socket

import numpy as np
from live_runs import SETTINGS, checkpoint_entries, finish, losses, records, start, train_command, wait_until

from jaxpar.train.config import apply_overrides, default_config
from jaxpar.train.loop import train

MESH = "fsdp=2,data=-1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _in_process_cfg(steps):
    """The config the CLI builds from ``train_command`` (same fields), for runs inside this process."""
    return apply_overrides(
        default_config("tiny", steps=steps, batch=8, seq=16, mesh=MESH), [*SETTINGS, "checkpoint.every=1000"]
    )


def test_two_processes_train_like_one_and_resume_in_one(tmp_path):
    out, port = tmp_path / "run", _free_port()
    logs = [tmp_path / f"process{i}.log" for i in (0, 1)]
    procs = [
        start(
            train_command(
                out,
                "--mesh",
                MESH,
                "--cpu-devices",
                "4",
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
                steps=10_000,
                every=1000,
            ),
            logs[i],
        )
        for i in (0, 1)
    ]
    wait_until(lambda: len(records(out)) >= 3, procs[0], logs[0])
    procs[1].send_signal(signal.SIGTERM)  # the notice reaches one process only
    assert [finish(p, log) for p, log in zip(procs, logs)] == [0, 0]
    stopped = records(out)[-1]["step"]
    assert checkpoint_entries(out) == ([stopped], [])  # both stopped after the same step and saved it
    assert f"preempted: stopped after step {stopped}" in logs[0].read_text()
    quiet = logs[1].read_text()  # only process 0 reports
    assert "compiled the train step" not in quiet and "run directory" not in quiet and "preempted" not in quiet

    reference = train(_in_process_cfg(stopped + 2), tmp_path / "ref").losses
    two_processes = losses(out)
    np.testing.assert_allclose(
        [two_processes[s] for s in range(1, stopped + 1)], [reference[s] for s in range(1, stopped + 1)], rtol=1e-5
    )  # gloo sums across processes in another order (docs/training.md)

    resumed = train(_in_process_cfg(stopped + 2), out)  # one process, 8 devices, from their checkpoint
    assert resumed.start_step == stopped
    np.testing.assert_allclose(
        [resumed.losses[s] for s in (stopped + 1, stopped + 2)],
        [reference[s] for s in (stopped + 1, stopped + 2)],
        rtol=1e-5,
    )


def test_layouts_that_split_positions_or_reorder_rows_across_processes_are_refused():
    """Process p loads rows [p·b, (p+1)·b) of every batch; played here by devices [4p, 4p + 4) of one process."""
    import jax
    import pytest

    from jaxpar.train.config import ConfigError
    from jaxpar.train.loop import check_process_rows, plan_layout

    def check(mesh, p):
        cfg = dataclasses.replace(_in_process_cfg(4), mesh=mesh)
        check_process_rows(cfg, plan_layout(cfg), p, 2, jax.devices()[4 * p : 4 * p + 4])

    for p in (0, 1):
        check("fsdp=2,data=-1", p)  # data spans the processes, in order
        check("data=2,tensor=4", p)  # tensor inside each process
    with pytest.raises(
        ConfigError,
        match=r"process 0 loads rows 0\.\.3 \(all 16 positions\) of each batch, but its "
        r"devices hold rows 0\.\.7 \(8 rows\) and 8 positions",
    ):
        check("sequence=2,tensor=4", 0)
    with pytest.raises(
        ConfigError, match=r"process 1 loads rows 4\.\.7 .* hold rows 0\.\.7 \(8 rows\) and 8 positions"
    ):
        check("cp", 1)
