"""``--quant int8``'s bit-for-bit check of the experts: an int8 expert block sharded, by the model's
dispatch, equals it unsharded by the "dense" reference (every expert on every token), exactly.

    x [B, T, D] -> f -> par.experts (int8 gated MLPs: w_gate, w_up [E, D, I], w_down [E, I, D]) -> row_out

fed the same inputs sharded and unsharded. Each token chooses one expert (k = 1): the combine is then
one product per token in every dispatch (the reference's sum over E adds exact zeros), so the block's
output and input gradient are a function of the int8 matmuls' values alone, and must be **bitwise
equal** -- the per-row scales (an exact ``pmax`` where mp splits I), the int32 sums (all-reduced over mp
as integers), each expert's scales (exact ``pmax``es over the data shards holding its rows) and the rows
a dispatch pads with (zeros, no gradient) leave nothing to rounding. The expert weights' gradients:
bit for bit where each expert's rows lie on one shard (ep alone, no data shards outside it, no cp);
else their sum over those shards is the float gradient all-reduce, held to its rounding bound (n + 1)
eps B (``proof.quant_exact``'s, per expert).
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshlm.model.moe import Experts
from meshlm.model.quant import QMAX
from meshlm.parallel.axes import EP
from meshlm.parallel.context import Parallel
from meshlm.parallel.layout import Layout
from meshlm.proof.report import check_row

D_MODEL = 16
WEIGHTS = ("w_gate", "w_up", "w_down")
# The block's activation: gate x up, multiplies alone. XLA:CPU may contract a multiply and an add into one
# fused multiply-add in one program and not in another (by its fusion choices, which the shapes move),
# which moves an activation's derivative (silu's s + x s (1 - s)) by an ulp, and a per-row scale with
# it: not what this check is about (the whole-step proof holds the model's activation).


def bilinear(gate, up):
    return gate * up


def expert_axes(layout: Layout) -> tuple[str, ...]:
    """The data axes an expert's rows are split over: the batch axes less ep, whose shards hold other
    experts (``Parallel.expert_token_max``)."""
    return tuple(a for a in layout.batch_axes if not (a == EP and layout.experts_split))


def n_experts(layout: Layout) -> int:
    """4 experts, or a multiple of ep (each ep shard holds E / ep)."""
    return layout.ep * -(-4 // layout.ep)


def expert_block(par: Parallel, dispatch: str, x, ids, cw, w_gate, w_up, w_down):
    """x [B, T', D] (per shard), ids and cw [B, T', 1] -> the int8 experts' output, as ``model.moe``."""
    xf, ids, cw = par.f(x), par.f(ids), par.f(cw)  # [B, T, ...]: the column-parallel view
    b, t, d = xf.shape
    experts = Experts(w_gate, w_up, w_down, dispatch, 0, act=bilinear, quant="int8", par=par)
    out = par.experts(xf.reshape(b * t, d), ids.reshape(b * t, 1), cw.reshape(b * t, 1), experts)
    return par.row_out(out.reshape(b, t, d))


def _outputs(par: Parallel, dispatch: str, axes: tuple, x, ids, cw, w_gate, w_up, w_down, ct):
    """(y, dx, dw_gate, dw_up, dw_down); the expert weights cast varying over ``axes`` at entry (as
    the model's are: their gradient's transpose sums over those data shards)."""

    def entry(x, *ws):
        if par.sharded and axes:
            ws = [lax.pcast(w, axes, to="varying") for w in ws]
        return expert_block(par, dispatch, x, ids, cw, *ws)

    y, vjp = jax.vjp(entry, x, w_gate, w_up, w_down)
    return (y, *vjp(ct))


def inputs(layout: Layout, dtype, seed: int):
    """Host arrays x [B, T, D], ids [B, T, 1], cw [B, T, 1], w_gate, w_up [E, D, I], w_down [E, I, D],
    ct [B, T, D] (``quant_exact.inputs``' sizes; some tokens x16 so the per-row scales differ)."""
    b, t, i = 2 * layout.dp, 4 * layout.mp * max(layout.cp, 1), 8 * layout.mp
    e = n_experts(layout)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, t, D_MODEL)) * np.where(rng.random((b, t, 1)) < 0.25, 16.0, 1.0)
    ids = rng.integers(0, e, (b, t, 1)).astype(np.int32)
    cw = rng.uniform(0.5, 1.5, (b, t, 1))
    ws = [rng.standard_normal(s) / 4 for s in ((e, D_MODEL, i), (e, D_MODEL, i), (e, i, D_MODEL))]
    ct = rng.standard_normal((b, t, D_MODEL))
    return [jnp.asarray(ids)] + [jnp.asarray(a, dtype) for a in (x, cw, *ws, ct)]


