"""Flash attention (``--attention flash``: JAX's Pallas splash kernel, ``model.flash``) equals plain
attention, forward and every input gradient, in float32 within ``TOL`` (relative to the largest value):
causal, grouped-query, a window, Llama 4's chunks, soft-capping, learned sinks, document masks, a
length padded to the kernel's 128-token blocks, a traced per-layer window. Off a TPU the kernel runs in
Pallas interpret mode: its own code, not a stand-in. The refusals are one line each."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.errors import ConfigError
from meshlm.model.attention import _attend
from meshlm.model.attention_variants import CAUSAL, Variant
from meshlm.model.config import get_config
from meshlm.model.flash import flash_attention, padded_length
from meshlm.model.flash_kernel import block_size
from meshlm.model.transformer import check_context
from meshlm.parallel.context import Parallel
from meshlm.parallel.layout import Layout

# float32 kernel against float32 plain attention (the reference's matmuls at 'highest'): both round
# differently (blocked online softmax vs one softmax); 2e-5 of the largest value holds with room.
TOL = 2e-5


def inputs(b, t, h, kh, e, seed=0):
    r = np.random.default_rng(seed)
    shapes = ((b, t, h, e), (b, t, kh, e), (b, t, kh, e), (b, t, h, e))
    return tuple(jnp.asarray(r.normal(size=s), jnp.float32) for s in shapes)


def rel_err(a, b):
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def value_and_grads(fn, args, ct):
    def both(*args):
        out, vjp = jax.vjp(fn, *args)
        return (out, *vjp(ct))

    with jax.default_matmul_precision("highest"):
        return jax.jit(both)(*args)


def worst_error(variant=CAUSAL, *, t=128, h=2, kh=1, e=16, starts=None, sink=None):
    """The worst relative error of flash against plain attention: output and the gradients of q, k, v
    (and of the sinks, where learned)."""
    q, k, v, ct = inputs(2, t, h, kh, e)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (2, t))
    with_sink = lambda s: variant if s is None else variant.replace(sink=s)
    args = (q, k, v) if sink is None else (q, k, v, sink)
    flash = lambda q, k, v, s=None: flash_attention(q, k, v, starts, with_sink(s))
    plain = lambda q, k, v, s=None: _attend(q, k, v, pos, pos, starts, with_sink(s))
    got, want = value_and_grads(flash, args, ct), value_and_grads(plain, args, ct)
    return max(rel_err(g, w) for g, w in zip(got, want, strict=True))


def doc_starts_of(t, cuts):
    """[2, t] document starts: row 0 cut at ``cuts``, row 1 one document."""
    row = np.zeros(t, np.int32)
    for c in cuts:
        row[c:] = c
    return jnp.asarray(np.stack([row, np.zeros(t, np.int32)]))


@pytest.mark.parametrize(
    "name, variant, kw",
    [
        ("causal, grouped-query", Variant(), dict(h=4, kh=2)),
        ("window", Variant(window=7), {}),
        ("chunk", Variant(chunk=48), {}),
        ("window and chunk", Variant(window=20, chunk=48), {}),
        ("soft-cap", Variant(softcap=2.0), {}),
        ("scalar", Variant(scalar=4.0), {}),
    ],
)
def test_flash_equals_plain(name, variant, kw):
    assert worst_error(variant, **kw) < TOL, name


def test_flash_doc_mask_and_padding():
    """Document starts as segment ids, and a length (100) padded to the kernel's 128."""
    t = 100
    assert padded_length(t) == 128 and block_size(128) == 128 and block_size(640) == 128
    assert worst_error(Variant(), t=t, starts=doc_starts_of(t, (13, 60))) < TOL


def test_flash_sinks():
    """gpt-oss's learned sinks: the kernel's normaliser term and its gradient."""
    sink = jnp.asarray([0.5, -1.0], jnp.float32)
    assert worst_error(Variant(), sink=sink) < TOL


