"""Sliding windows at long context (issue 34): the blockwise kernel with a window equals plain attention
in float64 (forward and every gradient; the window a Python int or a traced scalar), skips the K/V
blocks outside every query's window (never reads them: O(window) block pairs per query block), and both
planted off-by-ones are caught; ``--cp`` (ring and all-gather) with a window equals the unsharded model;
the rolling KV cache holds the window and its cached logits equal the full forward's."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_blockwise import TOL, inputs, positions, rel_err, value_and_grads

from meshlm.generate.cache import cache_bytes
from meshlm.generate.generator import logits_with_cache
from meshlm.model.attention import _attend
from meshlm.model.blockwise import blockwise_attention
from meshlm.model.config import get_config
from meshlm.model.transformer import logits_fn, loss_fn
from meshlm.parallel.context import Parallel
from meshlm.parallel.layout import Layout
from meshlm.perf.bench_window import block_pairs
from meshlm.proof import cp_controls
from meshlm.proof.control_record import Where
from meshlm.sharding.rules import model_specs
from meshlm.sharding.spmd import reference_value_and_grad, sharded_value_and_grad

# (B, Tq, Tk, H, K, E, block, query offset, window)
CASES = {
    "window 10, blocks of 8 (the edge at a block's end)": (2, 40, 40, 2, 2, 8, 8, 0, 10),
    "prefill: queries 24..36 on 45 keys, window 9, GQA 6:2, ragged": (2, 13, 45, 6, 2, 5, 8, 24, 9),
}


def _error(case, traced=False, plant=None):
    b, tq, tk, h, kh, e, block, offset, window = case
    with jax.enable_x64(True):
        q, k, v, ct = inputs(b, tq, tk, h, kh, e)
        qp, kp = positions(b, tq, offset), positions(b, tk)
        want = value_and_grads(lambda q, k, v: _attend(q, k, v, qp, kp, None, window), q, k, v, ct)
        w = jnp.int32(window) if traced else window
        with plant() if plant else _nothing():
            got = value_and_grads(
                lambda q, k, v: blockwise_attention(q, k, v, qp, kp, block=block, window=w), q, k, v, ct
            )
        return max(rel_err(g, x) for g, x in zip(got, want, strict=True))


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_windowed_blockwise_equals_plain(case):
    assert _error(case) <= TOL


def test_a_traced_window_is_the_same_kernel():
    """A per-layer window arrives as a traced int32 scalar (Gemma's alternating layers in one layer loop)."""
    assert _error(CASES["prefill: queries 24..36 on 45 keys, window 9, GQA 6:2, ragged"], traced=True) <= TOL


def test_blocks_outside_every_window_are_never_read():
    """NaN keys and values where no query's window reaches (keys 0..15 for queries 32..47, window 8):
    plain attention (mask after the product) turns NaN; the kernel skips those blocks, both ways."""
    with jax.enable_x64(True):
        q, k, v, ct = inputs(1, 16, 48, 2, 2, 4)
        qp, kp = positions(1, 16, 32), positions(1, 48)
        k, v = k.at[:, :16].set(jnp.nan), v.at[:, :16].set(jnp.nan)
        assert bool(jnp.any(jnp.isnan(_attend(q, k, v, qp, kp, None, 8))))
        got = value_and_grads(
            lambda q, k, v: blockwise_attention(q, k, v, qp, kp, block=8, window=8), q, k, v, ct
        )
        assert all(bool(jnp.all(jnp.isfinite(g))) for g in got)


def test_block_pairs_grow_with_the_window_not_the_context():
    """Full causal: (n^2 + n) / 2 pairs for n blocks; a window of 2 blocks: about 3 per query block."""
    assert block_pairs(4096, 512, 0) == 36 and block_pairs(16384, 512, 0) == 528
    assert block_pairs(4096, 512, 1024) == 8 + 7 + 6  # diagonal, one back, two back (the edge)
    assert block_pairs(16384, 512, 1024) == 32 + 31 + 30  # 4x the context: 4x the pairs, not 16x


@pytest.mark.parametrize(
    "plant", [cp_controls._window_wider, cp_controls._skip_narrower], ids=["kernel mask", "skip rule"]
)
def test_both_window_off_by_ones_are_caught(plant):
    name = "_visible" if plant is cp_controls._window_wider else "_needed"
    case = CASES["window 10, blocks of 8 (the edge at a block's end)"]
    assert _error(case, plant=lambda: cp_controls._planted(**{name: plant})) > 1e-3


def test_the_skip_rule_control_applies_only_where_a_block_ends_at_the_edge():
    """A window that is a multiple of the block never puts a query block's oldest visible key at a K/V
    block's end (tiny-mistral: 16 on blocks of 8); tiny-mistral-w10's 10 does, with and without cp."""
    where = lambda name, layout: Where(
        cfg=get_config(name).replace(attention="blockwise", attn_block=8),
        layout=layout,
        has_row_bias=False,
        seq_len=64,
    )
    assert not cp_controls._skip_edge_met(where("tiny-mistral", Layout(mp=2)))
    for layout in (Layout(), Layout(cp=2), Layout(cp=2, cp_strategy="allgather")):
        assert cp_controls._skip_edge_met(where("tiny-mistral-w10", layout))


@pytest.fixture(scope="module")
def windowed():
    """tiny-gqa, one layer, window 5 on 2 x 16 tokens in float64; its reference loss and gradients."""
    cfg = get_config("tiny-gqa").replace(vocab_multiple=1, attn_block=4, n_layers=1, sliding_window=5)
    with jax.enable_x64(True):
        r = np.random.default_rng(0)
        batch = {k: jnp.asarray(r.integers(0, 64, (2, 16)), jnp.int32) for k in ("inputs", "targets")}
        params = jax.jit(hk.transform(loss_fn(cfg, Parallel())).init)(jax.random.PRNGKey(0), batch)
        params = jax.tree.map(lambda p: p.astype(jnp.float64), params)
        want = jax.jit(reference_value_and_grad(lambda par: loss_fn(cfg, par)))(params, batch)
    return cfg, batch, params, want


def test_cp_with_a_window_equals_the_unsharded_model(windowed):
    """The ring (its steps through the windowed kernel; the all-gather passes the window to the same
    kernel or to plain attention: ``meshlm verify --cp-strategy allgather``, docs/proof.md)."""
    cfg, batch, params, want = windowed
    cfg, layout = cfg.replace(attention="blockwise"), Layout(cp=2, cp_strategy="ring")
    with jax.enable_x64(True):
        fn = sharded_value_and_grad(lambda par: loss_fn(cfg, par), layout, model_specs(cfg, params, layout))
        got = jax.jit(fn)(params, batch)
        err = lambda a, b: float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
        assert max(jax.tree.leaves(jax.tree.map(err, got, want))) <= TOL


@pytest.mark.parametrize("attention", ["blockwise"])
def test_rolling_cache_holds_the_window_and_equals_the_full_forward(attention):
    """Window 4, a 32-slot context: the decode cache has 4 slots per layer; teacher-forced cached logits
    from prompts of 3 and 11 tokens up to position 19 (several windows on) equal the full forward's."""
    from meshlm.generate.generator import Generator, cache_memory
    from meshlm.generate.inputs import Sampling
    from meshlm.parallel.mesh import make_mesh

    cfg = get_config("tiny-mistral").replace(sliding_window=4, attention=attention, attn_block=4)
    tokens = np.random.default_rng(1).integers(1, 64, (2, 20))
    params = jax.jit(hk.transform(loss_fn(cfg, Parallel())).init)(
        jax.random.PRNGKey(0), {k: jnp.asarray(tokens, jnp.int32) for k in ("inputs", "targets")}
    )
    gen = Generator(cfg, params, make_mesh(1, 1), max_len=32)
    _, _, cache = gen.prefill(np.zeros((2, 32), np.int32), np.array([3, 11]), Sampling())
    assert cache["k"].shape[2] == 4 and cache_memory(gen, 2)["slots"] == 4
    assert (
        cache_bytes(cfg, gen.mesh, 2, 32)["total"] * 8
        == cache_bytes(cfg.replace(sliding_window=0), gen.mesh, 2, 32)["total"]
    )
    got = logits_with_cache(gen, tokens, np.array([3, 11]))
    want = np.asarray(
        jax.jit(hk.without_apply_rng(hk.transform(logits_fn(cfg, Parallel()))).apply)(params, tokens)
    )
    for b, n in enumerate((3, 11)):
        np.testing.assert_allclose(got[b], want[b, n - 1 :], rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize(
    "preset,attention,meshes",
    [
        ("tiny-gemma2", "blockwise", ((1, 2),)),
        # slow: the same cache on one device (its cost, its programs compiled again): the local layers'
        # window with the heads split is caught quick by the 1x2 cell; one device's rolling window quick
        # by test_rolling_cache_holds_the_window_and_equals_the_full_forward
        pytest.param("tiny-gemma2", "blockwise", ((1, 1),), marks=pytest.mark.slow),
    ],
    ids=["tiny-gemma2-blockwise-1x2", "tiny-gemma2-blockwise-1x1"],
)
def test_local_layers_cache_holds_the_window(preset, attention, meshes):
    """Local and global layers (Gemma 2/3), window 4, a 32-slot context: the local layers' decode cache
    has 4 slots, the global ones' 32; teacher-forced cached logits from prompts of 3 and 11 tokens up to
    position 19 (several windows on) equal the full forward's, on ``meshes``."""
    from meshlm.generate.generator import Generator, cache_memory
    from meshlm.generate.inputs import Sampling
    from meshlm.model.kv_kinds import kind_counts
    from meshlm.parallel.mesh import make_mesh

    cfg = get_config(preset).replace(sliding_window=4, attention=attention, attn_block=4)
    tokens = np.random.default_rng(1).integers(1, 64, (2, 20))
    params = jax.jit(hk.transform(loss_fn(cfg, Parallel())).init)(
        jax.random.PRNGKey(0), {k: jnp.asarray(tokens, jnp.int32) for k in ("inputs", "targets")}
    )
    want = np.asarray(
        jax.jit(hk.without_apply_rng(hk.transform(logits_fn(cfg, Parallel()))).apply)(params, tokens)
    )
    (n_local, n_global), lengths = kind_counts(cfg), np.array([3, 11])
    for mesh in (make_mesh(*m) for m in meshes):
        gen = Generator(cfg, params, mesh, max_len=32)
        _, _, cache = gen.prefill(np.zeros((2, 32), np.int32), lengths, Sampling())
        assert cache["k_local"].shape[:3] == (n_local, 2, 4) and cache["k"].shape[:3] == (n_global, 2, 32)
        assert cache_memory(gen, 2)["local_slots"] == 4 and cache_memory(gen, 2)["slots"] == 32
        got = logits_with_cache(gen, tokens, lengths)
        for b, n in enumerate(lengths):
            np.testing.assert_allclose(got[b], want[b, n - 1 :], rtol=1e-5, atol=1e-5 * np.abs(want).max())
