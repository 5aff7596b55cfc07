"""Compiled temporary memory of attention forward + backward: plain ([T, T] scores) vs blockwise.

Compiles (does not run) the gradient of sum(attention(q, k, v)) by q, k, v for one head group and
prints XLA's ``memory_analysis().temp_size_in_bytes`` per sequence length, and the growth from one
length to the next. Plain attention's temporaries grow with T^2 (16x per 4x in T); blockwise's with T.

    PYTHONPATH=src python scripts/attn_memory.py --seq-lens 1024 4096 16384
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from meshlm.model.attention import _attend
from meshlm.model.blockwise import DEFAULT_BLOCK, blockwise_attention


def temp_bytes(kind: str, t: int, heads: int, kv_heads: int, head_dim: int, block: int) -> int:
    q = jax.ShapeDtypeStruct((1, t, heads, head_dim), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, t, kv_heads, head_dim), jnp.float32)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    if kind == "plain":
        attend = lambda q, k, v: _attend(q, k, v, pos, pos)
    else:
        attend = lambda q, k, v: blockwise_attention(q, k, v, pos, pos, block=block)
    grad = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v)), argnums=(0, 1, 2))
    return jax.jit(grad).lower(q, kv, kv).compile().memory_analysis().temp_size_in_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--heads", type=int, default=1, help="query heads of the group")
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block", type=int, default=DEFAULT_BLOCK)
    a = p.parse_args()
    print(f"one head group: {a.heads} query / {a.kv_heads} KV heads, head_dim {a.head_dim}, float32, batch 1")
    print(
        f"{'T':>7}  {'plain MiB':>10} {'growth':>7}  {'blockwise MiB':>13} {'growth':>7}  (block {a.block})"
    )
    last = None
    for t in a.seq_lens:
        now = [temp_bytes(k, t, a.heads, a.kv_heads, a.head_dim, a.block) for k in ("plain", "blockwise")]
        growth = [f"{n / o:.1f}x" for n, o in zip(now, last, strict=True)] if last else ["", ""]
        print(f"{t:>7}  {now[0] / 2**20:>10.2f} {growth[0]:>7}  {now[1] / 2**20:>13.2f} {growth[1]:>7}")
        last = now


if __name__ == "__main__":
    main()