def test_flash_traced_window():
    """A layer loop's traced window (Gemma 2/3's local and global kinds): ``lax.switch`` over the
    model's candidates picks the traced layer's static mask."""
    q, k, v, _ = inputs(1, 128, 2, 1, 16)
    pos = jnp.broadcast_to(jnp.arange(128, dtype=jnp.int32), (1, 128))
    run = jax.jit(lambda w: flash_attention(q, k, v, None, Variant(window=w), candidates=((9, 0), (0, 0))))
    for w in (9, 0):
        want = _attend(q, k, v, pos, pos, None, Variant(window=w))
        assert rel_err(run(jnp.int32(w)), want) < TOL


def test_flash_is_causal_only():
    q, k, v, _ = inputs(1, 8, 2, 1, 16)
    with pytest.raises(ValueError, match="flash_attention is causal attention only; use plain or blockwise"):
        flash_attention(q, k, v, None, Variant(causal=False))


def test_flash_under_cp_refuses_what_its_ring_cannot_run(capsys):
    """In one line each: the all-gather strategy (by the model's check and by a command before any
    device), and windows (the ring's chunk pairs' masks would differ by global position)."""
    from helpers import run_cli

    cfg = get_config("tiny-llama").replace(attention="flash")
    gather = "--attention flash runs --cp as a ring; drop --cp-strategy allgather"
    with pytest.raises(ConfigError, match=gather):
        check_context(cfg, Parallel.on(Layout(cp=2, cp_strategy="allgather")))
    check_context(cfg, Parallel.on(Layout(cp=2)))  # the ring: runs
    windowed = get_config("tiny-mistral").replace(attention="flash")
    with pytest.raises(ConfigError, match="flash under --cp does not run sliding windows or chunks yet"):
        check_context(windowed, Parallel.on(Layout(cp=2)))
    argv = ("--config", "tiny-llama", "--mesh", "1x1", "--cp", "2", "--cp-strategy", "allgather")
    assert run_cli("verify", *argv, "--attention", "flash") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"meshlm: error: {gather} (or use blockwise)"]


# slow: the ring's flash block on mp 2 x cp 2 (its cost: ~20 s); the kernel's causal block and its
# masks: test_flash_equals_plain, quick; the ring itself: tests/test_cp.py, quick
@pytest.mark.slow
def test_flash_ring_equals_the_unsharded_plain_model():
    """--cp ring with flash attention (``flash_ring``: each chunk pair by the kernel, three static masks,
    chunks of 8 padded to 128): loss and every gradient equal the unsharded plain model's, float32."""
    from meshlm.model.transformer import init_fn, loss_fn
    from meshlm.sharding.rules import model_specs
    from meshlm.sharding.spmd import reference_value_and_grad, sharded_value_and_grad

    layout = Layout(mp=2, cp=2)  # (cp 3 runs too: 3 ring steps, slower to compile in interpret mode)
    plain = get_config("tiny-gqa")
    flash = plain.replace(attention="flash")
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 8 * 2 * layout.cp + 1), 0, 64)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    params = init_fn(plain)[0](jax.random.PRNGKey(0), batch)
    with jax.default_matmul_precision("highest"):
        want = jax.jit(reference_value_and_grad(lambda par: loss_fn(plain, par)))(params, batch)
        fn = sharded_value_and_grad(
            lambda par: loss_fn(flash, par), layout, model_specs(flash, params, layout)
        )
        got = jax.jit(fn)(params, batch)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert rel_err(g, w) < TOL


