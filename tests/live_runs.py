"""Helpers for tests that start `jaxpar train` as real processes, watch them and interrupt them."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = [
    "log.progress=false",
    "log.tensorboard=false",
    "log.eval_every=0",
    "optimizer.schedule=constant",
    "optimizer.warmup_steps=0",
    "optimizer.learning_rate=1e-2",
]
QUIET = [arg for setting in SETTINGS for arg in ("--set", setting)]


def train_command(out: Path, *args: str, steps: int, every: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "jaxpar",
        "train",
        "--model",
        "tiny",
        "--batch",
        "8",
        "--seq",
        "16",
        "--steps",
        str(steps),
        "--out",
        str(out),
        "--set",
        f"checkpoint.every={every}",
        *QUIET,
        *args,
    ]


def start(command: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(command, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]  # a line being written is skipped


def last_step(out: Path) -> int:
    steps = [r["step"] for r in records(out)]
    return max(steps) if steps else 0


def losses(out: Path) -> dict[int, float]:
    """Step -> loss, the last record of each step winning (a resumed run logs some steps again)."""
    return {r["step"]: r["loss"] for r in records(out)}


def checkpoint_entries(out: Path) -> tuple[list[int], list[str]]:
    """(complete checkpoint steps, names of unfinished ones): orbax writes a step into a temporary
    directory and renames it to the bare step number when complete."""
    folder = out / "checkpoints"
    names = [p.name for p in folder.iterdir()] if folder.is_dir() else []
    return sorted(int(n) for n in names if n.isdigit()), [n for n in names if not n.isdigit()]


def wait_until(condition, proc: subprocess.Popen, log: Path, *, timeout: float = 600, poll: float = 0.05):
    """Polls ``condition()`` until true; fails if ``proc`` ends first or time runs out."""
    end = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(
                f"the run ended (rc {proc.returncode}) before the moment the test waits for; "
                f"its output:\n{log.read_text()[-3000:]}"
            )
        if time.monotonic() > end:
            proc.kill()
            raise AssertionError(f"timed out; output:\n{log.read_text()[-3000:]}")
        time.sleep(poll)


def kill_when(condition, proc: subprocess.Popen, log: Path) -> None:
    """SIGKILLs ``proc`` at a moment ``condition()`` holds, checked again while the process is stopped.

    Between a check and a plain kill a running process can move on (finish a save, begin the next one),
    so the process is frozen with SIGSTOP, the condition re-read, and only then killed; if it no longer
    holds, the process continues and the wait goes on."""
    while True:
        wait_until(condition, proc, log)
        proc.send_signal(signal.SIGSTOP)
        if condition():
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return
        proc.send_signal(signal.SIGCONT)


def finish(proc: subprocess.Popen, log: Path, *, timeout: float = 600) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"the run did not end; output:\n{log.read_text()[-3000:]}") from None
