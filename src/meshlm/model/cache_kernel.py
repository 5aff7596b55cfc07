"""The KV cache's write of a decode step (``attention._put``): XLA's scatter, or on a TPU a Pallas kernel.

The stacked flat cache ``stack`` [L, B, S, F] (per shard; F = Kc * E, ``generate.cache``) gets each
row's new token x [B, T, F] at [index, b, at[b, t]]. Two ways, the same values:

* ``scatter_write``: one XLA scatter (``stack.at[index, rows, at].set``), everywhere, every shape. On
  XLA:TPU it is a "kCustom" scatter fusion that XLA's cost model leaves unpriced (no
  ``estimated_cycles``: ``scripts/decode_hlo.py``'s estimate omits it); its code (the compile-only v5e's
  LLO) reads each row's 8-slot tile block of the layer (T(8,128): 8 x F values), merges the row, writes
  the block back: ~920 bundles and 2 x B DMAs a call. A chip profile put 16 of them at ~22 us each, a
  third of a llama-100m batch-8 step (docs/benchmarks.md, "Decode").
* ``kernel_write``: a Pallas TPU kernel doing that read-merge-write itself, with nothing else: the
  layer index and positions scalar-prefetched into SMEM, the cache aliased to the output and left in
  main memory (``pl.ANY``), B DMAs of each row's tile block in, a select of the row, B DMAs out. A
  tile-aligned block is the least a DMA may write (Mosaic refuses a DMA at a slot offset that is not a
  multiple of the tile's 8: a lone row of a packed bf16 tile is not addressable). ~120 bundles.

Which one runs (``write_rows``): the kernel on a TPU (``compile_platform``: ``meshlm plan --chip``'s
trace too) for one token a row (a decode step; a prefill or a speculative check writes more, and two
of one row's tokens may share a tile block) when S is a multiple of the tile and the blocks fit
``VMEM_BYTES``; the scatter otherwise and on any other platform. ``MESHLM_KV_WRITE`` (``KV_WRITE_ENV``)
overrides it for a measurement: "scatter" everywhere, or "kernel" wherever the shape allows it (off a
TPU in Pallas's interpret mode: slow, for tests). scripts/kv_write.py times the two on a chip.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from meshlm.errors import ConfigError
from meshlm.model.flash_kernel import interpret_mode, primitive
from meshlm.parallel.compile_target import compile_platform

TILE = 8  # slots of an XLA:TPU tile of the cache's [S, F] planes (T(8,128); bf16 (8,128)(2,1))
VMEM_BYTES = 8 << 20  # the kernel's blocks [B, TILE, F] at most this (v5e's scoped VMEM: 16 MiB)
KV_WRITE_ENV = "MESHLM_KV_WRITE"
MODES = ("auto", "scatter", "kernel")


def scatter_write(stack, index, at, x):
    """``stack`` [L, B, S, F] with x [B, T, F] written at [index, b, at[b, t]]: ONE scatter for every row
    and token, done in place (positions past S dropped, as a scatter drops them)."""
    rows = jnp.arange(at.shape[0])[:, None]  # [B, 1]
    return stack.at[index, rows, at].set(x, unique_indices=True)


def kernel_write(stack, index, at, x):
    """``scatter_write``'s values by the Pallas kernel (one token a row: x [B, 1, F], at [B, 1]); in
    Pallas's interpret mode off a TPU (``interpret_mode``)."""
    if x.shape[1] != 1 or not kernel_fits(stack):
        raise ValueError(
            f"kernel_write: one token a row and S % {TILE} == 0 only; x {x.shape}, {stack.shape}"
        )
    index = jnp.asarray(index, jnp.int32).reshape(1)
    return _write_p.bind(stack, index, at[:, 0].astype(jnp.int32), x.astype(stack.dtype))


def kernel_fits(stack) -> bool:
    """Whether the kernel can write ``stack`` [L, B, S, F]: whole tile blocks, all in VMEM at once."""
    _, b, s, f = stack.shape
    return s % TILE == 0 and b * TILE * f * stack.dtype.itemsize <= VMEM_BYTES


def write_mode() -> str:
    """``MESHLM_KV_WRITE``: "auto" (unset), "scatter" or "kernel"; anything else is an error."""
    mode = os.environ.get(KV_WRITE_ENV, "auto") or "auto"
    if mode not in MODES:
        raise ConfigError(f"{KV_WRITE_ENV}={mode!r}: use one of {', '.join(MODES)} (or leave it unset)")
    return mode


def write_rows(stack, index, at, x):
    """The write ``attention._put`` makes: the kernel where it applies and is chosen (module docstring),
    else the scatter."""
    mode = write_mode()
    wanted = mode == "kernel" or (mode == "auto" and compile_platform() == "tpu")
    if wanted and x.shape[1] == 1 and kernel_fits(stack):
        return kernel_write(stack, index, at, x)
    return scatter_write(stack, index, at, x)


def _kernel(index_ref, at_ref, x_ref, _, out_ref, blocks, sems):
    """index_ref [1], at_ref [B] (SMEM); x_ref [B, 1, F] (VMEM: a row at a dynamic b is a whole tile);
    out_ref [L, B, S, F] (main memory, the cache, aliased); blocks [B, TILE, F] VMEM scratch; sems: the
    reads' and the writes' DMA semaphores."""
    s = out_ref.shape[2]

    def start(b):  # row b's tile block: the one holding its slot (the last one for a slot past S)
        return pl.multiple_of(jnp.minimum(at_ref[b], s - 1) & ~(TILE - 1), TILE)  # no signed division

    def block(b):
        return out_ref.at[index_ref[0], b, pl.ds(start(b), TILE)]

    def copy(b, inward):
        src, dst = (block(b), blocks.at[b]) if inward else (blocks.at[b], block(b))
        return pltpu.make_async_copy(src, dst, sems.at[0 if inward else 1])

    def merge(b):  # the block with row b's slot replaced (none past S: no slot matches)
        slots = lax.broadcasted_iota(jnp.int32, blocks.shape[1:], 0) + start(b)  # [TILE, F]
        blocks[b] = jnp.where(slots == at_ref[b], x_ref[b], blocks[b])

    loop = lambda f: lax.fori_loop(0, blocks.shape[0], lambda b, _: f(b), None)
    loop(lambda b: copy(b, True).start())  # every row's block in flight at once
    loop(lambda b: copy(b, True).wait())
    loop(merge)
    loop(lambda b: copy(b, False).start())
    loop(lambda b: copy(b, False).wait())


def _impl(stack, index, at, x):
    """The kernel's pallas_call on one device's operands (``_write_p``'s lowering)."""
    l_, b, s, f = stack.shape
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(1,),
        in_specs=[pl.BlockSpec(memory_space=pltpu.MemorySpace.VMEM), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.VMEM((b, TILE, f), stack.dtype), pltpu.SemaphoreType.DMA((2,))],
    )
    call = pl.pallas_call(
        _kernel,
        grid_spec=spec,
        out_shape=jax.ShapeDtypeStruct(stack.shape, stack.dtype),
        input_output_aliases={3: 0},  # operands: index, at, x, stack -> the cache, written in place
        interpret=interpret_mode(),
    )
    return call(index, at, x, stack)


# One primitive, typed as the cache (inside shard_map, varying as the cache does); only its lowering
# traces the kernel, per device (``flash_kernel.primitive``: pallas_call declares no mesh axes).
_write_p = primitive("meshlm_kv_write", _impl, lambda stack, *_: stack, False)