def test_auto_attention_is_flash_on_a_tpu_where_it_applies_and_pays(monkeypatch):
    """``--attention auto`` (the default): flash on a TPU (a faked backend name) for rows of
    ``FLASH_MIN_SEQ`` tokens or more, plain below it (measured faster there), plain elsewhere, with
    --cp (the ring runs the blockwise pieces) and with --x64 (the kernel computes in float32); a chosen
    kind is kept. The train step's config takes the choice, at the run's sequence length."""
    from meshlm.cli.verify_settings import VerifySettings
    from meshlm.settings import FLASH_MIN_SEQ
    from meshlm.train import run as train_run
    from meshlm.train.config import TrainConfig

    # the chip's sweep (docs/benchmarks.md "Choosing --attention auto", 7 December 2026 18:05 UTC) put
    # the crossing between 256 and 512 tokens: a new threshold comes with a new sweep there
    assert FLASH_MIN_SEQ == 512
    auto, long = VerifySettings(), FLASH_MIN_SEQ
    assert auto.attention == "auto"
    assert auto.attention_kind("tpu", long) == "flash" and auto.attention_kind("cpu", long) == "plain"
    assert auto.attention_kind("tpu", long - 1) == "plain" and auto.attention_kind("tpu", 8 * long) == "flash"
    assert VerifySettings(cp=2).attention_kind("tpu", long) == "plain"
    assert auto.attention_kind("tpu", long, x64=True) == "plain"
    assert VerifySettings(attention="blockwise").attention_kind("tpu", 64) == "blockwise"
    assert VerifySettings(attention="flash").attention_kind("cpu", 64) == "flash"
    cfg = get_config("tiny-llama").replace(max_seq_len=2 * long)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert train_run.step_config(TrainConfig(seq_len=long), cfg).attention == "flash"
    assert train_run.step_config(TrainConfig(seq_len=long // 2), cfg).attention == "plain"
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert train_run.step_config(TrainConfig(seq_len=long), cfg).attention == "plain"


def test_verify_refuses_flash_in_float64(capsys):
    from helpers import run_cli

    assert run_cli("verify", "--config", "tiny-llama", "--attention", "flash", "--x64") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "meshlm: error: --attention flash computes in float32 inside its kernel; verify it without --x64"
    ]


# the doc-mask cell slow (its cost): the kernel's segment ids are test_flash_doc_mask_and_padding's, quick
@pytest.mark.parametrize("doc_mask", [pytest.param(3, marks=pytest.mark.slow), -1])
def test_verify_proves_flash_with_its_controls_detected(doc_mask):
    """``meshlm verify --attention flash`` (float32) on mp 2 with a window (10), with and without the
    document mask: sharded flash equals the unsharded plain model, and each flash control that applies
    is detected (the segments' with the mask, the window's without: the proof's documents are shorter
    than the window)."""
    from meshlm.proof import format_report, model_problem, verify
    from meshlm.proof.flash_controls import FLASH_CONTROLS

    cfg = get_config("tiny-mistral-w10").replace(attention="flash", doc_mask=doc_mask, n_layers=1)
    problem = model_problem(cfg, "tiny-mistral-w10", Layout(mp=2), batch_size=1, seq_len=16)
    report = verify(problem, Layout(mp=2), controls=FLASH_CONTROLS)
    assert report.ok, format_report(report)
    names = [
        "flash mask sees the next key",
        "flash document segments ignored" if doc_mask >= 0 else "flash window one key wider",
    ]
    assert [c["name"] for c in report.controls] == names
    assert all(c["detected"] and c["margin"] > 10 for c in report.controls), report.controls


# slow: the cp ring's flash block under verify (its cost: ~30 s in interpret mode); the ring's flash
# block equal to plain: test_flash_ring_equals_the_unsharded_plain_model (slow), the ring: tests/test_cp.py
@pytest.mark.slow
def test_verify_proves_the_flash_ring_with_its_control_detected():
    """``meshlm verify --attention flash --cp 2`` (the ring, float32): the sharded program equals the
    unsharded plain model, and the ring's own control (its diagonal chunk pair unmasked) is detected;
    the whole-sequence kernel's controls do not apply under cp (the ring runs its chunk pairs)."""
    from meshlm.proof import format_report, model_problem, verify
    from meshlm.proof.flash_controls import FLASH_CONTROLS

    cfg = get_config("tiny-gqa").replace(attention="flash", n_layers=1)
    layout = Layout(cp=2)
    problem = model_problem(cfg, "tiny-gqa", layout, batch_size=1, seq_len=16)
    report = verify(problem, layout, controls=FLASH_CONTROLS)
    assert report.ok, format_report(report)
    assert [c["name"] for c in report.controls] == ["flash ring's own chunk fully visible"]
    assert all(c["detected"] and c["margin"] > 10 for c in report.controls), report.controls


# slow: flash through the pp 2 x mp 2 pipeline (its cost); the kernel inside shard_map:
# test_verify_proves_flash_with_its_controls_detected, quick; the pipeline: tests/test_pipeline.py
@pytest.mark.slow
def test_flash_through_the_pipeline_equals_the_unsharded_plain_model():
    """--pp 2 x --mp 2 (1F1B, NaN in every bubble) with the document mask: the stages' layers run the
    flash kernel; loss and every gradient equal the unsharded plain model's in float32."""
    from meshlm.model.transformer import init_fn, loss_fn
    from meshlm.sharding.pipelined import pipelined_value_and_grad
    from meshlm.sharding.rules import model_specs
    from meshlm.sharding.spmd import reference_value_and_grad

    layout = Layout(pp=2, mp=2, microbatches=2, pp_schedule="1f1b")
    plain = get_config("tiny-llama").replace(doc_mask=3)
    flash = plain.replace(attention="flash")
    tokens = jax.random.randint(jax.random.PRNGKey(1), (4, 17), 0, 8)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    params = init_fn(plain)[0](jax.random.PRNGKey(0), batch)
    with jax.default_matmul_precision("highest"):
        want = jax.jit(reference_value_and_grad(lambda par: loss_fn(plain, par)))(params, batch)
        fn = pipelined_value_and_grad(flash, layout, model_specs(flash, params, layout), fill=float("nan"))
        got = jax.jit(fn)(params, batch)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert rel_err(g, w) < 1e-4, (g, w)


# slow: gpt-oss's sinks and layer kinds through the whole model (its cost); the kernel's sinks:
# test_flash_sinks, quick; the traced window of a layer kind: test_flash_traced_window, quick
@pytest.mark.slow
def test_flash_model_equals_plain_with_sinks_and_layer_kinds():
    """tiny-gpt-oss (2 layers: a local one with a window of 8 and a global one in one layer loop, learned
    sinks): the flash model's loss and every gradient equal the plain model's, float32."""
    import haiku as hk

    from meshlm.model.transformer import init_fn, loss_fn

    plain = get_config("tiny-gpt-oss").replace(n_layers=2)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (1, 25), 0, 64)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    params = init_fn(plain)[0](jax.random.PRNGKey(0), batch)

    def value_and_grad(cfg):
        apply = hk.transform(loss_fn(cfg, Parallel())).apply
        with jax.default_matmul_precision("highest"):
            return jax.jit(jax.value_and_grad(lambda p: apply(p, None, batch)))(params)

    got, want = value_and_grad(plain.replace(attention="flash")), value_and_grad(plain)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert rel_err(g, w) < TOL


