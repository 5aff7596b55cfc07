"""Device set-up that must happen before JAX is imported, and mesh construction after.

``force_host_devices`` edits ``XLA_FLAGS``; it only has an effect if JAX's backend has not started yet,
so the CLI calls it before importing any module that imports jax.
"""

from __future__ import annotations

import math
import os
import re
import sys

from meshlm.errors import MeshError

DEFAULT_DEVICES = 4  # the prototype's 4 CPU devices
# Fake host devices beyond this are a typo, not a plan: XLA creates each one and seems to hang.
MAX_HOST_DEVICES = 4096
_FLAG = "--xla_force_host_platform_device_count"


def parse_mesh(text: str) -> tuple[int, int]:
    """'2x4' -> (dp=2, mp=4)."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text or "")
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise MeshError(f"bad --mesh {text!r}: expected DPxMP with positive integers, e.g. 1x4 or 2x2")
    return int(m.group(1)), int(m.group(2))


def force_host_devices(n: int | None) -> None:
    """Ask XLA for ``n`` host CPU devices (fake devices for development). Call before importing jax."""
    if n is None:
        return
    if not 1 <= n <= MAX_HOST_DEVICES:
        raise MeshError(f"--devices must be in [1, {MAX_HOST_DEVICES}], got {n}")
    if "jax" in sys.modules and _backend_started():
        return  # too late: the device count is fixed; make_mesh reports a mismatch clearly
    flags = re.sub(rf"{_FLAG}=\d+", "", os.environ.get("XLA_FLAGS", "")).strip()
    os.environ["XLA_FLAGS"] = f"{flags} {_FLAG}={n}".strip()


def _backend_started() -> bool:
    """Whether JAX has created its backends (XLA_FLAGS is read then, not at import)."""
    from jax._src import xla_bridge

    return bool(getattr(xla_bridge, "_backends", {}))


def accelerator_note() -> str | None:
    """A note for users when --devices is moot because real accelerators are present."""
    import jax

    if jax.default_backend() != "cpu":
        return f"note: --devices ignored: using {jax.device_count()} {jax.default_backend()} device(s)"
    return None


def _more_devices_hint(n: int, processes: int) -> str:
    """How to get ``n`` devices: under ``meshlm launch`` it sets each process's --devices itself
    (and says so in the environment), so the flag to change is the launcher's."""
    from meshlm.parallel.launch import DEVICES_ENV

    if os.environ.get(DEVICES_ENV):
        per = -(-n // processes)  # ceil: every process gets the same count
        return f"pass --devices-per-process {per} to meshlm launch (-n {processes})"
    return f"pass --devices {n} (CPU)"


def make_mesh(*sizes: int, axes: tuple[str, ...] | None = None, devices=None):
    """A (dp, mp) mesh (one size per ``axes.MESH_AXES``, or per ``axes``: ``Layout.mesh`` passes
    (pp, dp, cp, mp), each axis present only when its size > 1) over the first prod(sizes) devices
    (all processes' devices, process-major; or of ``devices``: a chip's compile-only devices, which the
    planner compiles for from any host).

    Axis types are Auto: our own code is explicit through ``shard_map``; Auto lets plain ``jit`` code
    outside it (the optimizer update, the GSPMD baseline) be partitioned by XLA from shardings.
    """
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    from meshlm.parallel.axes import MESH_AXES

    names = MESH_AXES if axes is None else tuple(axes)
    if len(sizes) != len(names):
        raise MeshError(f"a mesh has {len(names)} axes ({', '.join(names)}), got sizes {sizes}")
    n = math.prod(sizes)
    devices = jax.devices() if devices is None else list(devices)
    if n > len(devices):
        raise MeshError(
            f"mesh {'x'.join(map(str, sizes))} needs {n} devices but only {len(devices)} exist; "
            f"{_more_devices_hint(n, jax.process_count())} or choose a smaller mesh"
        )
    grid = np.array(devices[:n]).reshape(sizes)
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))
