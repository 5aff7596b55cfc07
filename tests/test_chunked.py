"""Chunked attention (Llama 4), a mask rule of the variant record (``attention_variants.mask_mod``'s
``chunk``): a query sees only the keys of its chunk. Plain attention, the blockwise kernel (forward and
backward) and the ring's chunks merged on one device equal attention under the mask written by hand,
with a chunk boundary inside a block and a cp chunk; the block skip is derived from the mask (a block
wholly before the query block's chunk is skipped); a traced 0 is no chunk. Generation: the chunked
layers' KV cache holds one chunk (rolling) and cached decoding equals the full forward past several
chunks, and so does the same mixed dense/MoE stack with windows (``kv_kinds``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import jitted_vjp

from meshlm.model.attention import _attend
from meshlm.model.attention_variants import Variant, block_needed
from meshlm.model.blockwise import blockwise_attention, chunked_attention

B, T, H, K, E = 2, 14, 4, 2, 8
TOL = 1e-12


def _by_hand(q, k, v, chunk):
    qg = q.reshape(B, T, K, H // K, E)
    s = jnp.einsum("btkge,bske->bkgts", qg, k) / np.sqrt(E)
    i = np.arange(T)
    vis = (i[None, :] <= i[:, None]) & (i[None, :] // chunk == i[:, None] // chunk)
    p = jax.nn.softmax(jnp.where(vis, s, -jnp.inf), -1)
    return jnp.einsum("bkgts,bske->btkge", p, v).reshape(B, T, H, E)


@pytest.mark.parametrize("chunk", [5, 16])  # boundaries inside blocks of 4 and the ring's halves; none
def test_every_kernel_equals_the_chunk_mask_by_hand(chunk):
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        q, k, v = (jnp.asarray(rng.normal(size=s)) for s in [(B, T, H, E), (B, T, K, E), (B, T, K, E)])
        dout = jnp.asarray(rng.normal(size=(B, T, H, E)))
        pos = jnp.broadcast_to(jnp.arange(T), (B, T))
        halves = lambda x: (x[:, :7], x[:, 7:])
        traced = Variant(chunk=jnp.int32(chunk))  # a layer's chunk from a kind table
        kernels = {
            "plain": lambda q, k, v: _attend(q, k, v, pos, pos, None, Variant(chunk=chunk)),
            "plain traced": lambda q, k, v: _attend(q, k, v, pos, pos, None, traced),
            "blockwise": lambda q, k, v: blockwise_attention(q, k, v, pos, pos, block=4, variant=traced),
            "ring steps": lambda q, k, v: chunked_attention(
                q, halves(k), halves(v), pos, halves(pos), block=4, variant=Variant(chunk=chunk)
            ),
        }
        want, want_grads = jitted_vjp(lambda *a: _by_hand(*a, chunk), (q, k, v), dout)
        for name, fn in kernels.items():
            got, grads = jitted_vjp(fn, (q, k, v), dout)
            assert float(jnp.max(jnp.abs(got - want))) <= TOL, name
            for g, w in zip(grads, want_grads, strict=True):
                assert float(jnp.max(jnp.abs(g - w))) <= TOL * float(jnp.max(jnp.abs(w))), name
        no_chunk = lambda q, k, v: blockwise_attention(
            q, k, v, pos, pos, block=4, variant=Variant(chunk=jnp.int32(0))
        )
        off, whole = jax.jit(lambda *a: (no_chunk(*a), _by_hand(*a, T)))(q, k, v)
        assert float(jnp.max(jnp.abs(off - whole))) <= TOL  # a traced 0: no chunk


def test_blocks_outside_the_chunk_are_skipped():
    """Chunk 8, blocks of 4: queries 8..11 need the key blocks 8..11 only (4..7 is the previous chunk);
    queries 12..15 need 8..15; a query block straddling a boundary (6..9) needs both chunks' keys."""
    block = lambda lo: jnp.arange(lo, lo + 4)[None]
    need = lambda q, k: bool(block_needed(block(q), block(k), jnp.ones((1, 4), bool), True, chunk=8))
    assert [need(8, k) for k in (0, 4, 8)] == [False, False, True]
    assert [need(12, k) for k in (4, 8, 12)] == [False, True, True]
    assert [need(6, k) for k in (0, 4, 8, 12)] == [True, True, True, False]


