"""Moving arrays between the host and the mesh, and what each device holds.

``put_global`` builds a global ``jax.Array`` from a host array through ``make_array_from_callback``:
each process supplies only its own devices' slices, so it works unchanged across processes.
``to_host`` is the reverse (gathered from every process when the array spans several).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshlm.parallel import watchdog


def batch_spec(layout, accum_steps: int = 1) -> P:
    """[B, T] (or [A, B, T] with accumulation) rows split over the ``Layout``'s data shards: DP, or
    (DP, EP) where ep borrows data shards (``Layout.rows``)."""
    return layout.spec("batch", None) if accum_steps == 1 else layout.spec(None, "batch", None)


def batch_sharding(layout, accum_steps: int) -> NamedSharding:
    """Host batches are [B, T], or [A, B, T] with gradient accumulation, on the ``Layout``'s mesh;
    rows split over the data shards (``batch_spec``)."""
    return NamedSharding(layout.mesh, batch_spec(layout, accum_steps))


def put_global(value, sharding) -> jax.Array:
    """A host array (global shape) laid out by ``sharding``; each device gets only its slice."""
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def to_host(x) -> np.ndarray:
    """A global array's full value on this host (gathered from all processes when multi-process). The
    wait for the program that computes it is watched (``watchdog.waiting``: exit 3 past the stall limit)."""
    with watchdog.waiting(watchdog.mesh_of(x)):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))


def bytes_per_device(tree) -> int:
    """Bytes one device holds of ``tree`` (arrays or ShapeDtypeStructs with shardings): its shard of
    each leaf. Every leaf's sharding splits evenly (the rules table checks divisibility)."""
    return sum(
        int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in jax.tree.leaves(tree)
    )


def total_bytes(tree) -> int:
    """Bytes of ``tree``'s global arrays, each counted once."""
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))
