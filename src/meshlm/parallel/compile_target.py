"""The platform a computation is compiled for: JAX's default backend, or, inside ``compiling_for``,
another one (``meshlm plan --chip v5e`` compiles for a TPU's compile-only devices from a CPU host).
Code that picks a kernel by platform reads ``compile_platform`` (``model.flash_kernel``: the Mosaic
kernel for a TPU, interpret mode elsewhere), so a step traced for the chip is the chip's step."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "meshlm_compile_platform", default=None
)


def compile_platform() -> str:
    """ "tpu", "gpu" or "cpu": the platform being compiled for (``compiling_for``'s, else JAX's backend)."""
    import jax

    return _PLATFORM.get() or jax.default_backend()


@contextlib.contextmanager
def compiling_for(platform: str | None) -> Iterator[None]:
    """Within: traces and compiles are for ``platform`` (None: JAX's default backend)."""
    token = _PLATFORM.set(platform)
    try:
        yield
    finally:
        _PLATFORM.reset(token)
