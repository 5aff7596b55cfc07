"""Uneven pipeline stages' padded layer stack (``model.stage_layers.slots`` decides the slots): the one
place that turns the canonical tree (the real layers: checkpoints, export, evaluation, the proof's
reference) into the pipelined device layout (the body's stack [chunks x S, ...], split over pp) and back,
and the chunk that runs the padding slots as the identity.

Which trees: parameters, gradients and the optimizer's moments alike -- every leaf under a module of
the body's stack (``layers/...``) with the real layer count leading (``pad``) or the padded one
(``unpad``); the optimizer state follows the parameters it is initialised from, so it is padded once
they are. Padding slots hold zeros; their gradients are exactly zero (``chunk``: a slot's output is its
input where it holds no layer), so AdamW (decoupled weight decay of zero is zero) keeps them zero.

Memory: the padded stack costs ``chunks x S - body`` more layers' parameters (DeepSeek-V3 on pp 4: 60
slots for 58 layers, +3.4 %), spread over the stages that hold them.

Where it is used: the proof (``proof.problem.model_problem``: the sharded run's parameters padded from
the init, the reference's trees through ``unpad`` / ``pad``), the pipelined step (``chunk``, the
statistics' ``real_statistics``, ``slot_balance``), evaluation (``pipelined.pipelined_loss`` reads the real
layers), ``meshlm plan`` (the padded shapes per device, the real totals), and ``meshlm train``: its
init (``rules.init_sharded``: the canonical init padded in the same program), its checkpoints
(``to_canonical`` on save, ``canonical_abstract`` and ``to_device`` on resume) and the parameters it
starts from (``io.model_io.load_model``). The canonical stack lives on the devices with pp moved to
another of each weight's dimensions (``_canonical``): saving and loading hold no more per device.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshlm.model import stage_layers
from meshlm.model.layer_kinds import MOE_STACK
from meshlm.model.pieces import layers_fn
from meshlm.parallel.axes import PP
from meshlm.parallel.layout import axis_sizes

BODY = f"{MOE_STACK}/"  # a one-kind body is the main stack (``layer_kinds.stacks``), after any prefix


@dataclass(frozen=True)
class Slots:
    """The padded stack: ``layers`` real body layers in ``chunks`` chunks of ``per`` slots; ``real``:
    each real layer's slot, in order."""

    layers: int
    chunks: int
    per: int
    real: tuple[int, ...]

    @property
    def total(self) -> int:
        return self.chunks * self.per

    def valid(self) -> np.ndarray:
        """[chunks, per] bool: which slots hold a layer (chunk k = stage k: no virtual stages)."""
        out = np.zeros(self.total, bool)
        out[list(self.real)] = True
        return out.reshape(self.chunks, self.per)

    def pad(self, tree):
        """Canonical -> padded: each body leaf [layers, ...] -> [total, ...], zeros in the padding (host
        arrays, traced arrays, or ShapeDtypeStructs)."""
        return _map_body(tree, self.layers, self._pad_leaf)

    def unpad(self, tree):
        """Padded -> canonical: each body leaf [total, ...] -> its real slots [layers, ...]."""
        return _map_body(tree, self.total, lambda a: self.real_rows(a))

    def real_rows(self, a):
        """The rows of the real layers of a [total, ...] array (the routing statistics too)."""
        if isinstance(a, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct((self.layers, *a.shape[1:]), a.dtype)
        return a[np.asarray(self.real)]

    def pad_rows(self, a):
        """[layers, ...] -> [total, ...] with zero rows at the padding."""
        return self._pad_leaf(a)

    def _pad_leaf(self, a):
        shape = (self.total, *a.shape[1:])
        if isinstance(a, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(shape, a.dtype)
        if isinstance(a, np.ndarray):
            out = np.zeros(shape, a.dtype)
            out[list(self.real)] = a
            return out
        return jnp.zeros(shape, a.dtype).at[np.asarray(self.real)].set(a)


def slots_of(cfg, layout) -> Slots | None:
    """``cfg``'s padded stack on ``layout``: None unless pipelined with uneven stages."""
    if not getattr(layout, "pipelined", False):
        return None
    pipe = layout.pipeline
    got = stage_layers.slots(cfg, pipe.pp * pipe.virtual_stages, pipe.virtual_stages)
    if got is None:
        return None
    per, real = got
    return Slots(len(real), pipe.pp * pipe.virtual_stages, per, real)


def _map_body(tree, rows: int, fn):
    """``fn`` on every leaf under a body module (a dict key ``layers/...``) with ``rows`` leading."""
    return jax.tree_util.tree_map_with_path(lambda path, a: fn(a) if _body_leaf(path, a, rows) else a, tree)


def _in_body(path) -> bool:
    """Whether a tree path runs through a body module (a dict key ``layers/...``)."""
    return any(isinstance(k, jax.tree_util.DictKey) and str(k.key).startswith(BODY) for k in path)


def _body_leaf(path, a, rows: int) -> bool:
    return _in_body(path) and len(a.shape) > 0 and a.shape[0] == rows


def _canonical(sharding, shape):
    """A body leaf's sharding in the canonical stack ``shape`` [layers, ...]: pp does not divide the
    real layer count, so pp moves from the layer dimension to the largest other one it divides that no
    axis splits (per device as much as the padded stack holds, not pp times it); unsplit over pp where
    none is free (a vector per layer)."""
    spec = [*sharding.spec, *[None] * (len(shape) - len(sharding.spec))]
    spec[0], pp = None, axis_sizes(sharding.mesh)[PP]
    free = [i for i in range(1, len(shape)) if spec[i] is None and shape[i] % pp == 0]
    if free:
        spec[max(free, key=lambda i: shape[i])] = PP
    return NamedSharding(sharding.mesh, P(*spec))


def _padded(sharding):
    """A body leaf's sharding in the padded stack: pp on the layer dimension (``_canonical`` undone)."""
    return NamedSharding(sharding.mesh, P(PP, *(None if d == PP else d for d in tuple(sharding.spec)[1:])))


def canonical_shardings(shardings, shapes, slots: Slots | None):
    """The canonical parameters' NamedShardings from the padded layout's (the rules table's; ``shapes``:
    the canonical ShapeDtypeStructs): where a checkpoint's real stack is read before ``to_device``."""
    if slots is None:
        return shardings
    one = lambda path, h, s: _canonical(h, s.shape) if _in_body(path) else h
    return jax.tree_util.tree_map_with_path(one, shardings, shapes)


def canonical_abstract(tree, slots: Slots | None):
    """ShapeDtypeStructs of the canonical tree of a padded one (arrays or structs with shardings): what a
    checkpoint holds, on ``_canonical``'s shardings (``[layers]`` does not divide over pp)."""
    if slots is None:
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)

    def one(path, a):
        if not _body_leaf(path, a, slots.total):
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
        shape = (slots.layers, *a.shape[1:])
        return jax.ShapeDtypeStruct(shape, a.dtype, sharding=_canonical(a.sharding, shape))

    return jax.tree_util.tree_map_with_path(one, tree)


def to_canonical(tree, slots: Slots | None):
    """The padded device tree (parameters, optimizer state) as the canonical one, on
    ``canonical_abstract``'s shardings: what a checkpoint saves."""
    if slots is None:
        return tree
    out = jax.tree.map(lambda a: a.sharding, canonical_abstract(tree, slots))
    return jax.jit(slots.unpad, out_shardings=out)(tree)


def to_device(tree, slots: Slots | None):
    """The canonical tree (loaded from a checkpoint, on ``canonical_abstract``'s shardings) padded into
    the device layout: the body's layer dimension over pp again."""
    if slots is None:
        return tree

    def one(path, a):
        return _padded(a.sharding) if _body_leaf(path, a, slots.layers) else a.sharding

    return jax.jit(slots.pad, out_shardings=jax.tree_util.tree_map_with_path(one, tree))(tree)


def chunk(cfg, par, stats: bool, slots: Slots, params, x, starts=None):
    """One stage's chunk of ``slots.per`` slots (inside the pipeline's shard_map): a scan of one-layer
    steps, each slot's output its input where the slot holds no layer (``jnp.where``, not a ``cond``:
    no collective runs under a branch), so nothing flows into a padding slot's parameters. ``stats``:
    also each slot's routing statistics [per, ...] (the padding's rows are dropped by the caller)."""
    one = hk.without_apply_rng(hk.transform(layers_fn(stage_layers.chunk_config(cfg, 1), par, stats))).apply
    valid = jnp.asarray(slot_valid(slots))[lax.axis_index(PP)]  # [per]: this stage's slots with a layer

    def step(h, xs):
        p, ok = xs
        out = one(jax.tree.map(lambda a: a[None], p), h, starts)
        y, st = out if stats else (out, None)
        return jnp.where(ok, y, h), (() if st is None else st[0])

    y, st = lax.scan(step, x, (params, valid))
    return (y, st) if stats else y


def real_statistics(slots: Slots, stats):
    """The routing statistics [total, ...] of the real layers [layers, ...]: the padding's rows dropped
    before the aux and z losses, the routing metrics and the bias balancing (a hook: the proof's control
    counts a padding slot's)."""
    return slots.real_rows(stats)


def slot_valid(slots: Slots) -> np.ndarray:
    """[pp, per]: the slots each stage runs as layers (a hook: the proof's control makes every slot a
    layer, the classic bug of a padding slot that is not the identity)."""
    return slots.valid()


def slot_balance(balance, slots: Slots | None):
    """A selection-bias update (``routers.balance_update``: params, statistics [layers, ...]) on the
    padded parameters: the statistics padded with zero rows, which move no bias (sign(0) = 0)."""
    if balance is None or slots is None:
        return balance
    return partial(_balance, balance, slots)


def _balance(balance, slots: Slots, params, stats):
    return balance(params, slots.pad_rows(stats))
