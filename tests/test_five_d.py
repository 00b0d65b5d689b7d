"""The full 5D layout: data=2 × fsdp=2 × tensor=2 × expert=2 × sequence=2 on 32 simulated CPU devices,
tiny-moe with ring attention over ``sequence`` and all-to-all dispatch over ``expert``, trains 3 steps
with the losses and routing of one device.

The suite's process has 8 devices, so this runs in a child process started with 32.
"""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np

MESH = "data=2,fsdp=2,tensor=2,expert=2,sequence=2"

SCRIPT = textwrap.dedent("""
    import dataclasses, functools, json, sys
    from jaxpar.mesh import MeshConfig, simulate_cpu_devices
    simulate_cpu_devices(32)
    import jax, numpy as np
    from jaxpar.layout import make_layout
    from jaxpar.meshes import get_mesh_preset, resolve_mesh_arg
    from jaxpar.models import build_model, get_model_preset
    from jaxpar.train.optim import OptimizerConfig, make_optimizer
    from jaxpar.train.step import init_train_state, make_train_step

    B, T, STEPS = 8, 32, 3
    tokens = np.random.default_rng(0).integers(0, 256, (B, T + 1), dtype=np.int32)   # one batch, 3 times
    cfg = get_model_preset("tiny-moe", context_parallel="ring", remat="none")

    def run(preset, devices=None):
        layout = make_layout(cfg, preset, batch=B, seq=T, devices=devices)
        tx = functools.partial(make_optimizer, OptimizerConfig(learning_rate=1e-2, eps=1e-3, schedule="constant", warmup_steps=0))
        ts = init_train_state(lambda r: build_model(cfg, rngs=r), tx, layout)
        step, state, losses, loads = make_train_step(ts, layout), ts.state, [], []
        for i in range(STEPS):
            state, m = step(state, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
            losses.append(float(m.loss))
            loads.append(np.asarray(m.moe.expert_load).tolist())
        return dict(mesh={a: n for a, n in layout.mesh.shape.items() if n > 1}, losses=losses, loads=loads)

    one = dataclasses.replace(get_mesh_preset("dp"), mesh=MeshConfig())
    print(json.dumps(dict(one=run(one, jax.devices()[:1]), five=run(resolve_mesh_arg(sys.argv[1])))))
""")


def test_five_axis_layout_matches_one_device():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, MESH], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["five"]["mesh"] == dict(data=2, fsdp=2, tensor=2, expert=2, sequence=2)
    np.testing.assert_allclose(out["five"]["losses"], out["one"]["losses"], rtol=1e-5)
    np.testing.assert_array_equal(out["five"]["loads"], out["one"]["loads"])
    assert np.all(np.diff(out["one"]["losses"]) < -1e-2)                    # it trains (same batch each step)
