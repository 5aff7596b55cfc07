"""Learned attention sinks (gpt-oss), a variant of the record (``attention_variants.Variant.sink``): a
logit per query head joins each softmax's normaliser and takes no value. Plain attention, the blockwise
kernel (forward and backward), the ring's chunks merged on one device (``chunked_attention``), a window
and document starts all equal the softmax over the scores with the sink as one more column, gradients
(the sink's own included) too; the KV-cached decode equals the full forward on 1x1 and 1x2; the sinks
are named in at most 5 source files. The sharded proof (both cp strategies, dp x mp, both controls) is
``meshlm verify --config tiny-gpt-oss``; here the cp ring's with both sink controls."""

from __future__ import annotations

import subprocess
from pathlib import Path

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import jitted_vjp

from meshlm.generate.generator import logits_with_cache
from meshlm.model.attention import _attend
from meshlm.model.attention_variants import Variant
from meshlm.model.blockwise import blockwise_attention, chunked_attention
from meshlm.model.config import get_config
from meshlm.model.transformer import logits_fn, loss_fn
from meshlm.parallel.context import Parallel

SRC = Path(__file__).resolve().parents[1] / "src" / "meshlm"
B, T, H, K, E = 2, 13, 4, 2, 8
TOL = 1e-12  # float64: the kernels and the explicit sink column differ in rounding only


