"""MeshConfig -> jax.sharding.Mesh.

Physical axis order, outermost (slowest links) to innermost (fastest links):

    stage, data, fsdp, expert, sequence, tensor

Each axis sits where its traffic can afford the link it gets. jax lays out the devices of a mesh so that
neighbours on the *last* axis are the physically closest (same NVLink island / ICI neighbours), and the
first axis strides over the slowest links (DCN / InfiniBand between nodes or slices).

* ``stage``    sends one activation per microbatch at a stage boundary: the least traffic, may cross DCN.
* ``data``     all-reduces gradients once per step, overlappable with the backward pass: fine on DCN.
* ``fsdp``     all-gathers weights and reduce-scatters gradients once per layer: wants fast links, but
               prefetching hides much of it.
* ``expert``   two all-to-alls per MoE layer on the critical path of the forward pass.
* ``sequence`` a ring of K/V blocks per attention layer, overlapped with the attention compute.
* ``tensor``   two all-reduces (or all-gather + reduce-scatter) per layer *inside* the matmul chain, with
               nothing to overlap them with: the most latency-sensitive, so innermost.

``stage`` splits the stacked layers into pipeline stages (``jaxpar.pipeline``: the train step runs a
schedule table over it).

The mesh uses ``AxisType.Auto`` axes (classic GSPMD propagation): the model annotates activations with
``with_sharding_constraint`` through logical names and never has to spell an output sharding per einsum,
which Explicit axes would force on model code. Flax's eager sharding needs all axes of one type.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from jaxpar.errors import MeshError, suggest

AXES: tuple[str, ...] = ("stage", "data", "fsdp", "expert", "sequence", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the six mesh axes. At most one may be -1: it is filled from the device count.

    ``dcn`` holds the across-slice (DCN) factor of each axis for multi-slice / multi-node runs; the mesh
    axis then has size ``ici * dcn``, with the DCN part outermost inside that axis (jax's hybrid mesh).
    """

    stage: int = 1
    data: int = 1
    fsdp: int = 1
    expert: int = 1
    sequence: int = 1
    tensor: int = 1
    dcn: tuple[tuple[str, int], ...] = ()

    def __post_init__(self):
        for axis in AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
                raise MeshError(f"mesh axis {axis}={size!r}: sizes must be positive integers (or -1 once)")
        wild = [a for a in AXES if getattr(self, a) == -1]
        if len(wild) > 1:
            raise MeshError(f"mesh axes {', '.join(f'{a}=-1' for a in wild)}: only one axis may be -1")
        for axis, size in self.dcn:
            if axis not in AXES:
                raise MeshError(f"dcn.{axis}: unknown mesh axis {axis!r}; axes are {', '.join(AXES)}")
            if not isinstance(size, int) or size < 1:
                raise MeshError(f"mesh axis dcn.{axis}={size!r}: DCN sizes must be positive integers")

    # ----------------------------------------------------------------------------------------- forms
    @classmethod
    def parse(cls, spec: str) -> MeshConfig:
        """``"data=2,fsdp=-1,tensor=2"``; prefix a key with ``dcn.`` for its across-slice factor."""
        ici, dcn = {}, {}
        for item in filter(None, (s.strip() for s in spec.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip()
            target, name = (dcn, key[4:]) if key.startswith("dcn.") else (ici, key)
            if not sep:
                raise MeshError(f"mesh spec {spec!r}: item {item!r} is not of the form axis=size")
            if name not in AXES:
                raise MeshError(
                    f"mesh spec {spec!r}: unknown mesh axis {name!r}; axes are {', '.join(AXES)}{suggest(name, AXES)}"
                )
            try:
                target[name] = int(value)
            except ValueError:
                raise MeshError(f"mesh spec {spec!r}: axis {key} has size {value!r}, not an integer") from None
        return cls(**ici, dcn=tuple(sorted(dcn.items(), key=lambda kv: AXES.index(kv[0]))))

    def __str__(self) -> str:
        parts = [f"{a}={getattr(self, a)}" for a in AXES if getattr(self, a) != 1]
        parts += [f"dcn.{a}={n}" for a, n in self.dcn]
        return ",".join(parts) or "data=1"

    def dcn_sizes(self) -> dict[str, int]:
        return {a: dict(self.dcn).get(a, 1) for a in AXES}

    def resolve(self, num_devices: int) -> MeshConfig:
        """Fill the -1 axis from ``num_devices`` and check the product matches."""
        dcn = math.prod(self.dcn_sizes().values())
        if num_devices % dcn:
            raise MeshError(
                f"mesh {self}: the DCN factors multiply to {dcn}, which does not divide the {num_devices} devices"
            )
        per_slice = num_devices // dcn
        sizes = {a: getattr(self, a) for a in AXES}
        known = math.prod(s for s in sizes.values() if s != -1)
        wild = [a for a, s in sizes.items() if s == -1]
        if wild:
            if per_slice % known:
                raise MeshError(
                    f"mesh {self}: cannot fill {wild[0]}=-1: the other axes multiply to {known}, "
                    f"which does not divide {per_slice} devices per slice"
                )
            sizes[wild[0]] = per_slice // known
        elif known != per_slice:
            raise MeshError(
                f"mesh {self}: axis sizes multiply to {known}"
                f"{f' per slice (x{dcn} DCN)' if dcn > 1 else ''} but there are {num_devices} devices"
            )
        return dataclasses.replace(self, **sizes)

    def shape(self) -> dict[str, int]:
        """Total size per axis (ICI x DCN); call on a resolved config."""
        dcn = self.dcn_sizes()
        return {a: getattr(self, a) * dcn[a] for a in AXES}


def build_mesh(config: MeshConfig | str, /, *, devices=None):
    """A ``jax.sharding.Mesh`` with the six axes in physical order and Auto axis types."""
    # deferred: jax, so that a MeshConfig parses and checks without it (the commands' parsers)
    import jax
    from jax.experimental import mesh_utils

    if isinstance(config, str):
        config = MeshConfig.parse(config)
    devices = list(jax.devices() if devices is None else devices)
    config = config.resolve(len(devices))
    ici = tuple(getattr(config, a) for a in AXES)
    dcn = tuple(config.dcn_sizes()[a] for a in AXES)
    types = (jax.sharding.AxisType.Auto,) * len(AXES)
    if math.prod(dcn) == 1:
        if devices == list(jax.devices()):
            return jax.make_mesh(ici, AXES, axis_types=types)
        return jax.sharding.Mesh(np.array(devices).reshape(ici), AXES, axis_types=types)
    if hasattr(devices[0], "slice_index") or jax.process_count() > 1:
        arr = mesh_utils.create_hybrid_device_mesh(
            ici, dcn, devices, process_is_granule=not hasattr(devices[0], "slice_index")
        )
    else:
        arr = _simulated_hybrid(devices, ici, dcn)
    return jax.sharding.Mesh(arr, AXES, axis_types=types)


def _simulated_hybrid(devices, ici, dcn) -> np.ndarray:
    """Single-process stand-in for jax's hybrid mesh: consecutive device blocks play the slices."""
    n = len(ici)
    arr = np.array(devices, dtype=object).reshape(tuple(dcn) + tuple(ici))
    order = [i for pair in zip(range(n), range(n, 2 * n)) for i in pair]  # (dcn_0, ici_0, dcn_1, ici_1, ...)
    return arr.transpose(order).reshape([d * i for d, i in zip(dcn, ici)])


# Simulated devices are threads that share the host's cores, and XLA:CPU runs them on two thread pools
# sized max(cores, devices). A collective blocks the pool thread that runs it until every peer arrives,
# and independent collectives (an FSDP all-gather beside the ring's collective-permute inside a loop) can
# start in a different order on different devices. With one thread per device the pool can fill with
# waiters whose peers have no thread left to arrive on: a deadlock, 3 runs of 3 within 350 steps of
# the fsdp x ring layout. Four threads per device removed it (1,200 steps; the step time did not change).
# Blocked threads cost no CPU. XLA reads PJRT_NPROC when the backend starts.
THREADS_PER_SIMULATED_DEVICE = 4
# A real deadlock still ends the process, after these timeouts, rather than hanging a CI job for hours.
PATIENT_COLLECTIVES = (
    "--xla_cpu_collective_call_warn_stuck_timeout_seconds=60",
    "--xla_cpu_collective_call_terminate_timeout_seconds=300",
    "--xla_cpu_collective_timeout_seconds=300",
)


def cpu_runtime_env(n: int, /) -> None:
    """Thread pools and collective timeouts for ``n`` simulated devices; before the backend starts.

    Raises ``PJRT_NPROC`` to at least ``THREADS_PER_SIMULATED_DEVICE * n`` (never below the cores or a
    larger value already set) and adds the ``PATIENT_COLLECTIVES`` flags not already in ``XLA_FLAGS``."""
    have = os.environ.get("PJRT_NPROC", "")
    floor = max(THREADS_PER_SIMULATED_DEVICE * n, os.cpu_count() or 1)
    os.environ["PJRT_NPROC"] = str(max(int(have) if have.isdigit() else 0, floor))
    flags = os.environ.get("XLA_FLAGS", "")
    extra = [f for f in PATIENT_COLLECTIVES if f.split("=")[0] not in flags]
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([flags, *extra]).strip()


def simulate_cpu_devices(n: int, /) -> None:
    """Make the CPU backend expose ``n`` devices. Must run before the first JAX operation."""
    import jax  # deferred: jax, so that a MeshConfig parses and checks without it

    if n < 1:
        raise MeshError(f"--cpu-devices={n}: must be a positive integer")
    cpu_runtime_env(n)
    try:
        jax.config.update("jax_platforms", "cpu")  # the simulated devices, even where a GPU is present
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        have = jax.device_count()
        if have != n:
            raise MeshError(
                f"cpu devices: asked for {n} but JAX already started with {have}; "
                "simulate devices before any JAX operation"
            ) from None
