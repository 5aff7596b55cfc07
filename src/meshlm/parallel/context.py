"""The parallel context layers compute in: collectives and shard indices, and nothing else.

Layers never name mesh axes. They call these methods, which are identities when the model runs
unsharded (``Parallel()``, plain ``jit`` on one device) and collectives inside ``jax.shard_map``.

Megatron's pair, made varying-axis-correct for ``shard_map(check_vma=True)``:

* ``f`` (identity forward, all-reduce backward) is ``lax.pcast(x, MP, to="varying")``: it marks a
  replicated activation as per-shard, and its transpose is a ``psum`` over MP.
* ``g`` (all-reduce forward, identity backward) is ``lax.psum(x, MP)`` of a per-shard value: the
  transpose of a varying-to-invariant ``psum`` is a ``pcast`` back to varying, i.e. the identity.

Memory options (``meshlm.parallel.memory`` documents them): with FSDP a weight is stored sliced over
DP and ``param`` all-gathers it where a layer asks for it (the transpose, a reduce-scatter over DP,
is the gradient's data-parallel sum); with sequence parallelism (``sp``) the activations between
blocks are split over the sequence on MP, ``f`` all-gathers them (reduce-scatter backward) and
``row_sum`` reduce-scatters the row-parallel partials (all-gather backward).

No collective has a custom VJP: JAX's own transposes are exact (``meshlm verify`` proves it, in
float64, and its planted-fault controls show that the proof can fail). The model's one custom VJP is
the weight matmul's backward (``model.dense``, for XLA:CPU's fast matmul path), under the same
proof. Negative controls subclass this class and override one method each; layers stay unchanged.
Faults that have no real operation to override are planted at a named ``tap`` (identity here: the
proof's ``proof.taps.Tapped`` gives each name a method its controls override).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax.numpy as jnp
from jax import lax

from meshlm.parallel.axes import DP, MP
from meshlm.parallel.cp import ContextParallel
from meshlm.parallel.ep import ExpertAxis
from meshlm.parallel.experts import ExpertParallel
from meshlm.parallel.int8 import Int8Collectives
from meshlm.parallel.layout import Layout


@dataclass(frozen=True)
class Parallel(
    ContextParallel, ExpertAxis, ExpertParallel, Int8Collectives
):  # ExpertAxis: ep's, before the all-local
    # The mesh's sizes and options (mp shards, sp, cp, ...); the default, 1x1, is the unsharded model.
    layout: Layout = field(default_factory=Layout)
    sharded: bool = False  # True inside shard_map over the layout's mesh

    @classmethod
    def on(cls, layout: Layout):
        """The context layers compute in inside ``shard_map`` over ``layout``'s mesh."""
        return cls(layout=layout, sharded=True)

    # --- Megatron collectives over the model axis -------------------------------------------
    def f(self, x):
        """Identity forward, all-reduce backward: entering a column-parallel region. With ``sp``:
        x [B, T/mp, D] per shard -> [B, T, D], all-gather forward, reduce-scatter backward."""
        if not self.sharded:
            return x
        return self.gather_seq(x) if self.layout.sp else lax.pcast(x, MP, to="varying")

    def g(self, x):
        """All-reduce forward, identity backward: leaving a row-parallel region."""
        return lax.psum(x, MP) if self.sharded else x

    def row_sum(self, partial):
        """Sum row-parallel partials [B, T, D] over shards: ``g``, or with ``sp`` a reduce-scatter
        over the sequence to [B, T/mp, D] (all-gather backward)."""
        if self.layout.sp and self.sharded:
            return lax.psum_scatter(partial, MP, scatter_dimension=1, tiled=True)
        return self.g(partial)

    def row_out(self, partial, bias=None):
        """Sum row-parallel partial outputs over shards, then add the (replicated) bias once."""
        out = self.row_sum(partial)
        return out if bias is None else out + bias

    # --- memory options: sequence parallelism and FSDP ---------------------------------------
    def gather_seq(self, x):
        """[B, T/mp, ...] sequence slices -> [B, T, ...] in shard order (reduce-scatter backward)."""
        return lax.all_gather(x, MP, axis=1, tiled=True)

    def seq_len_check(self, seq_len: int):
        """With ``sp`` the sequence is split over MP: it must divide (``Layout.check_seq_len``)."""
        if self.sharded:
            self.layout.check_seq_len(seq_len * self.layout.cp)

    def param(self, value, shape, norm: bool):
        """A parameter as a layer uses it (called by a Haiku getter for every ``get_parameter``).

        ``value``: what this shard stores; ``shape``: what the layer asked for. A stored slice
        smaller than the request is an FSDP slice over DP (with ep on, a dense weight's over DP and
        EP: ``fsdp_axes``): all-gathered along that dimension (``gather_weight``). ``norm``: a norm's
        scale/offset, which with ``sp`` meets the sequence slices of every shard, so JAX sums its
        gradient over MP (the ``norm_param`` tap)."""
        if not self.sharded:
            return value
        if tuple(value.shape) != tuple(shape):
            d = next(i for i, (a, b) in enumerate(zip(value.shape, shape, strict=True)) if a != b)
            return self.gather_weight(value, d, self.fsdp_axes(shape[d] // value.shape[d]))
        return self.tap("norm_param", value) if norm and self.layout.sp else value

    def fsdp_axes(self, shards: int):
        """The axes an FSDP slice of 1 / ``shards`` of its weight is split over: DP, or with ep on a
        dense weight's (DP, EP), every data shard, an expert weight's DP: ``Layout.fsdp_axes``)."""
        return self.layout.fsdp_axes(expert=shards != self.layout.fsdp_shards())

    def gather_weight(self, w, dim: int, axes=DP):
        """FSDP: this shard's slice of a weight -> the whole weight along ``dim`` (all-gather over
        ``axes``; its transpose reduce-scatters the gradient: each shard keeps the sum of its slice)."""
        return lax.all_gather(w, axes, axis=dim, tiled=True)

    def tap(self, name: str, x):
        """``x`` as the computation uses it at the point ``name`` (identity): where the proof plants a
        fault that no real operation here can carry (``proof.taps`` names every tap)."""
        return x

    def pmax(self, x):
        return lax.pmax(x, MP) if self.sharded else x

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

    def kv_head_index(self, n_heads: int, n_kv_heads: int):
        """With replicated KV heads (mp > n_kv_heads): the one KV head this shard's queries use."""
        heads_per_shard = n_heads // self.layout.mp
        return self.shard_index() * heads_per_shard // (n_heads // n_kv_heads)

    # --- data parallel ---------------------------------------------------------------------
    def batch_mean(self, x):
        """Mean over data-parallel (and context-parallel) shards of per-shard means: the mean over
        every token of the global batch (each shard holds as many tokens)."""
        if not self.sharded:
            return x
        axes = self.layout.batch_axes  # dp, and ep and cp when on (their "loss" use: ``Axis.uses``)
        return lax.pmean(x, axes if len(axes) > 1 else axes[0])