def run_experts(layout: Layout, dtype, seed: int, dispatch: str, par_cls=Parallel, plant=nullcontext):
    """((y, dx, dw_gate, dw_up, dw_down) sharded by ``dispatch``, the same unsharded by "dense"), as host
    arrays, and the inputs; ``plant`` applies while the sharded program traces."""
    ids, x, cw, *ws, ct = inputs(layout, dtype, seed)
    act = layout.activation_spec()  # x, ids, cw, y, ct: [B, T, ...]
    col, row = layout.spec("experts", None, "mlp"), layout.spec("experts", "mlp", None)
    fn = partial(_outputs, par_cls.on(layout), dispatch, expert_axes(layout))
    specs = (act, act, act, col, col, row, act)
    sharded = jax.shard_map(fn, mesh=layout.mesh, in_specs=specs, out_specs=(act, act, col, col, row))
    with plant():
        got = jax.jit(sharded)(x, ids, cw, *ws, ct)
    want = jax.jit(partial(_outputs, Parallel(), "dense", ()))(x, ids, cw, *ws, ct)
    return [np.asarray(a) for a in got], [np.asarray(a) for a in want], (x, ids, cw, *ws, ct)


def expert_rows(layout: Layout, dtype, dispatch: str, seed: int = 0, par_cls=Parallel, plant=nullcontext):
    """The check rows: output and input gradient bit for bit, each expert weight's gradient bit for bit
    or within the data shards' sum's rounding bound."""
    got, want, args = run_experts(layout, dtype, seed, dispatch, par_cls, plant)
    rows = []
    for name, i in (("output", 0), ("input gradient", 1)):
        same = np.array_equal(got[i], want[i])
        detail = "bit for bit" if same else f"{int(np.sum(got[i] != want[i]))} of {got[i].size} values differ"
        rows.append(check_row(f"int8 experts {name} ({dispatch} sharded vs dense unsharded)", same, detail))
    shards = int(np.prod([layout.mesh_shape[a] for a in expert_axes(layout)]))
    bounds = _weight_bounds(*args) if shards > 1 else (None,) * 3
    for name, a, b, bound in zip(WEIGHTS, got[2:], want[2:], bounds, strict=True):
        diff = np.abs(a.astype(np.float64) - b)
        if bound is None:
            ok, detail = np.array_equal(a, b), "bit for bit (each expert's rows on one shard)"
            detail = detail if ok else f"{int(np.sum(diff > 0))} of {diff.size} values differ (want bitwise)"
        else:
            limit = (shards + 1) * np.finfo(a.dtype).eps * bound
            ok = bool(np.all(diff <= limit))
            detail = (
                f"max |s - r| {diff.max():.2e}, bound (n + 1) eps B {limit.max():.2e} over {shards} shards"
            )
        rows.append(check_row(f"int8 experts gradient {name}", ok, detail))
    return rows


def _weight_bounds(x, ids, cw, w_gate, w_up, w_down, ct):
    """B per expert weight gradient [E, K, M]: (|a| + sa/2)^T (|g| + sg/2) over the expert's rows, a and
    g the float64 block's (its bilinear-gated MLP on every token, masked to the chosen expert's rows)."""
    with jax.enable_x64(True):
        f64 = lambda a: jnp.asarray(np.asarray(a), jnp.float64)
        x2, ct2 = f64(x).reshape(-1, D_MODEL), f64(ct).reshape(-1, D_MODEL)
        wg, wu, wd = f64(w_gate), f64(w_up), f64(w_down)
        live = jax.nn.one_hot(np.asarray(ids).reshape(-1), wg.shape[0], dtype=jnp.float64).T[..., None]
        gate, up = jnp.einsum("nd,edi->eni", x2, wg), jnp.einsum("nd,edi->eni", x2, wu)
        h, vjp = jax.vjp(bilinear, gate, up)
        gd = live * f64(cw).reshape(1, -1, 1) * ct2[None]  # [E, N, D]: the down matmul's row gradients
        dg, du = vjp(jnp.einsum("end,eid->eni", gd, wd))
        xe = jnp.broadcast_to(x2, (wg.shape[0], *x2.shape))

        def bound(a, g):
            sa, sg = (jnp.max(live * jnp.abs(v), 1, keepdims=True) / QMAX for v in (a, g))
            return np.asarray(
                jnp.einsum("enk,enm->ekm", live * (jnp.abs(a) + sa / 2), live * (jnp.abs(g) + sg / 2))
            )

        return bound(xe, dg), bound(xe, du), bound(h, gd)
