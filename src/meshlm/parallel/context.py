"""The parallel context layers compute in: collectives and shard indices, and nothing else.

Layers never name mesh axes. They call these methods, which are identities when the model runs
unsharded (``Parallel()``, plain ``jit`` on one device) and collectives inside ``jax.shard_map``.

Megatron's pair, made varying-axis-correct for ``shard_map(check_vma=True)``:

* ``f`` (identity forward, all-reduce backward) is ``lax.pcast(x, MP, to="varying")``: it marks a
  replicated activation as per-shard, and its transpose is a ``psum`` over MP.
* ``g`` (all-reduce forward, identity backward) is ``lax.psum(x, MP)`` of a per-shard value: the
  transpose of a varying-to-invariant ``psum`` is a ``pcast`` back to varying, i.e. the identity.

We do not write custom VJPs: JAX's own transposes are exact (``meshlm verify`` proves it, in float64,
and its planted-fault controls show that the proof can fail). Negative controls subclass this class
and override one method each; layers stay unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
from jax import lax

from meshlm.parallel.axes import DP, MP


@dataclass(frozen=True)
class Parallel:
    mp: int = 1  # number of model-parallel shards (1: unsharded)
    dp: int = 1  # number of data-parallel shards
    sharded: bool = False  # True inside shard_map over the (DP, MP) mesh

    # --- Megatron collectives over the model axis -------------------------------------------
    def f(self, x):
        """Identity forward, all-reduce backward: entering a column-parallel region."""
        return lax.pcast(x, MP, to="varying") if self.sharded else x

    def g(self, x):
        """All-reduce forward, identity backward: leaving a row-parallel region."""
        return lax.psum(x, MP) if self.sharded else x

    def row_out(self, partial, bias=None):
        """Sum row-parallel partial outputs over shards, then add the (replicated) bias once."""
        out = self.g(partial)
        return out if bias is None else out + bias

    def pmax(self, x):
        return lax.pmax(x, MP) if self.sharded else x

    def gather_last(self, x):
        """Concatenate per-shard slices of the last axis into the global axis (e.g. logits)."""
        return lax.all_gather(x, MP, axis=x.ndim - 1, tiled=True) if self.sharded else x

    # --- which slice this shard owns -------------------------------------------------------
    def shard_index(self):
        """This shard's position on the model axis (0 when unsharded)."""
        return lax.axis_index(MP) if self.sharded else jnp.int32(0)

    def vocab_start(self, vocab_per_shard: int):
        """First global vocabulary id owned by this shard (contiguous slices)."""
        return self.shard_index() * vocab_per_shard

    def real_vocab_columns(self, vocab_per_shard: int, vocab_size: int):
        """[V/mp] bool: which of this shard's vocabulary columns are real ids, not padding."""
        return self.vocab_start(vocab_per_shard) + jnp.arange(vocab_per_shard) < vocab_size

    def own_heads(self, w):
        """The query-head weights this shard computes with: its own slice (a hook for controls)."""
        return w

    def kv_head_index(self, n_heads: int, n_kv_heads: int):
        """With replicated KV heads (mp > n_kv_heads): the one KV head this shard's queries use."""
        heads_per_shard = n_heads // self.mp
        return self.shard_index() * heads_per_shard // (n_heads // n_kv_heads)

    # --- data parallel ---------------------------------------------------------------------
    def batch_mean(self, x):
        """Mean over data-parallel shards of per-shard means: the mean over the global batch."""
        return lax.pmean(x, DP) if self.sharded else x
