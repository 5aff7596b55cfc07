"""Sorted dispatch: each expert computes only the rows routed to it (``ExpertParallel.experts``).

A shard's N tokens make N x k choices (``ids`` [N, k]). ``plan`` sorts them by expert (stable: ties in
token order, then choice order) and gives each kept choice a row of a buffer [R, D] (R static):

* "blocks" (the default): each expert's rows padded to a multiple of ``BLOCK``; a scan over the
  R / BLOCK blocks multiplies each block by its expert's weights (``block_mlp``), blocks past the used
  ones skipped. R / BLOCK = min((M + E (BLOCK - 1)) // BLOCK, E x ceil(N / BLOCK)), M the most
  choices that can reach these experts: at most E x (BLOCK - 1) padding rows beyond the routed ones,
  whatever the routing. The weight gradient is summed per expert in the scan (a custom VJP: JAX's
  own transpose of a dynamic slice of the weights would add a whole [E, ...] array per block).
* "ragged_dot": the rows unpadded, ``jax.lax.ragged_dot`` per matmul (a real grouped kernel on GPU and
  TPU; XLA:CPU lowers it to a dense batched dot, E / k times the routed FLOPs: there it is for equality).
  (A TPU weight gradient by megablox's tgmm instead of XLA:TPU's masked dense one was measured on the
  chip no faster, 24.01 against 24.12 ms at qwen3-moe-100m, and dropped: docs/benchmarks.md.)
* "gmm": the rows of "ragged_dot", R rounded up to a multiple of the kernel's row tile, each matmul
  JAX's Pallas megablox grouped matmul (``parallel.gmm_kernel``: on a TPU compiled, elsewhere in
  interpret mode; float64 its reference path). Its groups: the E experts' rows, then one more of every
  row no expert here takes (the kernel neither reads nor computes it: zeros out).
* with a capacity C (``cap`` > 0): the fixed slots [E, cap, D] (``model.moe.capacity``'s bound),
  each expert's kept choices in its first slots, the experts' batched matmul over them.

Rows no choice fills (padding) read no token (zeros) and no choice reads them back. The output, [N, D]
partial over mp, is each token's combine-weighted sum of its rows: gathers both ways, forward and
backward (``parallel.grouped_gather``: the inverse map [N, k] from each choice to its row).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from meshlm.parallel.gmm_kernel import grouped_matmul
from meshlm.parallel.gmm_tiling import row_tile
from meshlm.parallel.grouped_gather import combine_mode, combine_rows, dispatch_rows, inverse
from meshlm.parallel.grouped_int import IntGroups, block_groups, ragged_groups
from meshlm.parallel.pipeline_ops import varying

UNPADDED = ("ragged_dot", "gmm")  # each expert's rows unpadded, one after another
BLOCK = 16  # rows per block of "blocks" (not tuned yet: smaller cuts padding, larger speeds each matmul)


class Rows(NamedTuple):
    """Where the sorted choices go: ``choice`` [R] the flat choice (n x k + j) each row holds (M = N x k
    for a padding row); ``sizes`` [E] rows per expert (with "blocks" padded to BLOCK); ``block_expert``
    [R / BLOCK] each block's expert and ``used`` the blocks holding rows ("blocks" only)."""

    choice: jax.Array
    sizes: jax.Array
    block_expert: jax.Array | None = None
    used: jax.Array | None = None


