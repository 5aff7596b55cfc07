"""The layer loop: a scan over stacked layers, or, where ``MESHLM_LAYER_LOOP=python`` asks for it and
every layer is unrolled, a Python loop over them.

A scan's backward keeps each layer's residuals as the scan's stacked outputs, [L, ...] arrays written
slice by slice, even fully unrolled (``ModelConfig.unroll`` 0); a Python loop keeps them per layer, as
hand-written JAX does. On a TPU v5e chip (docs/benchmarks.md, "On a TPU chip"), both with
``memory.remat_body``'s fix and measured side by side with plain JAX, the fully unrolled scan was the
faster: float32 1.017x plain against the loop's 1.050x, bf16 0.878x against 0.917x, the same memory
(issue 56, 6 December 2026). So the scan is the form everywhere, as on CPU, where every proof,
tolerance and CPU figure was measured on it (the loop also traces each layer apart: ~10% more CPU time
in a float64 proof; and XLA:CPU's other fusions moved Gemma 4's float32 logits from 6.6e-6 to 2.1e-5 of
transformers'). ``MESHLM_LAYER_LOOP`` (``python`` or ``scan``) picks a form, to measure one against the
other. Same parameters either way (created by Haiku's own layer stack) and the same values
(tests/test_layer_loop.py proves the two forms equal in float64 on every stack path).

Generation's stacked KV cache [L, ...] rides in the carry, not in ``xs`` and the stacked outputs
(``kv_kinds.carried_stack``): as a per-layer input and output either form sliced it apart and
stacked it again, copies of the whole cache every decode step; in the carry each layer writes only its
new tokens into the one (donated) buffer (``attention.cache_write``;
tests/test_layer_loop.py::test_a_decode_step_writes_the_stacked_cache_in_place).
"""

from __future__ import annotations

import os

import haiku as hk
import jax
import jax.numpy as jnp
from haiku._src import layer_stack as hk_layer_stack  # its per-layer-input wrappers (init, naming)
from jax import lax

from meshlm.errors import ConfigError

ENV = "MESHLM_LAYER_LOOP"  # "python" | "scan": the straight-line stack's form
FORMS = ("python", "scan")


def straight_line_form() -> str:
    """How a stack unrolled whole runs: "scan" (fully unrolled: the form measured faster on a TPU, and
    CPU's), or as ``MESHLM_LAYER_LOOP`` says ("python": a loop over the layers)."""
    form = os.environ.get(ENV, "")
    if form and form not in FORMS:
        raise ConfigError(
            f"{ENV}={form!r} is not a layer-loop form; use one of {', '.join(FORMS)} (or unset it)"
        )
    return form or "scan"


def layer_loop(step, carry, xs, unroll: int, length: int | None = None):
    """``lax.scan(step, carry, xs, length=length, unroll=unroll)``; with ``unroll`` >= the length (that
    of ``xs``'s leading axis unless given) and ``straight_line_form`` "python", a Python loop over it,
    the stacked outputs joined at the end."""
    if length is None:
        length = jax.tree.leaves(xs)[0].shape[0]
    if unroll < length or straight_line_form() == "scan":
        return lax.scan(step, carry, xs, length=length, unroll=unroll)
    ys = []
    for i in range(length):
        carry, y = step(carry, jax.tree.map(lambda a, i=i: a[i], xs))
        ys.append(y)
    return carry, jax.tree.map(lambda *parts: jnp.stack(parts), *ys)


class _Looped:
    """Haiku's ``_LayerStack.__call__`` (dm-haiku 0.0.17) with its apply-time scan made ``layer_loop``:
    the init (one scan, each layer initialised on the previous one's output with its own key), the
    lifted parameters' names and the per-layer keys are Haiku's own."""

    def __call__(self, x, *args_ys):
        count = self._count
        init_fn, apply_fn = hk.transform_with_state(self._call_wrapped)

        def per_layer_init_fn(c, a):
            c, rng = c
            rng, next_rng, apply_rng = jax.random.split(rng, 3) if rng is not None else (None,) * 3
            params, state = init_fn(rng, c, *a)
            (c, _), state = apply_fn(params, state, apply_rng, c, *a)
            return (c, next_rng), (params, state)

        def scanned_init_fn(x, rng):
            return lax.scan(per_layer_init_fn, (x, rng), args_ys, length=count)[1]

        rng = hk.maybe_next_rng_key()
        params_and_state_fn, updater = hk.lift_with_state(scanned_init_fn, allow_reuse=True, name=self._name)
        params, state = params_and_state_fn(x, rng)

        def layer(x, scanned):
            params, state, rng, ys = scanned
            (out_x, z), state = apply_fn(params, state, rng, x, *ys)
            return out_x, (z, state)

        rngs = hk_layer_stack._get_rng_stack(count)
        x, (zs, states) = layer_loop(layer, x, (params, state, rngs, args_ys), self._unroll, count)
        updater.update(states)
        return x, zs


class _LoopedNoPerLayer(_Looped, hk_layer_stack._LayerStackNoPerLayer):
    pass


class _LoopedWithPerLayer(_Looped, hk_layer_stack._LayerStackWithPerLayer):
    pass


def layer_stack(count: int, *, unroll: int, name: str, with_per_layer_inputs: bool = False):
    """``hk.experimental.layer_stack(count, with_per_layer_inputs, unroll, name=name)`` whose apply is
    ``layer_loop``: f(x) -> x, or with per-layer inputs f(x, *ys) -> (x, z) applied as (x, *ys) -> (x,
    zs); parameters [count, ...] under ``name``, exactly as Haiku's."""

    def iterate(f):
        if with_per_layer_inputs:
            stack = _LoopedWithPerLayer(f, count, unroll, name=name)
            return lambda x, *ys: stack(x, *ys)
        stack = _LoopedNoPerLayer(f, count, unroll, name=name)
        return lambda x: stack((x,))[0][0]

    return iterate
