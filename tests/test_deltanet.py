"""The gated delta rule (``model.deltanet``) in float64: the chunked form equals the token-by-token
recurrence to 1e-12 (several chunk sizes, a ragged last chunk, an incoming state), and with document
resets each document's output equals that document run alone from a zero state (the conv's too)."""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.model import deltanet

B, T, H, DK, DV = 2, 21, 3, 4, 5

# the rule and the conv jitted, as the layer runs them (one program each, not one per operation)
recurrent_rule = jax.jit(deltanet.recurrent_rule)
chunked_rule = jax.jit(deltanet.chunked_rule, static_argnums=6)
causal_conv = jax.jit(deltanet.causal_conv)


@pytest.fixture(scope="module")
def inputs():
    with jax.enable_x64(True):
        r = np.random.default_rng(0)
        f = lambda *shape: jnp.asarray(r.normal(size=shape), jnp.float64)
        q, k = deltanet.l2norm(f(B, T, H, DK)), deltanet.l2norm(f(B, T, H, DK))
        g = -jnp.asarray(r.uniform(0.05, 1.5, (B, T, H)))
        beta = jax.nn.sigmoid(f(B, T, H))
        return q, k, f(B, T, H, DV), g, beta, f(B, H, DK, DV)


@pytest.mark.parametrize("chunk", [3, 8])
def test_chunked_equals_recurrence(inputs, chunk):
    with jax.enable_x64(True):
        reset = jnp.asarray(np.random.default_rng(1).uniform(size=(B, T)) < 0.2)
        for r in (None, reset):
            want, want_state = recurrent_rule(*inputs, r)
            got, state = chunked_rule(*inputs, chunk, r)
            assert float(jnp.max(jnp.abs(got - want))) <= 1e-12
            assert float(jnp.max(jnp.abs(state - want_state))) <= 1e-12
        # the write strength matters: beta = 0 writes nothing, so the state only decays
        zero = (*inputs[:4], jnp.zeros_like(inputs[4]), inputs[5])
        _, state = chunked_rule(*zero, chunk)
        decay = jnp.exp(jnp.sum(inputs[3], axis=1))[..., None, None]
        assert float(jnp.max(jnp.abs(state - inputs[5] * decay))) <= 1e-12


def test_documents_restart_the_state_and_the_conv(inputs):
    """Two documents in a row (the second starts at 9): each part equals it run alone from zeros."""
    with jax.enable_x64(True):
        q, k, v, g, beta, _ = inputs
        positions = jnp.broadcast_to(jnp.arange(T), (B, T))
        starts = jnp.where(positions >= 9, 9, 0)
        reset = deltanet.document_resets(positions, starts)
        zeros = jnp.zeros((B, H, DK, DV))
        got, _ = chunked_rule(q, k, v, g, beta, zeros, 4, reset)
        parts = [slice(0, 9), slice(9, T)]
        for s in parts:
            alone, _ = recurrent_rule(q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s], zeros)
            assert float(jnp.max(jnp.abs(got[:, s] - alone))) <= 1e-12
        carried, _ = chunked_rule(q, k, v, g, beta, zeros, 4)  # without the reset: different
        assert float(jnp.max(jnp.abs(carried[:, 9:] - got[:, 9:]))) > 1e-3
        x, w = v.reshape(B, T, -1), jnp.asarray(np.random.default_rng(2).normal(size=(4, H * DV)))
        conv = causal_conv(x, w, positions, starts)
        for s in parts:
            assert float(jnp.max(jnp.abs(conv[:, s] - causal_conv(x[:, s], w)))) <= 1e-12


def _prove_linear_attention(names=None):
    """``meshlm verify --config tiny-qwen3.5 --mesh 2x2 --fsdp --sp --doc-mask``'s proof (float64, 16
    tokens: two chunks of 8, EOD-rich rows): sharded == unsharded, key and value heads split over mp, with
    the delta rule's planted faults ``names`` (None: every one) each detected. The names of the controls
    run."""
    from meshlm.model.config import get_config
    from meshlm.parallel.layout import Layout
    from meshlm.proof import format_report, model_problem, verify
    from meshlm.proof.linear_controls import LINEAR_CONTROLS

    controls = tuple(c for c in LINEAR_CONTROLS if names is None or c.name in names)
    layout = Layout(dp=2, mp=2, fsdp=True, sp=True)
    cfg = get_config("tiny-qwen3.5").replace(doc_mask=0, n_layers=2)  # one period: a linear, a full layer
    problem = model_problem(cfg, "tiny-qwen3.5", layout, batch_size=2, seq_len=16)
    with jax.enable_x64(True):
        report = verify(problem, layout, dtype=np.float64, controls=controls, steps=2)
    assert report.ok, format_report(report)
    assert max(p.max_rel_err for p in report.params) <= 1e-12
    assert all(c["detected"] for c in report.controls), report.controls
    return sorted(c["name"] for c in report.controls)