def row_bound(n: int, k: int, n_local: int, how: str, cap: int = 0, tiling=None) -> int:
    """R, the static number of rows of ``plan`` for N = ``n`` tokens (module docstring); ``tiling``:
    "gmm"'s fixed (tm, tk, tn) or None (``gmm_kernel.row_tile``)."""
    if cap:
        return n_local * cap
    most = n * min(k, n_local)  # a token chooses an expert at most once
    if how == "ragged_dot":
        return most
    if how == "gmm":
        tm = row_tile(most, n_local, tiling)
        return -(-most // tm) * tm
    blocks = min((most + n_local * (BLOCK - 1)) // BLOCK, n_local * -(-n // BLOCK))
    return blocks * BLOCK


def plan(ids, n_local: int, first, how: str, cap: int = 0, tiling=None) -> Rows:
    """ids [N, k] GLOBAL expert ids (-1: a choice the capacity dropped) -> the rows of the choices of
    experts first .. first + n_local - 1, sorted by expert (stable), per ``how``, ``cap`` (and
    "gmm"'s ``tiling``)."""
    n, k = ids.shape
    m = n * k
    local = ids.reshape(-1) - first
    e = jnp.where((ids.reshape(-1) >= 0) & (local >= 0) & (local < n_local), local, n_local)
    order = jnp.argsort(e, stable=True)  # ties (one expert) in flat order: token, then choice
    es = e[order]
    # each expert's choices from where its run starts in the sorted ids, not a scatter-add of M ones (a
    # TPU's scatters may cost by their updates, whatever their size: docs/benchmarks.md, the experts)
    counts = jnp.diff(jnp.searchsorted(es, jnp.arange(n_local + 1), side="left")).astype(jnp.int32)
    rank = jnp.arange(m) - _ext(jnp.cumsum(counts) - counts)[es]  # place among its expert's choices
    if cap:
        sizes = jnp.full(n_local, cap, jnp.int32)
    elif how in UNPADDED:
        sizes = counts
    else:
        sizes = -(-counts // BLOCK) * BLOCK
    r = row_bound(n, k, n_local, how, cap, tiling)
    row = jnp.where(es < n_local, _ext(jnp.cumsum(sizes) - sizes)[es] + rank, r)
    choice = jnp.full(r, m, jnp.int32).at[row].set(order.astype(jnp.int32), mode="drop")
    if cap or how in UNPADDED:
        return Rows(choice, sizes)
    starts = jnp.arange(r // BLOCK) * BLOCK
    block_expert = jnp.minimum(jnp.searchsorted(jnp.cumsum(sizes), starts, side="right"), n_local - 1)
    return Rows(choice, sizes, block_expert.astype(jnp.int32), jnp.sum(sizes) // BLOCK)


def _ext(a):
    """``a`` with a 0 appended: index n_local (the sentinel of a choice not here) reads 0."""
    return jnp.concatenate([a, jnp.zeros((1,), a.dtype)])


def sorted_experts(par, x, ids, weights, expert_fn, first=0, cap: int = 0):
    """[N, D] partial over mp: the combine-weighted sum of each token's routed rows, the experts
    first .. first + ``expert_fn.n_local`` - 1 only (the others' choices add nothing here). The rows
    moved by gathers both ways (``parallel.grouped_gather``), or with ``MESHLM_MOE_COMBINE=scatter`` by
    the scatter-add (``_scattered``: a measurement's baseline)."""
    n, k = ids.shape
    rows = plan(ids, expert_fn.n_local, first, expert_fn.dispatch, cap, expert_fn.tiling)
    choice = par.moe_rows(rows.choice)
    if combine_mode() == "scatter":
        return _scattered(par, x, choice, rows, weights, expert_fn, cap)
    token = choice // k  # N for a padding row: reads zeros; no choice's inverse points at it
    inv = par.moe_inverse(inverse(choice, n * k, k), choice.shape[0])  # [N, k]
    x = _varying_like(x, token)  # the dispatch's VJP returns dx typed as x (custom_vjp: no casts)
    xs = dispatch_rows(x, token, inv)
    ys = expert_rows(par, xs, rows, expert_fn, n * min(k, expert_fn.n_local), cap)
    w = _varying_like(weights.astype(ys.dtype), ys)  # [N, k]; ys, w of one type: the VJP's dys, dw are
    return combine_rows(_varying_like(ys, w), w, token, choice, inv)  # typed so, JAX's casts sum them


def _scattered(par, x, choice, rows, weights, expert_fn, cap: int):
    """``sorted_experts`` with the rows' moves JAX's own: the dispatch a gather (its transpose a
    scatter-add), the combine a scatter-add of the weighted rows into their tokens."""
    n, k = weights.shape
    choice = jnp.where(choice == n * k, par.moe_padding_choice(n * k), choice)
    token = choice // k  # N for a padding row: reads zeros, adds to nothing
    xs = jnp.take(x, token, axis=0, mode="fill", fill_value=0)
    w = jnp.take(weights.reshape(-1), choice, mode="fill", fill_value=0).astype(x.dtype)
    ys = expert_rows(par, xs, rows, expert_fn, n * min(k, expert_fn.n_local), cap)
    return jnp.zeros((n, ys.shape[-1]), ys.dtype).at[token].add(w[:, None] * ys, mode="drop")


def expert_rows(par, xs, rows: Rows, expert_fn, most: int, cap: int = 0):
    """xs [R, D] the rows of ``plan`` -> [R, D]: each row through its expert, per ``expert_fn.dispatch``
    (``most``: the choices that can reach these experts, "gmm"'s R is its multiple of the row tile)."""
    e_here = expert_fn.n_local
    if cap:
        return expert_fn(xs.reshape(e_here, cap, -1)).reshape(xs.shape[0], -1)
    if expert_fn.quant == "int8":  # int8 experts on this dispatch's integer grouped dots
        return expert_fn.rows(xs, int_groups(rows, expert_fn.dispatch, e_here, xs.shape[0]))
    if expert_fn.dispatch == "ragged_dot":
        return ragged_mlp(xs, rows.sizes, expert_fn)
    if expert_fn.dispatch == "gmm":
        tm = row_tile(most, e_here, expert_fn.tiling)  # R's multiple (``row_bound``)
        return gmm_mlp(xs, par.moe_group_sizes(rows.sizes), expert_fn, tm)
    blocks = xs.reshape(-1, BLOCK, xs.shape[-1])
    ws = tuple(_varying_like(w, xs) for w in expert_fn.weights)
    bs = tuple(_varying_like(b, xs) for b in expert_fn.biases)
    ys = block_mlp(expert_fn.hidden, par.moe_expert_grads, blocks, rows.block_expert, rows.used, ws, bs)
    return ys.reshape(xs.shape[0], -1)


def int_groups(rows: Rows, how: str, n_local: int, r: int) -> IntGroups:
    """The ``r`` rows of ``plan`` as ``--quant int8``'s experts multiply them (``parallel.grouped_int``):
    "ragged_dot"'s by ``lax.ragged_dot``, "blocks"' by the block scan. ("gmm"'s kernel multiplies
    bfloat16 and float32 only: ``model.quant_fields`` refuses it under int8.)"""
    if how == "ragged_dot":
        return ragged_groups(rows.sizes, r)
    if how == "blocks":
        return block_groups(rows.block_expert, rows.used, n_local, BLOCK)
    raise ValueError(f"int8 experts run the blocks, ragged_dot or dense dispatch, not {how!r}")


def _varying_like(w, x):
    """``w`` varying over every axis ``x`` varies over (inside ``shard_map``): the block scan's weight
    gradients then have the weights' type, and JAX's transpose of the cast sums them over the rest."""
    axes = tuple(sorted(varying(x) - varying(w)))
    return lax.pcast(w, axes, to="varying") if axes else w


def ragged_mlp(xs, sizes, expert_fn):
    """[R, D] rows grouped by expert (``sizes`` [E], rows past their sum: zeros) -> [R, D]; with expert
    biases each row's expert's added (rows past the sum take the last expert's: their weight is 0)."""
    w_gate, w_up, w_down = expert_fn.weights
    gate, up = lax.ragged_dot(xs, w_gate, sizes), lax.ragged_dot(xs, w_up, sizes)
    gate, up = _with_biases(gate, up, sizes, expert_fn)
    return lax.ragged_dot(expert_fn.hidden(gate, up), w_down, sizes)


def _with_biases(gate, up, sizes, expert_fn):
    """gate, up [R, I] with each row's expert's biases added (none: as they are); ``sizes`` [E] (rows
    past their sum take the last expert's: their combine weight is 0)."""
    if expert_fn.b_gate is None:
        return gate, up
    e = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(gate.shape[0]), side="right")
    e = jnp.minimum(e, sizes.shape[0] - 1)
    return gate + expert_fn.b_gate[e], up + expert_fn.b_up[e]


def gmm_mlp(xs, sizes, expert_fn, tm: int):
    """ "gmm"'s ``ragged_mlp``: [R, D] rows grouped by expert (``sizes`` [E]; R a multiple of the row tile
    ``tm``) -> [R, D], each matmul the megablox kernel (``gmm_kernel.grouped_matmul``) on the E experts'
    groups and one group of the rows past their sum, which no expert here takes: its rows come out
    zeros, none of them computed."""
    w_gate, w_up, w_down = expert_fn.weights
    rest = (xs.shape[0] - jnp.sum(sizes))[None].astype(jnp.int32)
    groups = jnp.concatenate([sizes.astype(jnp.int32), rest])  # [E + 1]: their cumulative sums the offsets
    mm = lambda a, w: grouped_matmul(a, w.astype(a.dtype), groups, tm, expert_fn.tiling)
    gate, up = _with_biases(mm(xs, w_gate), mm(xs, w_up), sizes, expert_fn)
    return mm(expert_fn.hidden(gate, up), w_down)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def block_mlp(hidden, hook, xs, block_expert, used, weights, biases):
    """xs [nb, BLOCK, D] -> [nb, BLOCK, D]: block i through expert ``block_expert[i]``'s gated MLP
    (``hidden`` its activation of (gate, up); ``weights`` (w_gate, w_up, w_down) [E, ...], ``biases``
    () or (b_gate, b_up) [E, I]), blocks from ``used`` on left zero. ``hook`` sees the weight gradients
    [E, ...] (``Parallel.moe_expert_grads``: where a control plants a fault)."""
    return _block_forward(hidden, xs, block_expert, used, weights, biases)[0]


def _block_forward(hidden, xs, block_expert, used, weights, biases):
    w_gate, w_up, w_down = weights

    def body(_, item):
        i, xb, e = item

        def run():
            g, u = xb @ w_gate[e], xb @ w_up[e]
            if biases:
                g, u = g + biases[0][e], u + biases[1][e]
            return hidden(g, u) @ w_down[e], g, u

        return None, lax.cond(i < used, run, lambda: _zeros_like(run()))

    _, (ys, g, u) = lax.scan(body, None, (jnp.arange(xs.shape[0]), xs, block_expert))
    return ys, (xs, block_expert, used, weights, biases, g, u)


def _zeros_like(tree):
    """Zeros of ``tree``'s shapes and varying axes (a skipped block's: XLA drops the unused matmuls)."""
    return jax.tree.map(jnp.zeros_like, tree)


def _block_fwd(hidden, hook, xs, block_expert, used, weights, biases):
    return _block_forward(hidden, xs, block_expert, used, weights, biases)


def _block_bwd(hidden, hook, res, dys):
    xs, block_expert, used, weights, biases, g, u = res
    w_gate, w_up, w_down = weights

    def body(acc, item):
        i, xb, e, gb, ub, dy = item

        def run():
            h, vjp = jax.vjp(hidden, gb, ub)
            dg, du = vjp(dy @ w_down[e].T)
            dx = dg @ w_gate[e].T + du @ w_up[e].T
            grads = (xb.T @ dg, xb.T @ du, h.T @ dy) + ((jnp.sum(dg, 0), jnp.sum(du, 0)) if biases else ())
            return tuple(a.at[e].add(d) for a, d in zip(acc, grads, strict=True)), dx

        return lax.cond(i < used, run, lambda: (acc, _zeros_like(run()[1])))

    # Measured side by side (cpu-moe's experts fwd + bwd, 512 tokens, one process, load ~14): the
    # weights and xs transposed once per layer behind a barrier (``model.dense``'s trick) made this 17%
    # slower (the [E, D, I] copies cost more than 16-row dots gain); 32- or 8-row blocks and unrolling
    # the scans 2, 4 or 8 times changed nothing beyond the noise (docs/benchmarks.md).
    zeros = tuple(jnp.zeros_like(w) for w in (*weights, *biases))  # typed like the weights (varying)
    items = (jnp.arange(xs.shape[0]), xs, block_expert, g, u, dys)
    grads, dxs = lax.scan(body, zeros, items)
    return (dxs, None, None, hook(grads[:3]), grads[3:])


block_mlp.defvjp(_block_fwd, _block_bwd)