def test_flash_ring_backward_equals_plain_gradients():
    """The cp ring's flash backward (``flash_ring.flash_partial_grads``) on one shard's zigzag chunks
    (0 and 3 of 4) against its own K/V set, outside any mesh: the pairs take every mask (own chunk:
    causal; an earlier one: full; a later one: none). Its dq, dk, dv equal plain attention's autodiff.
    Catches what only the slow ring proof did (issue 66): the own chunk's backward with the full mask,
    dq without the folded 1/sqrt(E)."""
    from meshlm.model.flash_ring import flash_partial_grads

    b, c, h, kh, e = 1, 8, 2, 1, 16
    q, k, v, dout = inputs(b, 2 * c, h, kh, e)
    pos = jnp.asarray(np.concatenate([np.arange(c), np.arange(3 * c, 4 * c)])[None], jnp.int32)

    def plain(q, k, v):  # [B, 2c, H, E], lse [B, 2c, H]
        s = jnp.einsum("bqhe,bkhe->bhqk", q, jnp.repeat(k, h // kh, 2)) / np.sqrt(e)
        s = jnp.where(pos[:, None, None, :] <= pos[:, None, :, None], s, -jnp.inf)
        lse = jax.nn.logsumexp(s, -1)
        p = jnp.exp(s - lse[..., None])
        return jnp.einsum("bhqk,bkhe->bqhe", p, jnp.repeat(v, h // kh, 2)), jnp.swapaxes(lse, 1, 2)

    with jax.default_matmul_precision("highest"):
        (out, lse), vjp = jax.vjp(plain, q, k, v)
        want = vjp((dout, jnp.zeros_like(lse)))
        got = jax.jit(lambda *a: flash_partial_grads(*a, variant=Variant()))(
            q, k, v, pos, pos, out, lse, dout
        )
    for name, g, w in zip("qkv", got, want, strict=True):
        assert rel_err(g, w) < TOL, (f"d{name}", rel_err(g, w))
