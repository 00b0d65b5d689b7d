"""Every test runs on 8 simulated CPU devices in one process (set before JAX initialises)."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
