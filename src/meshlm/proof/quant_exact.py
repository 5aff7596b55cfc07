"""``--quant int8``'s bit-for-bit check: an int8 MLP block sharded equals it unsharded, exactly.

The whole-model comparison (``prover``) holds the int8 step to the float tolerance, as every step: its
inputs differ in rounding (attention's sums, the float all-reduces) and a value on a rounding boundary
may quantize one quantum apart (docs/quantization.md bounds it). Given the *same* inputs the int8 matmuls
are exact -- maxes round nothing, the int32 sums are exact in any order -- so this check feeds one block
the same inputs sharded and unsharded and requires bitwise equality where the design makes it exact:

    x [B, T, D] -> f -> int8 col matmul (w_in [D, F]) -> gelu -> int8 row matmul (w_out [F, D]) -> row_out

* the output y and the input gradient dx: bit for bit (the row-parallel int32 partial sums all-reduced
  as integers, the scales exact ``pmax``; dx's sum over mp likewise);
* the weight gradients: bit for bit with one batch shard; with several, their sum over the batch shards is
  the float gradient all-reduce, held to its rounding bound: |s - r| <= (n + 1) eps B, where n is the
  number of batch shards and B = (|x| + sx/2)^T (|g| + sg/2) bounds the sum of the shards' magnitudes.

A planted fault that keeps values within the float tolerance (an int32 partial sum rescaled before the
all-reduce) fails here: ``proof.quant_controls``.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshlm.model.quant import amax, int8_dense, step
from meshlm.parallel.context import Parallel
from meshlm.parallel.layout import Layout
from meshlm.proof.quant_experts_exact import expert_rows
from meshlm.proof.report import check_row

D_MODEL = 16  # small: the check is about exactness, not size (the quick tier runs it)


def block(par: Parallel, x, w_in, w_out):
    """x [B, T, D] (per shard; T/mp under sp) -> the int8 MLP block's output, as ``layers.MLP``."""
    h = jax.nn.gelu(int8_dense(par, "col", par.f(x), w_in))  # [B, T, F/mp]
    return par.row_out(int8_dense(par, "row", h, w_out))


def _outputs(par: Parallel, axes: tuple, x, w_in, w_out, ct):
    """(y, dx, dw_in, dw_out) of ``block``; the weights cast to varying over the batch axes at entry
    (as the model's parameters are), so that their gradient's transpose sums over the batch shards."""

    def entry(x, w_in, w_out):
        if par.sharded and axes:
            w_in, w_out = (lax.pcast(w, axes, to="varying") for w in (w_in, w_out))
        return block(par, x, w_in, w_out)

    y, vjp = jax.vjp(entry, x, w_in, w_out)
    return (y, *vjp(ct))


def inputs(layout: Layout, dtype, seed: int):
    """Host arrays x [B, T, D], w_in [D, F], w_out [F, D], ct [B, T, D]: B two rows per batch shard, T
    split by cp and (sp) mp; some tokens scaled x16 so the per-token scales differ."""
    b, t, f = 2 * layout.dp, 4 * layout.mp * max(layout.cp, 1), 8 * layout.mp
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, t, D_MODEL)) * np.where(rng.random((b, t, 1)) < 0.25, 16.0, 1.0)
    w_in = rng.standard_normal((D_MODEL, f)) / 4
    w_out = rng.standard_normal((f, D_MODEL)) / 4
    ct = rng.standard_normal((b, t, D_MODEL))
    return [jnp.asarray(a, dtype) for a in (x, w_in, w_out, ct)]


