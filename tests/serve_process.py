"""``jaxpar serve`` as a process of its own, for the tests that speak to it as a user would."""

import re
import subprocess
import sys
import time
from pathlib import Path


def launch(args: list[str], log: Path, *, env=None, wait: float = 300) -> tuple[subprocess.Popen, str]:
    """Starts ``python -m jaxpar serve ARGS`` with its output in ``log``; returns (the process, its URL)
    once it prints ``listening on URL``."""
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "jaxpar", "serve", *args], stderr=out, stdout=out, env=env)
    deadline = time.time() + wait
    while not (found := re.search(r"listening on (http://\S+)", log.read_text())):
        assert proc.poll() is None and time.time() < deadline, log.read_text()
        time.sleep(0.2)
    return proc, found.group(1)
