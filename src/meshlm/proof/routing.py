"""Routing flips: the tokens whose top-k experts differ between the sharded and the unsharded run.

A mixture of experts' top-k is a discontinuous function of the router logits. In float32 the two runs'
logits differ by rounding (other summation orders), so a token whose k-th and (k+1)-th experts nearly
tie can be sent to another expert in one run: its output then differs by O(1), not by rounding, and a
tolerance would either fail for no stated reason or, loose enough, absorb it. So the proof reads each
run's routing decisions and counts the differing ones before any tolerance speaks.

How: a probe forward of the same model (not the training step: its program is unchanged) with a
Haiku method interceptor on ``model.moe.MoE``: the layer runs as always, and its per-layer output (the
routing statistics) is replaced by this layer's routing -- the sorted top-k expert ids [B, T, k] and the
top-k margin [B, T] (the k-th minus the (k+1)-th router probability) -- recomputed from the layer's own
input and router weight with ``moe.route`` (the rule the layer uses). They leave the layer stack as
the statistics do (``model.stack``). The sharded probe runs inside ``shard_map`` on the proof's layout
and parameters, the reference probe on one device with the reference's config and parameters.

The decision (``routing_row``): 0 flips, the values decide at the usual tolerance. Any flip is a failing
row "N of M token-choices routed differently" -- in float64 always (the layouts must route identically:
a flip is a bug); in float32 unless ``allow_flips`` (``--allow-routing-flips``), which passes the row
(still stating N) but never loosens the tolerance: the values must agree as before. No flip is ever
excluded or absorbed.
"""

from __future__ import annotations

from functools import partial

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from meshlm.model import moe
from meshlm.model.routers import Router
from meshlm.parallel.context import Parallel
from meshlm.parallel.cp import held_positions
from meshlm.parallel.placement import batch_spec, to_host
from meshlm.proof.report import check_row
from meshlm.sharding.strategy import strategy

ROW = "routing flips"


def _intercept(par: Parallel):
    """A Haiku method interceptor: ``MoE.__call__`` returns (its output, its routing) instead of (its
    output, its statistics). Per shard, of the column-parallel view (``par.f``: under sp the sequence
    slices gathered): [B, T, k + 1], the sorted top-k ids (exact as floats) then the top-k margin."""

    def intercept(next_f, args, kwargs, context):
        if not (isinstance(context.module, moe.MoE) and context.method_name == "__call__"):
            return next_f(*args, **kwargs)
        seen = {}  # the layer's router weight as the layer reads it (a getter records it)
        with hk.custom_getter(partial(_record_router, seen)):
            out, _ = next_f(*args, **kwargs)
        cfg = context.module.cfg
        xr = args[1] if len(args) > 1 else kwargs.get("router_in")  # the router's input: by default xn
        xr = args[0] if xr is None else xr
        k, e, d = cfg.experts_per_token, cfg.n_experts, xr.shape[-1]
        full = {"w": (d, e), "scale": (d,)}  # the others [E]
        named = {n: par.param(v, full.get(n, (e,)), norm=False) for n, v in seen.items()}  # FSDP: gathered
        logits, bias, scale = moe.router_logits(cfg, xr, named)
        probs, _, ids = moe.route(logits, k, Router.of(cfg), bias, scale=scale)
        top = jnp.sort(probs, axis=-1)  # ascending
        margin = top[..., e - k] - (top[..., e - k - 1] if e > k else 0.0)
        # one array, as the statistics are (a stack that joins runs of layers concatenates them)
        return out, par.f(jnp.concatenate([jnp.sort(ids, axis=-1).astype(top.dtype), margin[..., None]], -1))

    return intercept


def _record_router(seen: dict, next_getter, value, context):
    value = next_getter(value)
    head, _, name = context.full_name.rpartition("/")
    if head.endswith(moe.ROUTER.rpartition("/")[0]):  # moe/router: w, and b or the selection bias
        seen[name] = value
    return value