def run_block(layout: Layout, dtype, seed: int, par_cls=Parallel, plant=nullcontext):
    """((y, dx, dw_in, dw_out) sharded, the same unsharded), as host arrays; ``plant`` applies while the
    sharded program traces (a control's fault)."""
    args = inputs(layout, dtype, seed)
    act = layout.activation_spec()  # x, dx, y, ct: [B, T, D]
    specs = (act, layout.spec(None, "mlp"), layout.spec("mlp", None))  # w_in [D, F], w_out [F, D]
    fn = partial(_outputs, par_cls.on(layout), tuple(layout.batch_axes))
    sharded = jax.shard_map(fn, mesh=layout.mesh, in_specs=(*specs, act), out_specs=(act, *specs))
    with plant():
        got = jax.jit(sharded)(*args)
    want = jax.jit(partial(_outputs, Parallel(), ()))(*args)
    return [np.asarray(a) for a in got], [np.asarray(a) for a in want], args


def int8_rows(
    layout: Layout, dtype, seed: int = 0, par_cls=Parallel, plant=nullcontext, moe_dispatch: str | None = None
) -> list[dict]:
    """The check rows (``prover``): forward and input gradient bit for bit, weight gradients bit for bit
    or within the batch sum's rounding bound; with ``moe_dispatch`` (a mixture of experts' dispatch)
    the int8 experts' rows too (``proof.quant_experts_exact``)."""
    rows = _block_rows(layout, dtype, seed, par_cls, plant)
    if moe_dispatch is not None:
        rows += expert_rows(layout, dtype, moe_dispatch, seed, par_cls, plant)
    return rows


def int8_experts(cfg) -> str | None:
    """``int8_rows``' ``moe_dispatch`` for model ``cfg``: its dispatch with experts, else None."""
    return cfg.moe_dispatch if cfg.arch.moe else None


def _block_rows(layout: Layout, dtype, seed: int, par_cls, plant) -> list[dict]:
    got, want, (x, w_in, w_out, ct) = run_block(layout, dtype, seed, par_cls, plant)
    rows = []
    for name, i in (("output", 0), ("input gradient", 1)):
        same = np.array_equal(got[i], want[i])
        detail = "bit for bit" if same else f"{int(np.sum(got[i] != want[i]))} of {got[i].size} values differ"
        rows.append(check_row(f"int8 block {name} (sharded vs unsharded)", same, detail))
    shards = layout.dp * max(layout.cp, 1)
    bounds = _weight_bounds(x, w_in, w_out, ct) if shards > 1 else (None, None)
    for name, i, bound in (("w_in", 2, bounds[0]), ("w_out", 3, bounds[1])):
        diff = np.abs(got[i].astype(np.float64) - want[i])
        if bound is None:
            ok, detail = np.array_equal(got[i], want[i]), "bit for bit (one batch shard)"
            detail = detail if ok else f"{int(np.sum(diff > 0))} of {diff.size} values differ (want bitwise)"
        else:
            limit = (shards + 1) * np.finfo(got[i].dtype).eps * bound
            ok = bool(np.all(diff <= limit))
            detail = (
                f"max |s - r| {diff.max():.2e}, bound (n + 1) eps B {limit.max():.2e} over {shards} shards"
            )
        rows.append(check_row(f"int8 block gradient {name}", ok, detail))
    return rows


def _weight_bounds(x, w_in, w_out, ct):
    """B for each weight gradient: (|a| + sa/2)^T (|g| + sg/2) over the tokens, the bound of the shards'
    summed magnitudes (float64, from the reference's own forward and backward)."""
    with jax.enable_x64(True):
        par = Parallel()
        x64, wi, wo, g = (jnp.asarray(np.asarray(a), jnp.float64) for a in (x, w_in, w_out, ct))
        xf = x64.reshape(-1, x64.shape[-1])
        pre = xf @ wi
        h = jax.nn.gelu(pre)
        g2 = g.reshape(-1, g.shape[-1])
        gh = (g2 @ wo.T) * jax.grad(lambda p: jax.nn.gelu(p).sum())(pre)

        def bound(a, b):
            sa, sb = step(par.token_max(amax(a, 0))), step(par.token_max(amax(b, 0)))
            return np.asarray((jnp.abs(a) + sa / 2).T @ (jnp.abs(b) + sb / 2))

        return bound(xf, gh), bound(h, g2)
