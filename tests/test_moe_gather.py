"""The sorted dispatch's gathers (``parallel.grouped_gather``) equal the scatter-add they replaced:
value and every gradient, exactly in float64 (terms whose every sum is exact, so the order of the
sums cannot hide a difference), within a stated bound in bfloat16; a wrong inverse map is caught."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.errors import ConfigError
from meshlm.parallel.grouped import plan
from meshlm.parallel.grouped_gather import combine_mode, combine_rows, dispatch_rows, inverse

N, K, E, D = 12, 3, 8, 4  # tokens, choices per token, experts, width


def maps(how: str):
    """choice, token [R] and the inverse [N, K] of a shard holding experts 2..5 of E (half the choices
    have no row here, and one is dropped: id -1); "blocks" pads each expert's rows to 16."""
    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(N)]).astype(np.int32)
    ids[0, 0] = -1
    choice = plan(jnp.asarray(ids), 4, 2, how).choice
    return choice, choice // K, inverse(choice, N * K, K)


def scattered(x, ys, w, token, choice):
    """The old moves (``grouped._scattered``): take's transpose and the combine's scatter-add."""
    xs = jnp.take(x, token, axis=0, mode="fill", fill_value=0)
    w_rows = jnp.take(w.reshape(-1), choice, mode="fill", fill_value=0)
    return xs, jnp.zeros((N, D), ys.dtype).at[token].add(w_rows[:, None] * ys, mode="drop")


def gathered(x, ys, w, token, choice, inv):
    return dispatch_rows(x, token, inv), combine_rows(ys, w, token, choice, inv)


def both(dtype, scale, how="blocks", inv=None):
    """(value and gradients of x, ys, w) by the gathers and by the scatter-add; every value a multiple
    of 1 / ``scale`` (float64: small dyadic numbers, every product and sum exact)."""
    choice, token, right = maps(how)
    inv = right if inv is None else inv
    rng = np.random.default_rng(1)
    r = choice.shape[0]
    draw = lambda *s: jnp.asarray(np.round(rng.normal(size=s) * scale) / scale, dtype)
    x, ys, w, dxs, dout = draw(N, D), draw(r, D), draw(N, K), draw(r, D), draw(N, D)
    out = []
    for f in (lambda *a: gathered(*a, inv), scattered):
        (xs, y), vjp = jax.vjp(lambda x, ys, w, f=f: f(x, ys, w, token, choice), x, ys, w)
        out.append(((xs, y), vjp((dxs, dout))))
    return out, (ys, w, inv)


@pytest.mark.parametrize("how", ["blocks", "ragged_dot"])
def test_gathers_equal_the_scatter_add_exactly_in_float64(how):
    with jax.enable_x64(True):
        (got, want), _ = both(jnp.float64, 8.0, how)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert a.dtype == b.dtype == jnp.float64 and bool(jnp.all(a == b))


def test_gathers_in_bfloat16_within_k_roundings_of_the_scatter_add():
    """Both round each term w x ys to bfloat16; the scatter-add rounds each of its k partial sums, the
    gathers sum in float32 and round once: they differ by at most k roundings of the terms' size."""
    (got, want), (ys, w, inv) = both(jnp.bfloat16, 1e6)
    terms = jnp.take(ys.astype(jnp.float32), inv, axis=0, mode="fill", fill_value=0)
    size = jnp.sum(jnp.abs(w.astype(jnp.float32)[..., None] * terms), axis=1)  # [N, D]
    diff = jnp.abs(got[0][1].astype(jnp.float32) - want[0][1].astype(jnp.float32))
    assert bool(jnp.all(diff <= K * 2.0**-8 * size)) and bool(jnp.any(size > 0))
    assert jnp.array_equal(got[0][0], want[0][0])  # the dispatch: the same rows


def test_a_wrong_inverse_map_is_caught():
    """The control: each choice's row one further (its neighbour's output), and choices with no row
    here reading row 0 (``proof.moe_controls.AbsentChoicesReadRowZero``), move the value and dx."""
    from meshlm.proof.moe_controls import AbsentChoicesReadRowZero

    with jax.enable_x64(True):
        _, _, inv = maps("blocks")
        r = maps("blocks")[0].shape[0]
        for bad in (jnp.where(inv < r, (inv + 1) % r, inv), AbsentChoicesReadRowZero().moe_inverse(inv, r)):
            (got, want), _ = both(jnp.float64, 8.0, inv=bad)
            assert not bool(jnp.all(got[0][1] == want[0][1]))  # the combine's value
            assert not bool(jnp.all(got[1][0] == want[1][0]))  # dx: the dispatch's backward


def test_the_combine_mode_is_checked(monkeypatch):
    monkeypatch.setenv("MESHLM_MOE_COMBINE", "scatter")
    assert combine_mode() == "scatter"
    monkeypatch.setenv("MESHLM_MOE_COMBINE", "gathers")
    with pytest.raises(ConfigError, match="MESHLM_MOE_COMBINE='gathers'"):
        combine_mode()