# The quick tier: the two faults of the sharded rule, the head pairing under mp and the state's reset
# under the document mask (each other control recompiles the train step)
QUICK_LINEAR = (
    "linear attention's key heads paired with another shard's value heads",
    "delta rule's state not reset at a document start",
)


def test_verify_proves_linear_attention_and_detects_its_sharding_controls():
    assert _prove_linear_attention(QUICK_LINEAR) == sorted(QUICK_LINEAR)


# slow: the same proof with every control (the rule's decay order and beta's sigmoid too: faults of the
# rule itself, not of its sharding): its cost is its scale; the sharded rule's bug class is caught
# quick by test_verify_proves_linear_attention_and_detects_its_sharding_controls
@pytest.mark.slow
def test_verify_proves_linear_attention_and_detects_its_controls():
    from meshlm.proof.linear_controls import LINEAR_CONTROLS

    # the cp chunks' controls apply under cp only (test_verify_proves_linear_attention_under_cp)
    assert _prove_linear_attention() == sorted(c.name for c in LINEAR_CONTROLS if "cp chunks" not in c.name)


def test_context_parallel_chunks_equal_the_whole_sequence(inputs, cp=3):
    """Under cp = 3 (``model.linear_context``; a middle shard's chunks both follow other shards') each
    shard's two load-balanced chunks, run from the conv tails and the composed state maps of the chunks
    before them, equal the whole sequence's rule and conv (float64, 1e-12); the state passed matters:
    the rule from zeros at the second chunk differs there."""
    from jax.sharding import PartitionSpec as P

    from meshlm.model import linear_context
    from meshlm.parallel.axes import CP
    from meshlm.parallel.context import Parallel
    from meshlm.parallel.cp import sequence_order
    from meshlm.parallel.layout import Layout

    with jax.enable_x64(True):
        q, k, v, g, beta = (a[:, : 6 * cp] for a in inputs[:5])  # 2cp chunks of 3 tokens
        t, zeros = q.shape[1], jnp.zeros((B, H, DK, DV))
        x, w = v.reshape(B, t, -1), jnp.asarray(np.random.default_rng(3).normal(size=(3, H * DV)))
        want, _ = chunked_rule(q, k, v, g, beta, zeros, 2)
        layout = Layout(cp=cp)
        par = Parallel.on(layout)

        def body(*xs):
            q, k, v, g, beta, x = (par.seq_local(a) for a in xs)
            return linear_context.cp_rule(q, k, v, g, beta, 2, par)[0], linear_context.cp_conv(x, w, par)

        run = jax.jit(jax.shard_map(body, mesh=layout.mesh, in_specs=P(), out_specs=P(None, CP)))
        out, conv = (sequence_order(a, cp) for a in run(q, k, v, g, beta, x))
        assert float(jnp.max(jnp.abs(out - want))) <= 1e-12
        assert float(jnp.max(jnp.abs(conv - causal_conv(x, w)))) <= 1e-12
        alone, _ = chunked_rule(*(a[:, 3:] for a in (q, k, v, g, beta)), zeros, 2)
        assert float(jnp.max(jnp.abs(alone - want[:, 3:]))) > 1e-3  # the state from chunk 0 matters


