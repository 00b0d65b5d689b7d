# %% [markdown]
# # 00 · Start: devices, a mesh, logical axes and what each device holds
#
# jaxpar models never name a device or a mesh axis. Every parameter and activation dimension carries a
# *logical* name (`embed`, `heads`, `mlp`, `batch`, `length`, …); a *rules table* maps each logical
# name onto zero or more axes of a `jax.sharding.Mesh` (`data`, `fsdp`, `tensor`, `expert`, `sequence`,
# `stage`). Change the table and the same model is laid out differently, with nothing in the model
# touched. This notebook runs on a CPU runtime: it simulates 8 devices, builds a mesh, prints a rules
# table, and reads off what each device holds for a real-size model (Llama-3-8B, built abstractly: no
# memory is allocated). It ends by checking that one training step gives the same loss on 8 devices as
# on one.

# %%
from jaxpar.mesh import simulate_cpu_devices

simulate_cpu_devices(8)  # before any other JAX operation: the CPU shows up as 8 devices
import jax

print(jax.devices())

# %% [markdown]
# ## A mesh
#
# A mesh is the devices arranged in an n-dimensional array with a name per dimension. Here
# data=2 × fsdp=2 × tensor=2. Devices that differ only in their `tensor` coordinate form one tensor
# group; collectives over `tensor` run inside each such group.

# %%
from jaxpar.mesh import MeshConfig, build_mesh

mesh = build_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
print(dict(mesh.shape))
print(mesh.devices.reshape(-1, 2))  # one row per tensor group

# %% [markdown]
# ## Logical axes → rules → mesh axes
#
# A preset is a mesh shape plus one complete rules table. `3d` splits the batch over data and fsdp,
# shards weights over fsdp (ZeRO-3 style) and the heads and MLP columns over tensor. The report below
# checks the table against Llama-3-8B's shapes; every logical axis is listed, sharded or not.

# %%
from jaxpar.meshes import PRESETS
from jaxpar.rules_report import format_rules, rules_report

print(format_rules(rules_report(PRESETS["3d"], 8, model="llama3-8b")))

# %% [markdown]
# ## What each device holds
#
# `param_shardings` builds the model with `nnx.eval_shape` (shapes only) under a layout and reports,
# for every parameter, its logical names, the PartitionSpec the rules give it, and the shard each
# device keeps. A few of Llama-3-8B's parameters under `3d`:

# %%
from jaxpar.models import get_model_preset
from jaxpar.shardings import default_layout, param_shardings

big = get_model_preset("llama3-8b")
report = param_shardings(big, default_layout(big, PRESETS["3d"]))
for p in report.params:
    if p.path.split("/")[-1] in ("embedding", "q", "kv", "k", "up", "down", "gate"):
        print(f"{p.path:28s} {str(p.names):34s} {str(p.shape):22s} -> {str(p.shard_shape):22s}")
print(f"{report.num_params / 1e9:.2f} B parameters, {report.total_bytes / 2**30:.1f} GiB in float32")

# %% [markdown]
# The same model under each 8-device preset. With AdamW each parameter costs 4 bytes plus two fp32
# moments (12 bytes in all, gradients not counted): plain data parallelism keeps all 8·4·3 ≈ 90 GiB on
# every device; fully sharded layouts divide it by 8.

# %%
import matplotlib.pyplot as plt

per_device = {}
for name in ("dp", "fsdp", "tp", "fsdp_tp", "3d", "hsdp"):
    r = param_shardings(big, default_layout(big, PRESETS[name]))
    per_device[name] = r.per_device_adamw_bytes / 2**30
    print(f"{name:8s} {dict(r.mesh)}  {per_device[name]:6.1f} GiB per device (params + AdamW)")

plt.figure(figsize=(6, 3))
plt.bar(per_device.keys(), per_device.values())
plt.axhline(80, color="r", ls="--", label="80 GB HBM (H100)")
plt.ylabel("GiB per device")
plt.title("Llama-3-8B on 8 devices: parameters + AdamW moments")
plt.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Same step, two layouts
#
# One training step of the tiny model on one device and on 8 devices under `3d`: the losses agree to
# float32 rounding (the 8-device sum runs in a different order).

# %%
import dataclasses
import functools

import numpy as np

from jaxpar.layout import make_layout
from jaxpar.models import build_model
from jaxpar.train.optim import OptimizerConfig, make_optimizer
from jaxpar.train.step import init_train_state, make_train_step

cfg = get_model_preset("tiny")
tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 17), dtype=np.int32)
batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def first_loss(preset, devices=None):
    layout = make_layout(cfg, preset, batch=8, seq=16, devices=devices)
    ts = init_train_state(
        lambda r: build_model(cfg, rngs=r), functools.partial(make_optimizer, OptimizerConfig()), layout
    )
    _, metrics = make_train_step(ts, layout)(ts.state, batch)
    return float(metrics.loss)


one = first_loss(dataclasses.replace(PRESETS["dp"], mesh=MeshConfig()), devices=jax.devices()[:1])
eight = first_loss(PRESETS["3d"])
print(f"1 device: {one:.6f}   8 devices (3d): {eight:.6f}   relative difference {abs(one - eight) / one:.1e}")

# %%
key_numbers = {
    "devices": jax.device_count(),
    "llama3_8b_params": report.num_params,
    "per_device_gib": per_device,
    "loss_one_device": one,
    "loss_8_devices": eight,
}
key_numbers
