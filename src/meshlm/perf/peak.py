"""Measure this machine's matmul throughput: the denominator of model FLOP utilisation (MFU)."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from meshlm.errors import ConfigError


def matmul_peak_flops(dtype: str = "float32", n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of an ``n x n @ n x n`` matmul in ``dtype`` on JAX's default device.

    Counts ``2 * n**3`` FLOPs per matmul and takes the median of ``repeats`` timed runs after a
    warm-up run (which absorbs compilation). On a 2-core CPU the default takes well under 1 s
    in float32; on accelerators, raise ``n`` (e.g. 8192) so launch overhead is negligible.
    """
    if n < 1 or repeats < 1:
        raise ConfigError(f"matmul_peak_flops needs n >= 1 and repeats >= 1, got {n=}, {repeats=}")
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        raise ConfigError(f"dtype {dtype!r} is not a float type; use e.g. 'float32' or 'bfloat16'")
    ka, kb = jax.random.split(jax.random.key(0))
    # Inputs are made on the device and passed as arguments so XLA cannot constant-fold them.
    a = jax.random.normal(ka, (n, n), dt)
    b = jax.random.normal(kb, (n, n), dt)
    matmul = jax.jit(jnp.matmul)
    matmul(a, b).block_until_ready()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        seconds.append(time.perf_counter() - start)
    # A small n on a fast device can time below the clock's resolution; never divide by zero.
    median = max(statistics.median(seconds), 1e-9)
    return 2.0 * n**3 / median