# slow: the hybrid's cached decode (its cost); cached decoding equals the full forward quick in
# tests/test_generate.py
@pytest.mark.slow
def test_generation_cache_logits_equal_the_full_forward_in_float64():
    """The recurrent-state cache (``model.linear_cache``): rows of 3 and 11 prompt tokens (a right-padded
    prefill by the chunked rule: the padding must not reach the state), then each token by one decode
    step (the recurrence), give the full forward's logits (float64, 1e-12 of their scale); the state's
    bytes do not grow with the context, the K/V's do."""
    import haiku as hk

    from meshlm.generate.cache import cache_bytes
    from meshlm.generate.generator import Generator, logits_with_cache
    from meshlm.model.config import get_config
    from meshlm.model.transformer import init_fn, logits_fn
    from meshlm.parallel.context import Parallel
    from meshlm.parallel.layout import Layout

    cfg = get_config("tiny-qwen3.5").replace(n_layers=2)  # one period: a linear, a full layer
    tokens, lengths = np.random.default_rng(1).integers(1, 64, (2, 20)), np.array([3, 11])
    with jax.enable_x64(True):
        init, example = init_fn(cfg)
        params = jax.tree.map(lambda p: p.astype(jnp.float64), init(jax.random.PRNGKey(0), example))
        forward = hk.without_apply_rng(hk.transform(logits_fn(cfg, Parallel()))).apply
        want = np.asarray(jax.jit(forward)(params, jnp.asarray(tokens, jnp.int32)))
        got = logits_with_cache(Generator(cfg, params, Layout(), max_len=32), tokens, lengths)
    for b, n in enumerate(lengths):
        assert float(np.max(np.abs(got[b] - want[b, n - 1 :]))) <= 1e-12 * np.abs(want).max()
    short, long = (cache_bytes(cfg, Layout(), 2, s, jnp.float32) for s in (32, 64))
    assert short["linear_state"] == long["linear_state"] > 0  # 1 layer: 8 x 8 x 8 state, 3 x 128 conv, length
    assert short["linear_state"] == 2 * (8 * 8 * 8 * 4 + 3 * 128 * 4 + 4)
    assert long["total"] - short["total"] == 2 * 32 * 2 * (2 * 16) * 4  # K and V: 32 more slots


# slow: the same proof under cp on two layouts (its cost is its scale); the chunks across cp shards:
# test_context_parallel_chunks_equal_the_whole_sequence, quick
@pytest.mark.slow
@pytest.mark.parametrize(("mp", "cp", "seq_len"), [(2, 2, 16), (1, 4, 24)])
def test_verify_proves_linear_attention_under_cp(mp, cp, seq_len):
    """``meshlm verify --config tiny-qwen3.5 --mesh 1x2 --cp 2``'s and ``--mesh 1x1 --cp 4``'s proofs of
    the linear layer's cp part (float64; 16 tokens: cp chunks of 4, 24 on cp 4: 8 chunks of 3, each after
    the K - 1 = 3 inputs and the state of the chunk before, the states composed over 8 maps, middle shards'
    chunks both after other shards'): sharded == unsharded after 2 steps, the communication check holds
    the linear layers' all-gathers and their bytes, and the state's and the conv history's controls are
    detected."""
    from meshlm.model.config import get_config
    from meshlm.parallel.layout import Layout
    from meshlm.proof import format_report, model_problem, verify
    from meshlm.proof.linear_controls import LINEAR_CONTROLS

    cp_controls = tuple(c for c in LINEAR_CONTROLS if "cp chunks" in c.name)
    layout = Layout(mp=mp, cp=cp)
    cfg = get_config("tiny-qwen3.5").replace(n_layers=2)  # one period: a linear, a full layer
    problem = model_problem(cfg, "tiny-qwen3.5", layout, batch_size=1, seq_len=seq_len)
    with jax.enable_x64(True):
        report = verify(problem, layout, dtype=np.float64, controls=cp_controls, steps=2, collectives=True)
    assert report.ok, format_report(report)
    assert max(p.max_rel_err for p in report.params) <= 1e-12
    assert len(cp_controls) == 2 and all(c["detected"] for c in report.controls), report.controls
    assert "all-gather bytes per step" in format_report(report)


def test_the_reference_solves_the_sharded_runs_chunks():
    """Issue 59: under cp the proof's reference runs the delta rule at the sharded run's chunk boundaries
    (``proof.problem.reference_chunk``), so that both solve the same triangular systems: a reference in
    chunks of 64 against the shards' cp chunks of 16 differed by the chunked form's own rounding (2.4e-12
    on the converted model, ``tests/test_hf_qwen3_5.py``), not by the sharding. Without cp the reference
    keeps the model's chunk, as the sharded run does."""
    from meshlm.model.config import get_config
    from meshlm.parallel.layout import Layout
    from meshlm.proof.problem import model_problem, reference_chunk

    assert reference_chunk(64, 64, 2) == 16  # cp chunks of 16 tokens, each one chunk of the rule
    assert reference_chunk(64, 24, 4) == 3
    assert reference_chunk(8, 64, 2) == 8  # chunks of 8 inside each cp chunk of 16
    assert reference_chunk(8, 48, 2) == 4  # cp chunks of 12 run as 8 + 4: every boundary a multiple of 4
    cfg = get_config("tiny-qwen3.5").replace(linear_chunk=64)
    for layout, want in ((Layout(mp=2), 64), (Layout(mp=2, cp=2), 16), (Layout(cp=4), 8)):
        problem = model_problem(cfg, "issue 59", layout, batch_size=1, seq_len=64)
        assert (problem.cfg.linear_chunk, problem.reference_cfg.linear_chunk) == (64, want)


