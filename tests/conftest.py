"""Every test runs on 8 simulated CPU devices in one process (set before JAX initialises).

The suite's cost is XLA compiles of tiny programs, not running them. So, for this process, the xdist
workers and every ``jaxpar`` process a test starts (they inherit the environment):

* ``--xla_backend_optimization_level=0``: LLVM's optimisations off in XLA:CPU's code generation. XLA's
  own HLO passes still run, and IEEE semantics hold at every level (no fast-math), so results do not
  change: tiny-deepseek's train step gave the same loss bit for bit, its init compiled in 3.5 s instead
  of 9.4 s and its train step in 6.0 s instead of 11.3 s, and ran as fast (the steps are tiny).
* one persistent compilation cache for the whole run (a fresh temporary folder, removed at the end):
  a program compiled by one worker or process, e.g. the same tiny run started four times by
  tests/test_kill.py, is read back by the others instead of compiled again.

``JAXPAR_TESTS_PLAIN_XLA=1`` turns both off (to rule them out, or to measure what they save).
``JAXPAR_FIXTURE_LOG=FILE``: append one JSON line per module- or session-scoped fixture set up (worker,
fixture, module, seconds), to count fixtures that pytest-xdist builds on more than one worker.
"""

import json
import os
import shutil
import tempfile
import time

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_FAST = os.environ.get("JAXPAR_TESTS_PLAIN_XLA", "0") in ("", "0")
if _FAST and "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
_OWN_CACHE = _FAST and "JAX_COMPILATION_CACHE_DIR" not in os.environ  # the first process (xdist's controller)
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxpar-tests-xla-cache-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

from jaxpar.mesh import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)


def pytest_unconfigure(config):
    if _OWN_CACHE and not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    log = os.environ.get("JAXPAR_FIXTURE_LOG")
    if not log or fixturedef.scope not in ("module", "session"):
        yield
        return
    start = time.perf_counter()
    yield
    record = dict(
        worker=os.environ.get("PYTEST_XDIST_WORKER", "main"),
        fixture=fixturedef.argname,
        module=request.node.nodeid.split("::")[0],
        param=str(getattr(request, "param", "")),
        seconds=round(time.perf_counter() - start, 2),
    )
    with open(log, "a") as f:
        f.write(json.dumps(record) + "\n")