CHUNK_CONTROLS = ("chunk boundary off by one", "NoPE layer rotated", "temperature applied on a rotated layer")


# slow: the whole model's proof under the ring (its cost, ~40 s of CPU); the chunk mask in every kernel, the
# ring's chunks included: test_every_kernel_equals_the_chunk_mask_by_hand, quick
@pytest.mark.slow
def test_verify_proves_chunks_and_nope_layers_under_the_cp_ring():
    """tiny-llama4 cut to two layers (a chunked, rotated, L2-normed dense layer, then a NoPE MoE layer
    with the temperature: the preset's four layers repeat these pieces at twice the compile; its four
    are compared with transformers in test_hf_llama4) blockwise on a cp 2 ring (24 positions: chunks of
    8 crossing the cp shards), float64: sharded == unsharded, the three controls detected."""
    from meshlm.model.config import get_config
    from meshlm.parallel.layout import Layout
    from meshlm.proof import format_report
    from meshlm.proof.controls import CONTROLS
    from meshlm.proof.problem import model_problem
    from meshlm.proof.prover import verify

    cfg = get_config("tiny-llama4").replace(
        attention="blockwise", attn_block=4, n_layers=2, global_every=2, dense_layers=(0,)
    )
    controls = tuple(c for c in CONTROLS if c.name in CHUNK_CONTROLS)
    with jax.enable_x64(True):
        problem = model_problem(cfg, "tiny-llama4", 1, 1, 24)
        report = verify(problem, Layout(cp=2), dtype=jnp.float64, controls=controls)
    assert report.ok, format_report(report)
    assert max(p.max_rel_err for p in report.params) <= 1e-12
    assert sorted(c["name"] for c in report.controls) == sorted(CHUNK_CONTROLS)
    assert all(c["detected"] for c in report.controls), report.controls


# slow: the cached decode of the mixed stack (its cost); cached decoding equals the full forward quick in
# tests/test_generate.py, the windowed cache in tests/test_windows.py
@pytest.mark.slow
@pytest.mark.parametrize(
    "local", [dict(), dict(attn_chunk=0, sliding_window=8)], ids=["chunks", "dense+windows"]
)
def test_cached_decode_of_the_mixed_stack_equals_the_full_forward(local):
    """tiny-llama4 (MoE and dense layers; three chunked layers, chunks of 8, and a NoPE global one),
    and the same stack with windows of 8 instead: the local layers' cache holds 8 slots (the current
    chunk's keys; a window's), the global one the context; teacher-forced cached logits from prompts
    of 3 and 11 tokens up to position 27 (past three chunks) equal the full forward's, on 1x2."""
    import haiku as hk

    from meshlm.generate.cache import cache_bytes
    from meshlm.generate.generator import Generator, logits_with_cache
    from meshlm.model.config import get_config
    from meshlm.model.transformer import logits_fn, loss_fn
    from meshlm.parallel.context import Parallel
    from meshlm.parallel.mesh import make_mesh

    cfg = get_config("tiny-llama4").replace(**local)
    mesh, tokens = make_mesh(1, 2), np.random.default_rng(1).integers(1, 64, (2, 28))
    params = hk.transform(loss_fn(cfg, Parallel())).init(
        jax.random.PRNGKey(0), {k: jnp.asarray(tokens, jnp.int32) for k in ("inputs", "targets")}
    )
    want = np.asarray(
        jax.jit(hk.without_apply_rng(hk.transform(logits_fn(cfg, Parallel()))).apply)(params, tokens)
    )
    size = cache_bytes(cfg, mesh, 2, 32)
    assert (size["local_slots"], size["slots"]) == (8, 32)
    lengths = np.array([3, 11])
    got = logits_with_cache(Generator(cfg, params, mesh, max_len=32), tokens, lengths)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(got[b], want[b, n - 1 :], rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_prefill_over_cp_refuses_the_chunked_layers_cache():
    """The local and global caches are not filled by a prefill over cp: one line, before any compile."""
    from meshlm.errors import ConfigError
    from meshlm.generate.programs import check_prefill_cp
    from meshlm.model.config import get_config
    from meshlm.parallel.layout import Layout

    with pytest.raises(ConfigError, match="keep a window or a chunk"):
        check_prefill_cp(get_config("tiny-llama4"), Layout(cp=2), 64)