def test_cpu_solves_one_matrix_per_lapack_call():
    """Issue 59: jaxlib 0.10's batched LAPACK solve splits a large enough batch over XLA:CPU's intra-op
    pool and waits for the pieces on a pool thread; under --mesh 1x2 --cp 2 four devices did so at
    once and the step never returned (``deltanet.unit_lower_solve``). The issue's shape (a chunk of
    64, 2 value heads a shard, dv 12 widened by dk 16, both cp chunks: a batch of 4), forward and
    backward, lowered for CPU: every LAPACK solve is of one matrix, and the result is bitwise that
    of the batched solve."""
    import re

    from jax import lax

    with jax.enable_x64(True):
        r = np.random.default_rng(0)
        system = jnp.asarray(np.tril(r.normal(size=(1, 2, 2, 64, 64)) * 0.1, -1) + np.eye(64))
        x = jnp.asarray(r.normal(size=(1, 2, 2, 64, 28)))
        loss = lambda s, x: jnp.sum(jnp.sin(deltanet.unit_lower_solve(s, x)))
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(system, x).as_text()
        calls = [line for line in hlo.splitlines() if re.search(r"custom_call @lapack_[sd]trsm_ffi", line)]
        assert len(calls) == 3  # the forward's and the backward's two (d system, d x)
        assert all('num_batch_dims = "0"' in line for line in calls)
        batched = lax.linalg.triangular_solve(system, x, left_side=True, lower=True, unit_diagonal=True)
        assert np.array_equal(np.asarray(deltanet.unit_lower_solve(system, x)), np.asarray(batched))


# The issue's model as a preset change: 4 layers (three linear, one full), 2 key heads serving 4 value
# heads (2 a shard on mp 2) of dk 16 and dv 12, transformers' chunk of 64; verified on 1x2 + cp 2 in a
# subprocess with a stall limit, so that a regression ends (exit 3) instead of hanging the suite.
ISSUE_59 = textwrap.dedent(
    """
    import jax, numpy as np
    from meshlm.model.config import get_config
    from meshlm.parallel.layout import Layout
    from meshlm.proof import format_report, model_problem, verify

    jax.config.update("jax_enable_x64", True)
    linear = dict(linear_key_heads=2, linear_value_heads=4, linear_key_dim=16, linear_value_dim=12)
    cfg = get_config("tiny-qwen3.5").replace(full_attn_every=4, linear_chunk=64, **linear)
    layout = Layout(mp=2, cp=2)
    problem = model_problem(cfg, "issue 59", layout, batch_size=1, seq_len=16)
    report = verify(problem, layout, dtype=np.float64, controls=(), steps=1)
    print(format_report(report))
    print("worst", max(p.max_rel_err for p in report.params))
    """
)


# slow: the issue's shape run end to end under cp (its cost, ~25 s); its bug class, a batched LAPACK
# solve on CPU: test_cpu_solves_one_matrix_per_lapack_call, quick
@pytest.mark.slow
def test_issue_59_shape_under_cp_finishes():
    """Issue 59: ``meshlm verify`` of a converted tiny Qwen3.5 (the shape above) on --mesh 1x2 --cp 2
    never returned (jaxlib's batched LAPACK solve deadlocked XLA:CPU's thread pool; see
    ``test_cpu_solves_one_matrix_per_lapack_call``). It finishes, and proves, in float64."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "MESHLM_STALL_TIMEOUT": "300"}
    out = subprocess.run(
        [sys.executable, "-c", ISSUE_59], capture_output=True, text=True, timeout=900, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK: sharded == unsharded" in out.stdout, out.stdout[-3000:]
    assert float(out.stdout.split("worst")[-1]) <= 1e-12
