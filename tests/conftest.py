"""Force 8 fake CPU devices before anything imports jax (meshes up to 1x8, 2x4, 4x2, 8x1)."""

import os
import re

_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
