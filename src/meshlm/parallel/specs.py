"""Every PartitionSpec outside the rules table's rows, by role: ``AxisUses.spec`` turns logical names
into a spec for batches, activations, caches and statistics alike (MaxText's ``logical_axis_rules`` as
data; torchtitan's ``ParallelDims`` names a mesh per use), from the uses each axis declares
(``parallel.axes.Axis.uses``). FSDP's axes are decided here, once (``fsdp_axes``): the rules table
stores a weight's slice over them and ``Parallel.param`` gathers it back over the same.

``Layout`` mixes this in (with ``axes.AxisFacts``: ``shape``, ``mesh_shape``, ``logical_axes``). This
module must not import JAX at module level (the CLI validates layouts before choosing devices).
"""

from __future__ import annotations

import math

from meshlm.parallel.axes import AXES, LOGICAL_DIMS, MP

# The uses an axis serves (``Axis.uses``), each also a logical name of ``AxisUses.spec``: the axes of
# a use are those on in the mesh that serve it, in mesh order (torchtitan's mesh per use).
USES = {
    "batch": "the batch's rows (host batches, generation's rows, a statistic's batch dim)",
    "loss": "the batch's tokens: the loss and the gradients are means over these axes together",
    "fsdp": "a dense weight's FSDP slice (with --fsdp): every data shard",
    "expert_fsdp": "an expert weight's FSDP slice (its experts on ep): the data shards outside ep",
    "length": "the sequence as the blocks hold it (in 2 x cp load-balanced chunks)",
    "model": "one entry per model-parallel shard (a value each mp shard holds its copy of)",
}


class AxisUses:
    """The axes a layout's uses are split over, and the specs of arrays named by use (``Layout``'s base,
    with ``AxisFacts``)."""

    def axes_for(self, use: str) -> tuple[str, ...]:
        """The mesh axes serving ``use`` (``USES``) on this layout, in mesh order."""
        if use not in USES:
            raise ValueError(f"unknown axis use {use!r}; one of {', '.join(USES)}")
        return tuple(a.name for a in AXES if a.name in self.shape and use in a.uses)

    def spec(self, *names):
        """The PartitionSpec of an array whose dims are ``names``: a use (``USES``: "batch", "length",
        ...), a logical parameter dim (``LOGICAL_DIMS``: "kv_heads", ...) or None (not split), e.g.
        ``spec("batch", "length")``: P(DP, CP) with cp on, P(DP, None) without; P((DP, EP), ...) with ep."""
        from jax.sharding import PartitionSpec

        dims = self.logical_axes()
        entry = lambda n: dims.get(n) if n in LOGICAL_DIMS else _entry(self.axes_for(n))
        return PartitionSpec(*(None if n is None else entry(n) for n in names))

    def activation_spec(self):
        """The PartitionSpec of [B, T, D] activations between blocks: rows over the batch's axes, tokens
        over cp and, with sp, over mp too (Megatron's sequence parallelism)."""
        from jax.sharding import PartitionSpec

        seq = _entry(self.axes_for("length") + ((MP,) if self.sp else ()))
        return PartitionSpec(self.rows, seq, None)

    @property
    def rows(self):
        """The mesh axes the batch's rows are split over (a PartitionSpec entry): DP, or (DP, EP) with
        ep on (batch shard d x ep + e on mesh position (d, e)); cp shards each get whole rows."""
        return _entry(self.axes_for("batch"))

    def fsdp_axes(self, expert: bool = False):
        """FSDP's one decision: the axes (a PartitionSpec entry) a dense weight's slice is split over --
        DP, or every data shard (DP, EP) with ep on -- or an expert weight's (``expert``: its experts on
        EP), the mesh's DP axis (the data shards outside ep)."""
        return _entry(self.axes_for("expert_fsdp" if expert else "fsdp"))

    def fsdp_shards(self, expert: bool = False) -> int:
        """How many slices ``fsdp_axes(expert)`` cut a weight into (the mesh's sizes: dp, or dp / ep)."""
        return math.prod(self.mesh_shape[a] for a in self.axes_for("expert_fsdp" if expert else "fsdp"))

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch's tokens are split over (dp, and ep and cp when on)."""
        return self.axes_for("loss")


def _entry(axes: tuple[str, ...]):
    """A PartitionSpec entry of ``axes``: None, the one axis, or the tuple of several."""
    return None if not axes else axes[0] if len(axes) == 1 else axes
