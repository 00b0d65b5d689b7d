"""Reference peaks for the benchmarks: the host's copy and read bandwidth, a device's copy bandwidth, the
matmul rate, and a GPU's HBM bandwidth from its ``jaxpar.analysis.hardware`` profile. Imported by
``generate.py`` (and through it ``lab_gpu.py``), beside them in ``benchmarks/``."""

from __future__ import annotations

import os
import threading
import time


def host_bandwidth(mib: int, repeats: int) -> dict:
    """Host memory bandwidth, best of ``repeats``, on one thread and on every core (each thread takes its
    own contiguous share; numpy drops the GIL): a copy (read + written bytes / s) and a read-only sum
    (read bytes / s, what a decode step mostly does). ``gb_s`` is the largest of them."""
    import numpy as np

    src = np.ones(mib * 2**20 // 8, np.float64)
    dst = np.empty_like(src)

    def run(threads: int, read_only: bool) -> float:
        parts = list(zip(np.array_split(src, threads), np.array_split(dst, threads)))
        work = (lambda s, d: s.sum()) if read_only else (lambda s, d: np.copyto(d, s))
        best = float("inf")
        for _ in range(repeats):
            workers = [threading.Thread(target=work, args=part) for part in parts]
            t0 = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            best = min(best, time.perf_counter() - t0)
        return round((1 if read_only else 2) * src.nbytes / best / 1e9, 2)

    cores = os.cpu_count() or 1
    out = {"array_bytes": int(src.nbytes)}
    for threads in sorted({1, cores}):
        out[f"copy_{threads}_threads_gb_s"] = run(threads, False)
        out[f"read_{threads}_threads_gb_s"] = run(threads, True)
    best = max((k for k in out if k.endswith("gb_s")), key=out.get)
    return out | {"gb_s": out[best], "used": best}


def best_seconds(run, repeats: int) -> float:
    """The shortest of ``repeats`` timed calls of ``run`` (a jitted call), after one untimed warm-up."""
    import jax

    jax.block_until_ready(run())
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run())
        best = min(best, time.perf_counter() - t0)
    return best


def device_bandwidth(mib: int, repeats: int) -> float:
    """GB/s of a jitted on-device copy (x + 1: read + written bytes / s), best of ``repeats``."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones(mib * 2**20 // 4, jnp.float32)
    f = jax.jit(lambda a: a + 1)
    return round(2 * x.nbytes / best_seconds(lambda: f(x), repeats) / 1e9, 2)


def matmul_gflops(dtype: str, n: int = 2048, repeats: int = 5) -> float:
    """The device's measured dense matmul rate (GFLOP/s) at n × n × n in ``dtype``, best of ``repeats``."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    return round(2 * n**3 / best_seconds(lambda: f(a), repeats) / 1e9, 1)


def gpu_peak(mib: int, repeats: int) -> dict:
    """Peak HBM bandwidth from the device's hardware profile, beside a measured on-device copy."""
    import jax

    from jaxpar.analysis.hardware import HARDWARE, hardware_of_device

    kind = jax.devices()[0].device_kind
    measured = device_bandwidth(mib, repeats)
    match = HARDWARE.get(hardware_of_device(kind))
    if match is None:
        return {
            "source": f"measured on-device copy (no hardware profile matches {kind!r})",
            "gb_s": measured,
            "device_kind": kind,
            "measured_copy_gb_s": measured,
        }
    return {
        "source": f"jaxpar.analysis.hardware[{match.name!r}].hbm_bandwidth (datasheet)",
        "gb_s": match.hbm_bandwidth / 1e9,
        "device_kind": kind,
        "measured_copy_gb_s": measured,
    }
