"""1F1B's stash: the residuals of each in-flight micro-batch's chunk forward, kept until its backward.

A forward slot runs its chunk under ``jax.vjp``; the VJP it returns is a pytree whose leaves are the
residuals the backward needs (what the stage's remat policy saves: with ``--remat none`` every
intermediate but all-gather results, with ``full`` each layer's input, with ``selective`` the matmul
outputs). The backward slot of the same micro-batch rebuilds that VJP from the kept leaves and runs it:
no forward runs twice beyond what the policy recomputes.

Residuals that depend on the parameters alone are not kept per micro-batch: those that *are* the chunk's
parameters (a weight JAX forwards unchanged) are taken from the parameters again, and those computed from
them only (a weight reshaped or cast by the layer) are recomputed from the parameters in the backward (the
forward's jaxpr cut down to them: no activation work). Every other leaf is kept in a ring buffer
``[slots, *leaf]`` per device, indexed by the micro-batch's forward slot counter (per shard: each leaf has
the shape the stage computes it with inside ``shard_map``).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax._src.interpreters.partial_eval import dce_jaxpr  # no public equivalent in JAX 0.10
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun

from meshlm.errors import ConfigError

KEPT, PARAM, DERIVED = "kept", "param", "derived"  # where a residual leaf comes from in the backward


@dataclass(frozen=True)
class Residuals:
    """The structure of one chunk forward's VJP, traced once (abstractly) before the schedule runs."""

    treedef: object  # the VJP's pytree structure (its function and static data)
    source: tuple  # per leaf: (PARAM, chunk parameter leaf), (DERIVED, output of derive) or (KEPT, buffer)
    kept: tuple  # avals of the leaves kept per micro-batch, in leaf order
    derive: object  # fn(*chunk parameter leaves, j) -> the DERIVED leaves (params-only part of the forward)

    def split(self, vjp) -> list:
        """The leaves of a forward slot's ``vjp`` to keep per micro-batch."""
        leaves = jax.tree.leaves(vjp)
        if len(leaves) != len(self.source):
            raise ConfigError(
                f"the chunk's VJP has {len(leaves)} residuals in the schedule but {len(self.source)} when "
                "traced alone; make stage_fn's structure independent of its input values"
            )
        return [a for a, (kind, _) in zip(leaves, self.source, strict=True) if kind == KEPT]

    def rebuild(self, params, j, chunk, kept):
        """The VJP of virtual stage ``j``'s chunk (``chunk``: its parameters) from a micro-batch's kept
        leaves, the parameters and what is derived from them alone."""
        derived = self.derive(*jax.tree.leaves(params), jnp.asarray(j, jnp.int32))  # traced with an int32 j
        found = {KEPT: kept, PARAM: jax.tree.leaves(chunk), DERIVED: derived}
        return jax.tree.unflatten(self.treedef, [found[kind][i] for kind, i in self.source])

    def empty(self, slots: int, fill: float, vary) -> list:
        """Ring buffers [slots, *leaf] of ``fill`` (zeros for integer leaves), typed by ``vary``."""

        def one(s):
            value = fill if jnp.issubdtype(s.dtype, jnp.inexact) else 0
            return vary(jnp.full((slots, *s.shape), value, s.dtype), s)

        return [one(s) for s in self.kept]

    def kept_bytes(self) -> int:
        """Bytes kept per micro-batch per device (per shard)."""
        return sum(s.size * s.dtype.itemsize for s in self.kept)


def residuals(stage_fn, chunk_of, params, inp, aux=()) -> Residuals:
    """Trace ``jax.vjp(stage_fn(., ., aux), chunk_of(params, j), inp)`` (``j``: an int32 virtual stage;
    ``aux``: a micro-batch's rows the stage reads, not differentiated, e.g. document starts) and sort its
    leaves: the chunk's parameters (by identity: JAX forwards an input used as a residual unchanged),
    leaves computed from the parameters alone (their jaxpr uses neither ``inp`` nor ``aux``) and the
    rest, kept per micro-batch."""
    found = {}

    def trace(params, inp, aux, j):
        chunk = chunk_of(params, j)
        _, vjp = jax.vjp(lambda p, x: stage_fn(p, x, aux), chunk, inp)
        leaves, found["treedef"] = jax.tree.flatten(vjp)
        index = {id(a): i for i, a in enumerate(jax.tree.leaves(chunk))}
        found["param"] = [index.get(id(a)) for a in leaves]
        return [a for a, i in zip(leaves, found["param"], strict=True) if i is None]

    closed = jax.make_jaxpr(trace)(params, inp, aux, jnp.zeros((), jnp.int32))
    n_params = len(jax.tree.leaves(params))  # the jaxpr's inputs: params' leaves, inp, aux's leaves, j
    inputs = range(n_params, n_params + 1 + len(jax.tree.leaves(aux)))
    derived = [not _uses(closed.jaxpr, i, inputs) for i in range(len(closed.out_avals))]
    source, counts, out = [], {KEPT: 0, DERIVED: 0}, iter(derived)
    for i in found["param"]:
        if i is not None:
            source.append((PARAM, i))
            continue
        kind = DERIVED if next(out) else KEPT
        source.append((kind, counts[kind]))
        counts[kind] += 1
    kept = tuple(a for a, d in zip(closed.out_avals, derived, strict=True) if not d)
    return Residuals(found["treedef"], tuple(source), kept, _derive(closed, derived, n_params, len(inputs)))


def _uses(jaxpr, output: int, inputs) -> bool:
    """Whether the jaxpr's ``output`` depends on any of its inputs numbered ``inputs``."""
    _, used = dce_jaxpr(jaxpr, [k == output for k in range(len(jaxpr.outvars))])
    return any(used[i] for i in inputs)


def _derive(closed, derived, n_params, n_inputs):
    """fn(*param leaves, j) -> the outputs marked ``derived``: the forward cut down to them (no use of
    the ``n_inputs`` activation inputs, which are dropped from its arguments)."""
    jaxpr, used = dce_jaxpr(closed.jaxpr, derived)
    fn = jaxpr_as_fun(ClosedJaxpr(jaxpr, closed.consts))

    def derive(*args):
        full = (*args[:n_params], *([None] * n_inputs), *args[n_params:])
        return fn(*(a for a, u in zip(full, used, strict=True) if u))

    return derive
