"""Expert parallelism: the experts split over the ``ep`` axis, tokens sent to their experts' shard.

ep borrows devices from the data axis (``Layout.ep``): each of the ep shards of a group holds its own
batch rows and E / ep of the E experts (shard s: global experts s x E/ep ... (s + 1) x E/ep - 1), and
everything else (attention, the router, dense weights) as a data shard does. A MoE layer routes its
own tokens (``x`` [N, D] per shard, ``ids`` [N, k] GLOBAL expert ids), then calls
``Parallel.experts``; with ep on that is ``dispatch`` below, inside ``shard_map(check_vma=True)``:

1. send buffer [ep, E/ep, N, D] (per shard): slot (s, e, n) holds token n if it chose expert
   s x E/ep + e, else zeros. A token chooses an expert at most once, so each (expert, token) slot is
   written at most once: no capacity, nothing dropped (dropless), and the buffer's size is fixed.
   XLA:CPU has no ``ragged_all_to_all`` (JAX issue 34755), so the worst case is what travels:
   E x N x D values per shard and direction, whatever the routing.
2. ``all_to_all`` over EP: shard s receives [ep (source), E/ep, N, D], every source's tokens for its
   own experts; its experts run on [E/ep, ep x N, D] (capacity ep x N: all tokens of the group).
3. the outputs go back by the reverse ``all_to_all``: [E, N, D] per shard, each expert's output for
   each of this shard's tokens in the tokens' own order; the combine is the weighted sum over the k
   choices, as the all-local default's.

Gradients need nothing by hand: the transpose of an ``all_to_all`` is the reverse ``all_to_all``, so an
expert's gradient collects every ep shard's tokens; the expert weights are cast varying over the data
shards outside ep (``sharding.spmd``) whose transpose sums them there. Controls override ``ep_send``.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from meshlm.parallel.axes import EP


def chosen(ids, n_experts: int):
    """[E, N] bool: token n chose expert e (one of its k GLOBAL ``ids`` [N, k])."""
    return jnp.any(ids[None, :, :] == jnp.arange(n_experts, dtype=ids.dtype)[:, None, None], axis=-1)


def combine(y, ids, weights):
    """[N, D]: sum over j of weights[n, j] x y[ids[n, j], n] (``y`` [E, N, D]: every expert's output
    for every token; ``ids``, ``weights`` [N, k])."""
    picked = y[ids, jnp.arange(ids.shape[0])[:, None]]  # [N, k, D]
    return jnp.sum(weights[..., None].astype(y.dtype) * picked, axis=1)


def dispatch(par, x, ids, weights, expert_fn, n_experts: int):
    """[N, D] (partial over mp, as ``expert_fn``'s outputs): this shard's tokens through their k
    experts, the experts spread over ``par.layout.ep`` shards (module docstring)."""
    ep = par.layout.ep
    here = n_experts // ep  # this shard's experts (the leading dim of its expert weights)
    n, d = x.shape
    mask = chosen(ids, n_experts)[..., None]  # [E, N, 1]
    send = jnp.where(mask, x[None], jnp.zeros((), x.dtype)).reshape(ep, here, n, d)
    recv = par.ep_send(send)  # [ep source, E/ep, N, D]: every shard's tokens for these experts
    xs = recv.transpose(1, 0, 2, 3).reshape(here, ep * n, d)
    ys = expert_fn(xs).reshape(here, ep, n, -1).transpose(1, 0, 2, 3)  # [ep source, E/ep, N, D]
    back = par.ep_return(ys)  # [ep owner, E/ep, N, D]: every expert's output for this shard's tokens
    return combine(back.reshape(n_experts, n, -1), ids, weights)


class ExpertAxis:
    """``Parallel``'s expert-parallel part (a mixin before the all-local ``ExpertParallel``): with ep
    on, ``experts`` dispatches over the EP axis; collectives and indices controls override."""

    sharded: bool

    @property
    def expert_parallel(self) -> bool:
        return self.sharded and self.layout.experts_split

    def local_experts(self, n_experts: int) -> int:
        """The experts this shard holds (the leading dim of its expert weights): E / ep with ep on."""
        if not self.expert_parallel:
            return super().local_experts(n_experts)
        return n_experts // self.layout.ep

    def experts(self, x, ids, weights, expert_fn):
        """[N, D] partial over mp: with ep on, ``dispatch`` (``expert_fn.n_local``: E / ep)."""
        if not self.expert_parallel:
            return super().experts(x, ids, weights, expert_fn)
        return dispatch(self, x, ids, weights, expert_fn, expert_fn.n_local * self.layout.ep)

    def ep_index(self):
        """This shard's position on the expert axis (which E / ep experts it holds)."""
        return lax.axis_index(EP)

    def ep_send(self, buf):
        """[ep destination, ...] -> [ep source, ...]: slice s to ep shard s (an all-to-all)."""
        return lax.all_to_all(buf, EP, 0, 0, tiled=True)

    def ep_return(self, buf):
        """The way back: [ep source, ...] -> [ep owner, ...] (an all-to-all)."""
        return lax.all_to_all(buf, EP, 0, 0, tiled=True)
