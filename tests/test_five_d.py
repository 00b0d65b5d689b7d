"""All the axes at once on 32 simulated CPU devices: tiny-moe with ring attention over ``sequence`` and
all-to-all dispatch over ``expert`` trains 3 steps with the losses, routing and every parameter's
gradients of one device, under

* the 5D layout data=2 × fsdp=2 × tensor=2 × expert=2 × sequence=2 (no pipeline), and
* the 6D layout stage=2 × fsdp=2 × tensor=2 × expert=2 × sequence=2: a 1F1B pipeline over m=2
  microbatches, against one device accumulating the gradient over the same 2 microbatches
  (``grad_accum=2``; capacity and balancing statistics are per microbatch in both).

The suite's process has 8 devices, so each layout runs in a child process started with 32. It prints
the losses and loads and saves each step's gradients (``invariance.train_steps``) to an npz file, which
the test compares parameter by parameter within the measured noise bound (tests/noise.py): the child
also runs the reference with its rows in another order (the noise), and the layout with one row in
place of another (a mutation: a batch shard's gradient term lost, another's counted twice), which must
miss the bound by a wide margin.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from noise import Bound, check_mutation_caught, check_run, measure

LAYOUTS = {  # name: (mesh, pipeline schedule and microbatches, or None)
    "5d": ("data=2,fsdp=2,tensor=2,expert=2,sequence=2", None),
    "6d": ("stage=2,fsdp=2,tensor=2,expert=2,sequence=2", ("1f1b", 2)),
}

SCRIPT = textwrap.dedent("""
    import json, sys
    from jaxpar.mesh import simulate_cpu_devices
    simulate_cpu_devices(32)
    sys.path.insert(0, sys.argv[3])                  # tests/, for the invariance helpers
    import numpy as np
    from invariance import one_device, replace_rows, train_steps
    from noise import permuted_rows
    from jaxpar.meshes import resolve_mesh_arg
    from jaxpar.models import get_execution_preset, get_model_preset
    from jaxpar.pipeline import build

    B, T, STEPS = 8, 32, 3
    schedule, m = (sys.argv[4], int(sys.argv[5])) if len(sys.argv) > 4 else (None, 1)
    batch = np.random.default_rng(0).integers(0, 256, (B, T + 1), dtype=np.int32)
    tokens = np.broadcast_to(batch, (STEPS, B, T + 1))                     # one batch, 3 times
    cfg = get_model_preset("tiny-moe")
    run = get_execution_preset("tiny-moe", context_parallel="ring", remat="none")
    table = None if schedule is None else build(schedule, 2, m)
    layout = resolve_mesh_arg(sys.argv[1])
    runs = dict(one=one_device(cfg, tokens, grad_accum=m, execution=run),
                other=one_device(cfg, tokens[:, permuted_rows(B, m)], grad_accum=m, execution=run),
                many=train_steps(cfg, layout, tokens, pipeline=table, execution=run),
                mutant=train_steps(cfg, layout, replace_rows(tokens, [0], [1]), pipeline=table, execution=run))
    np.savez(sys.argv[2], **{f"{name}/{step}/{path}": g for name, run in runs.items()
                             for step, grads in enumerate(run.grads) for path, g in grads.items()})
    print(json.dumps({name: dict(mesh=run.mesh, losses=run.losses, loads=[m.expert_load.tolist() for m in run.moe])
                      for name, run in runs.items()}))
""")


def _load_grads(path: Path) -> dict[str, list[dict[str, np.ndarray]]]:
    """{run: [step -> {parameter path: gradient}]} from the child's ``run/step/path`` npz keys."""
    grads: dict = {}
    with np.load(path) as f:
        for key in f.files:
            name, step, param = key.split("/", 2)
            grads.setdefault(name, {}).setdefault(int(step), {})[param] = f[key]
    return {name: [steps[i] for i in sorted(steps)] for name, steps in grads.items()}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_all_axes_match_one_device(layout, tmp_path):
    mesh, pipeline = LAYOUTS[layout]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    grads_file = tmp_path / "grads.npz"
    extra = [] if pipeline is None else [pipeline[0], str(pipeline[1])]
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, mesh, str(grads_file), str(Path(__file__).parent), *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["many"]["mesh"] == {a: int(n) for a, n in (part.split("=") for part in mesh.split(","))}
    np.testing.assert_array_equal(out["many"]["loads"], out["one"]["loads"])  # routing is exact
    assert np.all(np.diff(out["one"]["losses"]) < -1e-2)  # it trains (same batch each step)
    grads = _load_grads(grads_file)
    assert len(grads["one"]) == 3 and any("gate_up" in p for p in grads["one"][0])  # the experts' too
    runs = {name: SimpleNamespace(grads=grads[name], losses=out[name]["losses"]) for name in out}
    bound = Bound("5d", measure(runs["one"], runs["other"]))
    check_run(runs["many"], runs["one"], bound, mesh)
    check_mutation_caught(runs["mutant"], runs["one"], bound, f"{mesh}: row 0 as row 1")
    print(layout, "losses", out["many"]["losses"], "one device", out["one"]["losses"])
