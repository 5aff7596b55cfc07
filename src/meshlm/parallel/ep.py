"""Expert parallelism: the experts split over the ``ep`` axis, each ep shard brought its tokens.

ep borrows devices from the data axis (``Layout.ep``): each of the ep shards of a group holds its own
batch rows and E / ep of the E experts (shard s: global experts s x E/ep ... (s + 1) x E/ep - 1), and
everything else (attention, the router, dense weights) as a data shard does. A MoE layer routes its
own tokens (``x`` [N, D] per shard, ``ids`` [N, k] GLOBAL expert ids), then calls
``Parallel.experts``; with ep on that is ``gathered`` below (the sorted dispatches), inside
``shard_map(check_vma=True)``:

1. ``ep_gather``: all-gather over EP of the tokens, their ids and combine weights: [ep x N, ...], the
   ep group's tokens, on each of its shards. ep x N x D values: no buffer grows with E.
2. the sorted dispatch (``parallel.grouped``) of those tokens' choices of this shard's E / ep experts
   only, each expert on its routed rows; with a capacity, the slots [E / ep, min(ep x N, capacity), D].
3. ``ep_scatter``: a reduce-scatter over EP of the [ep x N, D] partial outputs (each shard's experts'
   share): every token gets the sum over the shards of its experts, in its own shard, [N, D].

Bytes per MoE layer and device (results: what ``perf.hlo`` counts): forward the all-gathers ep x N x
(D + 2k) values (tokens, weights; ids int32) and the reduce-scatter N x D; backward the all-gather of
the output's gradient ep x N x D and the reduce-scatters of the tokens' and weights' gradients N x
(D + k) (``perf.memory_collectives.ep_dispatch_bytes``). Why not all-to-alls: a sorted all-to-all
needs a static bound per destination, N x min(k, E / ep) rows, so it sends ep x min(k, E / ep) x N
x D (more than ep x N x D whenever k > 1), and XLA:CPU has no ``ragged_all_to_all`` (JAX issue 34755).

The "dense" reference (``dispatch``) sends the fixed buffer [ep, E/ep, N, D] by an all-to-all: slot
(s, e, n) holds token n if it chose expert s x E/ep + e, else zeros (E x N x D values per shard and
direction, whatever the routing); the outputs come back by the reverse all-to-all.

Gradients need nothing by hand: the transposes of all-gather and reduce-scatter (and of an all-to-all)
are each other, so an expert's gradient collects every ep shard's tokens; the expert weights are cast
varying over the data shards outside ep (``sharding.spmd``) whose transpose sums them there. Controls
override ``ep_gather``, ``ep_scatter`` or ``ep_send``.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from meshlm.parallel.axes import EP
from meshlm.parallel.grouped import sorted_experts


def shard_tie_experts(n_experts: int, ep: int) -> list[int]:
    """The experts a planted tie joins to expert 0: expert 1 (its own shard) and, with the experts split
    over ep, the first of ep shard 1 (E / ep): a tie inside a shard and one across shards."""
    return sorted({1, n_experts // ep if ep > 1 else 1})


def gathered_tokens(tokens: int, ep: int) -> int:
    """Tokens an expert shard gathers from its ep group for its dispatch (ep x N), none without ep."""
    return ep * tokens if ep > 1 else 0


def chosen(ids, n_experts: int):
    """[E, N] bool: token n chose expert e (one of its k GLOBAL ``ids`` [N, k])."""
    return jnp.any(ids[None, :, :] == jnp.arange(n_experts, dtype=ids.dtype)[:, None, None], axis=-1)


def combine(y, ids, weights):
    """[N, D]: sum over j of weights[n, j] x y[ids[n, j], n] (``y`` [E, N, D]: every expert's output
    for every token; ``ids``, ``weights`` [N, k])."""
    picked = y[ids, jnp.arange(ids.shape[0])[:, None]]  # [N, k, D]
    return jnp.sum(weights[..., None].astype(y.dtype) * picked, axis=1)


def gathered(par, x, ids, weights, expert_fn):
    """[N, D] (partial over mp, as ``expert_fn``'s outputs): the ep group's tokens gathered, this
    shard's experts on their routed rows, the outputs reduce-scattered back (module docstring)."""
    here = expert_fn.n_local
    xs, ids_all, ws = par.ep_gather(x), par.ep_gather(ids), par.ep_gather(weights)
    cap = min(xs.shape[0], expert_fn.capacity)  # no expert takes more than the group's tokens
    ys = sorted_experts(par, xs, ids_all, ws, expert_fn, first=par.ep_index() * here, cap=cap)
    return par.ep_scatter(ys)


def dispatch(par, x, ids, weights, expert_fn, n_experts: int):
    """The "dense" reference under ep, [N, D] (partial over mp, as ``expert_fn``'s outputs): this
    shard's tokens through their k experts by fixed-size all-to-alls (module docstring)."""
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
        """[N, D] partial over mp: with ep on, ``gathered`` (the "dense" reference: ``dispatch``;
        ``expert_fn.n_local``: E / ep)."""
        if not self.expert_parallel:
            return super().experts(x, ids, weights, expert_fn)
        if expert_fn.dispatch != "dense":
            return gathered(self, x, ids, weights, expert_fn)
        return dispatch(self, x, ids, weights, expert_fn, expert_fn.n_local * self.layout.ep)

    def ep_index(self):
        """This shard's position on the expert axis (which E / ep experts it holds)."""
        return lax.axis_index(EP)

    def ep_gather(self, x):
        """[N, ...] this shard's -> [ep x N, ...] the ep group's, in shard order (an all-gather)."""
        return lax.all_gather(x, EP, axis=0, tiled=True)

    def ep_scatter(self, y):
        """[ep x N, D] partial outputs -> [N, D] this shard's rows summed over EP (a reduce-scatter)."""
        return lax.psum_scatter(y, EP, scatter_dimension=0, tiled=True)

    def ep_send(self, buf):
        """[ep destination, ...] -> [ep source, ...]: slice s to ep shard s (an all-to-all)."""
        return lax.all_to_all(buf, EP, 0, 0, tiled=True)

    def ep_return(self, buf):
        """The way back: [ep source, ...] -> [ep owner, ...] (an all-to-all)."""
        return lax.all_to_all(buf, EP, 0, 0, tiled=True)