def _with_sink_column(q, k, v, sink, window, starts):
    """The reference: softmax over [visible scores..., sink] per query head, the sink's column dropped."""
    qg = q.reshape(B, T, K, H // K, E)
    s = jnp.einsum("btkge,bske->bkgts", qg, k) / np.sqrt(E)
    i = jnp.arange(T)
    vis = (i[None, :] <= i[:, None]) & ((window == 0) | (i[None, :] > i[:, None] - window))
    vis = vis[None] & (i[None, None, :] >= starts[:, :, None])  # [B, T, S]
    s = jnp.where(vis[:, None, None], s, -jnp.inf)
    col = jnp.broadcast_to(sink.reshape(K, H // K)[None, :, :, None, None], (B, K, H // K, T, 1))
    p = jax.nn.softmax(jnp.concatenate([s, col], -1), -1)[..., :-1]
    return jnp.einsum("bkgts,bske->btkge", p, v).reshape(B, T, H, E)


@pytest.mark.parametrize("window", [0, 4])
@pytest.mark.parametrize("doc", [False, True])
def test_every_kernel_equals_the_softmax_with_a_sink_column(window, doc):
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        q, k, v = (jnp.asarray(rng.normal(size=s)) for s in [(B, T, H, E), (B, T, K, E), (B, T, K, E)])
        sink, dout = jnp.asarray(rng.normal(size=H) * 2), jnp.asarray(rng.normal(size=(B, T, H, E)))
        pos = jnp.broadcast_to(jnp.arange(T), (B, T))
        starts = jnp.asarray([[0] * 5 + [5] * 8, [0] * T]) if doc else jnp.zeros((B, T), int)
        qs = starts if doc else None
        variant = lambda s: Variant(window=window, sink=s)
        halves = lambda x: (x[:, :6], x[:, 6:])
        kernels = {
            "plain": lambda q, k, v, s: _attend(q, k, v, pos, pos, qs, variant(s)),
            "blockwise": lambda q, k, v, s: blockwise_attention(
                q, k, v, pos, pos, block=4, q_start=qs, variant=variant(s)
            ),
        }
        if not doc:  # the ring's steps on one device (cp runs without --doc-mask)
            kernels["chunked"] = lambda q, k, v, s: chunked_attention(
                q, halves(k), halves(v), pos, halves(pos), block=4, variant=variant(s)
            )
        want, want_grads = jitted_vjp(lambda *a: _with_sink_column(*a, window, starts), (q, k, v, sink), dout)
        for name, fn in kernels.items():
            got, grads = jitted_vjp(fn, (q, k, v, sink), dout)
            assert float(jnp.max(jnp.abs(got - want))) <= TOL, name
            for g, w in zip(grads, want_grads, strict=True):
                assert float(jnp.max(jnp.abs(g - w))) <= TOL * max(1.0, float(jnp.max(jnp.abs(w)))), name
        assert float(jnp.max(jnp.abs(want_grads[3]))) > 1e-3  # the sink's gradient is not trivially 0


def test_sinks_are_named_in_six_source_files():
    """The variant, its config field, its rules row, its controls, gpt-oss's module (issue 44), and the
    flash kernel's boundary (``flash_kernel.kernel_normaliser``: splash's own ``sinks`` operand)."""
    out = subprocess.run(["grep", "-rliE", "sink", str(SRC)], capture_output=True, text=True).stdout
    named = sorted(Path(p).relative_to(SRC).as_posix() for p in out.split() if p.endswith(".py"))
    assert named == [
        "model/attention_variants.py",
        "model/families/gpt_oss.py",
        "model/flash_kernel.py",
        "model/variant_fields.py",
        "proof/family_faults.py",
        "sharding/rules.py",
    ]


# slow: the cached decode with sinks (its cost); cached decoding equals the full forward quick in
# tests/test_generate.py, the sink in every kernel quick above
@pytest.mark.slow
def test_cached_decode_with_sinks_equals_the_full_forward():
    """tiny-gpt-oss (sinks on every layer, window 8 on alternate layers), the sinks set away from 0:
    teacher-forced cached logits from prompts of 3 and 11 tokens up to position 27 (past several
    windows: the local layers' cache rolls) equal the full forward's, on 1x2 (the heads' sinks split)."""
    from meshlm.generate.generator import Generator
    from meshlm.parallel.mesh import make_mesh

    cfg = get_config("tiny-gpt-oss").replace(attention="blockwise", attn_block=4)
    tokens = np.random.default_rng(1).integers(1, 64, (2, 28))
    params = hk.transform(loss_fn(cfg, Parallel())).init(
        jax.random.PRNGKey(0), {k: jnp.asarray(tokens, jnp.int32) for k in ("inputs", "targets")}
    )
    sinks = params["layers/attn"]["sinks"]
    params["layers/attn"]["sinks"] = jnp.asarray(np.random.default_rng(2).normal(size=sinks.shape) * 2)
    want = np.asarray(
        jax.jit(hk.without_apply_rng(hk.transform(logits_fn(cfg, Parallel()))).apply)(params, tokens)
    )
    off = np.asarray(
        jax.jit(
            hk.without_apply_rng(hk.transform(logits_fn(cfg.replace(attn_sinks=False), Parallel()))).apply
        )({m: {n: x for n, x in p.items() if n != "sinks"} for m, p in params.items()}, tokens)
    )
    assert np.abs(off - want).max() > 1e-2 * np.abs(want).max()  # the sinks change the logits
    lengths = np.array([3, 11])
    gen = Generator(cfg, params, make_mesh(1, 2), max_len=32)
    got = logits_with_cache(gen, tokens, lengths)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(got[b], want[b, n - 1 :], rtol=1e-5, atol=1e-5 * np.abs(want).max())


SINK_CONTROLS = ("sink added on every ring step", "sink's gradient not summed over the data shards")


# slow: the whole model's proof under the ring (its cost); the sink in every kernel, the ring's included:
# test_every_kernel_equals_the_softmax_with_a_sink_column, quick
@pytest.mark.slow
def test_verify_proves_sinks_under_the_cp_ring():
    """tiny-gpt-oss (2 layers: a windowed one and a full one, sinks on both) blockwise on dp 2 x a cp 2
    ring, float64: sharded == unsharded (the plain reference), both sink controls detected."""
    from meshlm.parallel.layout import Layout
    from meshlm.proof import format_report
    from meshlm.proof.controls import CONTROLS
    from meshlm.proof.problem import model_problem
    from meshlm.proof.prover import verify

    cfg = get_config("tiny-gpt-oss").replace(attention="blockwise", attn_block=4, n_layers=2)
    controls = tuple(c for c in CONTROLS if c.name in SINK_CONTROLS)
    with jax.enable_x64(True):
        problem = model_problem(cfg, "tiny-gpt-oss", 1, 2, 16, dp=2)
        report = verify(problem, Layout(dp=2, cp=2), dtype=jnp.float64, controls=controls)
    assert report.ok, format_report(report)
    assert max(p.max_rel_err for p in report.params) <= 1e-12
    assert sorted(c["name"] for c in report.controls) == sorted(SINK_CONTROLS)
    assert all(c["detected"] for c in report.controls), report.controls