def _probe(cfg, par: Parallel):
    """A Haiku function: batch -> routing [L, B, T', k + 1] of this shard's tokens (``_intercept``)."""
    from meshlm.model.transformer import local_logits_stats

    def probe(batch):
        with hk.intercept_methods(_intercept(par)):
            return local_logits_stats(cfg, par, par.seq_local(batch["inputs"]))[2]

    return probe


def sharded_routing(runs) -> tuple[np.ndarray, np.ndarray]:
    """The sharded run's routing on the proof's batch and parameters: (ids [L, B, T, k], margins
    [L, B, T]), host arrays; with cp the sequence in the cp shards' chunk order
    (``parallel.cp.held_positions``)."""
    layout = runs.layout
    apply = hk.without_apply_rng(hk.transform(_probe(runs.problem.cfg, Parallel.on(layout)))).apply
    # every mp shard holds the whole routing (``par.f``'s view), typed varying over mp: each returns its
    # copy on a leading mp dim (type-checked, ``check_vma``), and the host keeps the first
    copies = lambda params, batch: apply(params, batch)[None]
    out = layout.spec("model", None, "batch", "length", None)  # [mp, L, B, T, k + 1]
    fn = jax.shard_map(copies, mesh=layout.mesh, in_specs=(runs.specs, batch_spec(layout)), out_specs=out)
    return _unpack(np.asarray(to_host(jax.jit(fn)(runs.params, runs.batch)))[0])


def reference_routing(runs, reference_cfg) -> tuple[np.ndarray, np.ndarray]:
    """The reference run's routing (its config: ``reference_cfg``) on one device, in the sharded
    output's token order."""
    apply = hk.without_apply_rng(hk.transform(_probe(reference_cfg, Parallel()))).apply
    batch = jax.device_put(runs.problem.batch, runs.device)
    routing = np.asarray(jax.jit(apply)(runs.ref_params, batch))
    return _unpack(routing[:, :, held_positions(routing.shape[2], runs.layout.cp)])


def _unpack(routing: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[L, B, T, k + 1] -> (ids [L, B, T, k] int, margins [L, B, T])."""
    return routing[..., :-1].astype(np.int64), routing[..., -1]


def count_flips(sharded, reference) -> tuple[int, int, float]:
    """(token-choices routed differently, token-choices, smallest top-k margin of either run): a
    token-choice is one token's top-k set in one MoE layer."""
    (ids_s, m_s), (ids_r, m_r) = sharded, reference
    differ = np.any(ids_s != ids_r, axis=-1)  # [L, B, T]: the sorted sets differ
    return int(differ.sum()), int(differ.size), float(min(m_s.min(), m_r.min()))


def routing_row(flips: int, total: int, margin: float, dtype: str, allow_flips: bool) -> dict:
    """The check row that decides on flips (the module docstring's rule)."""
    said = f"{flips} of {total} token-choices routed differently (smallest top-k margin {margin:.3g})"
    if flips == 0:
        return check_row(ROW, True, said + "; the values decide at the tolerance")
    if dtype == "float64":
        return check_row(ROW, False, said + ": in float64 the layouts must route identically (a bug)")
    if allow_flips:
        return check_row(ROW, True, said + ": allowed (--allow-routing-flips); the tolerance is unchanged")
    why = "near-ties; their outputs differ by O(1), not by rounding: FAIL (--allow-routing-flips to accept)"
    return check_row(ROW, False, f"{said}: {why}")


def routing_rows(runs, dtype: str, allow_flips: bool) -> list[dict]:
    """The routing-flips row of a mixture of experts' proof (none for a dense model). Under pp the
    stages run the model's pieces, not this probe: the row says the flips are not counted."""
    p = runs.problem
    if p.cfg is None or not p.cfg.arch.moe:
        return []
    if not strategy(runs.layout).probes_routing:
        return [check_row(ROW, True, "not counted under pp (the probe runs the unpipelined model)")]
    flips = count_flips(sharded_routing(runs), reference_routing(runs, p.reference_cfg or p.cfg))
    return [routing_row(*flips, dtype, allow_flips)]
