"""Force 8 fake CPU devices before anything imports jax (meshes up to 1x8, 2x4, 4x2, 8x1)."""

import os
import re

_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
# Tiny test models: XLA's compile time dominates, so skip the backend's expensive optimisations. Both sides of
# every comparison are compiled with the same flags; numerics are unaffected beyond rounding order.
os.environ["XLA_FLAGS"] = (
    _flags + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()

# Identical XLA programs recur across tests (the unsharded reference on every mesh, the same controls):
# a persistent compilation cache for this session compiles each once.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".jax_cache")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# Start the backend now, so that no in-process CLI call (``--devices``) can change the device count later.
import jax  # noqa: E402

jax.devices()
