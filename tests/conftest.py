"""Every test runs on 8 simulated CPU devices in one process (set before JAX initialises)."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxpar.mesh import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)
