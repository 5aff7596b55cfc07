"""Document-masked packing (``--doc-mask``): attention never crosses an end-of-document token inside a
window and positions restart at each document, so the per-token losses of a packed window equal those
of its documents run one by one through the plain model (float64, 1e-12: a check independent of the
mask's code); ``verify --doc-mask``'s proof passes on EOD-rich batches with its controls detected, and
fails when the mask changes nothing; ``train --doc-mask`` records it in the checkpoint's model config."""

from __future__ import annotations

import haiku as hk
import jax
import numpy as np
import pytest
from helpers import run_cli, write_corpus

from meshlm.errors import ConfigError
from meshlm.io.model_io import read_config
from meshlm.model import attention, blockwise, transformer
from meshlm.model.blockwise import blockwise_attention
from meshlm.model.config import get_config
from meshlm.model.layers import mask_vocab_padding, vocab_parallel_xent
from meshlm.model.transformer import init_fn, local_logits, loss_fn
from meshlm.parallel.context import Parallel
from meshlm.parallel.layout import Layout
from meshlm.proof import format_report, model_problem, verify
from meshlm.proof.controls import CONTROLS
from meshlm.proof.documents import document_batch

EOD = 0


def _per_token(cfg):
    def per_token(inputs, targets):
        par = Parallel()
        logits, _ = local_logits(cfg, par, inputs)
        return vocab_parallel_xent(par, mask_vocab_padding(par, logits, cfg.vocab_size), targets)

    return jax.jit(hk.without_apply_rng(hk.transform(per_token)).apply)


def _packed(rng, lengths: list[int], vocab: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """(stream of T + 1 tokens: a window starting inside its first document, the documents separated
    by EOD, one token after the window; the documents' token lists)."""
    docs = [rng.integers(1, vocab, n) for n in lengths]
    stream = [docs[0]] + [p for d in docs[1:] for p in (np.array([EOD]), d)] + [rng.integers(1, vocab, 1)]
    return np.concatenate(stream), docs


def _one_by_one(plain, params, stream: np.ndarray, docs: list[np.ndarray]) -> np.ndarray:
    """Each document alone through the plain (unmasked) model: its inputs from the EOD before it (the
    first one from the window start), its targets up to the token after it. One row per document,
    padded at the end (a causal model's earlier positions never see the padding)."""
    t = len(stream) - 1
    x, y, spans, lo = np.zeros((3, t), np.int64), np.zeros((3, t), np.int64), [], 0
    for row, d in enumerate(docs):
        hi = lo + len(d) + (lo > 0)  # the EOD before it, then the document
        x[row, : hi - lo], y[row, : hi - lo] = stream[lo:hi], stream[lo + 1 : hi + 1]
        spans.append(hi - lo)
        lo = hi
    losses = np.asarray(plain(params, x, y))
    return np.concatenate([losses[row, :n] for row, n in enumerate(spans)])


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gptj"])
def test_packed_window_equals_documents_one_by_one(preset):
    with jax.enable_x64(True):
        cfg = get_config(preset)
        masked, plain = _per_token(cfg.replace(doc_mask=EOD)), _per_token(cfg)
        init, example = init_fn(cfg)
        params = jax.tree.map(lambda p: p.astype(np.float64), init(jax.random.PRNGKey(0), example))
        rng = np.random.default_rng(0)
        for lengths in ([5, 7, 4], [1, 1, 14], [18]):  # windows of 18 tokens
            stream, docs = _packed(rng, lengths, cfg.vocab_size)
            got = np.asarray(masked(params, stream[None, :-1], stream[None, 1:]))[0]
            want = _one_by_one(plain, params, stream, docs)
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
            unmasked = np.asarray(plain(params, stream[None, :-1], stream[None, 1:]))[0]
            if len(docs) > 1:  # the control: without the mask, later documents see earlier ones
                assert np.max(np.abs(unmasked - want) / want) > 1e-3


def test_document_batch_is_eod_rich_and_deterministic():
    batch = document_batch(64, EOD, (4, 32), seed=1)
    inputs = batch["inputs"]
    assert inputs.shape == (4, 32) and np.array_equal(inputs[:, 1:], batch["targets"][:, :-1])
    assert ((inputs == EOD).sum(axis=1) >= 3).all()  # several documents in every row
    assert len({tuple(np.flatnonzero(r == EOD)) for r in inputs}) == 4  # boundaries differ per row
    assert np.array_equal(inputs, document_batch(64, EOD, (4, 32), seed=1)["inputs"])
    assert document_batch(64, EOD, (2, 3, 8), seed=1)["inputs"].shape == (2, 3, 8)  # accumulation


LAYOUT = Layout(dp=2, mp=2, fsdp=True, sp=True)
DOC_CONTROLS = tuple(c for c in CONTROLS if c.name.startswith("document mask"))


@pytest.fixture(scope="module")
def doc_problem():
    cfg = get_config("tiny-llama").replace(doc_mask=EOD)
    return model_problem(cfg, "tiny-llama", LAYOUT, batch_size=4, seq_len=16)


def test_verify_doc_mask_passes_and_its_controls_are_detected(doc_problem):
    """``meshlm verify --doc-mask``'s proof on 2x2 with FSDP and SP, float64: sharded == unsharded
    on EOD-rich batches, and each planted mask fault (and the mask switched off) is detected."""
    with jax.enable_x64(True):
        report = verify(doc_problem, LAYOUT, dtype=np.float64, controls=DOC_CONTROLS)
    assert report.ok, format_report(report)
    assert max(p.max_rel_err for p in report.params) <= 1e-12
    assert [c["name"] for c in report.controls] == [c.name for c in DOC_CONTROLS]
    for c in report.controls:
        assert c["detected"] and c["margin"] > 1e6, c  # far beyond the tolerance


def test_verify_doc_mask_fails_when_the_mask_changes_nothing(doc_problem, monkeypatch):
    """The planted bug: the model's mask does nothing (every document starts at 0). Sharded still
    equals unsharded, but the control *document mask off* is not detected, so the proof fails."""
    monkeypatch.setattr(transformer, "doc_starts", lambda tokens, eod: jax.numpy.zeros_like(tokens))
    off = tuple(c for c in DOC_CONTROLS if "off" in c.name)
    with jax.enable_x64(True):
        report = verify(doc_problem, LAYOUT, dtype=np.float64, controls=off)
    assert report.loss_ok and not report.ok
    assert report.controls[0]["detected"] is False


def test_doc_mask_config_is_checked(capsys):
    with pytest.raises(ConfigError, match="doc_mask=.* needs attention"):
        get_config("tiny").replace(doc_mask=0)  # the ff family has no attention
    with pytest.raises(ConfigError, match="doc_mask=64 needs attention and an id below vocab_size"):
        get_config("tiny-llama").replace(doc_mask=64)
    assert run_cli("verify", "--config", "tiny", "--mesh", "1x1", "--doc-mask") == 2  # before any proof
    assert "doc_mask=0 needs attention" in capsys.readouterr().err


def test_train_doc_mask_is_recorded_in_the_checkpoint(tmp_path, capsys):
    (tmp_path / "c").mkdir()
    out = tmp_path / "run"
    argv = ["train", "--data", write_corpus(tmp_path / "c"), "--config", "tiny-lm", "--steps", "1"]
    argv += ["--batch-size", "2", "--seq-len", "16", "--eval-batches", "1", "--sample-tokens", "4"]
    argv += ["--mesh", "1x2", "--doc-mask", "--out", str(out)]
    assert run_cli(*argv) == 0, capsys.readouterr().err
    assert read_config(out)[0].doc_mask == EOD  # the byte tokenizer's EOD
    assert run_cli(*argv[:-3], "--out", str(out)) == 2  # resuming without it is refused
    assert "doc_mask: saved True, now False" in capsys.readouterr().err


# ---- blockwise (flash) attention with the document mask ----


def _blockwise_vs_plain(starts, q, k, v, ct, block=8):
    """The worst relative error of blockwise attention with document starts against the plain
    softmax with the same mask: output and the gradients by q, k, v (float64)."""
    pos = jax.numpy.broadcast_to(jax.numpy.arange(q.shape[1]), q.shape[:2])

    def value_and_grads(fn):
        def both(q, k, v):
            out, vjp = jax.vjp(fn, q, k, v)
            return (out, *vjp(ct))

        return jax.jit(both)(q, k, v)

    want = value_and_grads(lambda q, k, v: attention._attend(q, k, v, pos, pos, starts))
    got = value_and_grads(lambda q, k, v: blockwise_attention(q, k, v, pos, pos, block=block, q_start=starts))
    return max(float(np.max(np.abs(g - w)) / np.max(np.abs(w))) for g, w in zip(got, want, strict=True))


def _qkv(b, t, h, kh, e):
    r = np.random.default_rng(0)
    shapes = ((b, t, h, e), (b, t, kh, e), (b, t, kh, e), (b, t, h, e))
    return [jax.numpy.asarray(r.normal(size=s)) for s in shapes]


def test_blockwise_document_mask_equals_plain_and_a_mask_ignored_in_blocks_is_caught(monkeypatch):
    """GQA 6:2, 37 tokens (a ragged last block) in blocks of 8, several documents per row."""
    with jax.enable_x64(True):
        q, k, v, ct = _qkv(2, 37, 6, 2, 5)
        starts = attention.doc_starts(jax.numpy.asarray(document_batch(64, EOD, (2, 37), 3)["inputs"]), EOD)
        assert _blockwise_vs_plain(starts, q, k, v, ct) <= 1e-12
        visible = blockwise._visible
        monkeypatch.setattr(
            blockwise, "_visible", lambda qp, kp, kv, causal, qs=None: visible(qp, kp, kv, causal)
        )
        assert _blockwise_vs_plain(starts, q, k, v, ct) > 1e-3  # the planted bug: blocks ignore the mask


def test_blockwise_skips_blocks_before_the_documents():
    """Keys 0..15 NaN, one document boundary at 16: queries from 16 on never read those blocks (plain
    attention, masking after the product, turns NaN there)."""
    with jax.enable_x64(True):
        q, k, v, ct = _qkv(1, 32, 2, 2, 4)
        k, v = k.at[:, :16].set(jax.numpy.nan), v.at[:, :16].set(jax.numpy.nan)
        starts = jax.numpy.where(jax.numpy.arange(32) >= 16, 16, 0)[None]
        pos = jax.numpy.arange(32)[None]
        assert bool(jax.numpy.all(jax.numpy.isnan(attention._attend(q, k, v, pos, pos, starts)[:, 16:])))
        out = blockwise_attention(q, k, v, pos, pos, block=8, q_start=starts)
        assert bool(jax.numpy.all(jax.numpy.isfinite(out[:, 16:])))


# slow: the whole model with the mask in the blockwise kernel (its cost); the kernel's mask:
# test_blockwise_document_mask_equals_plain_and_a_mask_ignored_in_blocks_is_caught, quick
@pytest.mark.slow
def test_blockwise_model_with_the_mask_equals_plain():
    """tiny-gqa with --doc-mask, 64 tokens in blocks of 16 on EOD-rich rows: loss and every gradient of
    the blockwise model equal the plain one's (float64, 1e-12)."""
    plain = get_config("tiny-gqa").replace(vocab_multiple=1, doc_mask=EOD)
    blocky = plain.replace(attention="blockwise", attn_block=16)
    with jax.enable_x64(True):
        batch = document_batch(plain.vocab_size, EOD, (2, 64), 0)
        init, _ = init_fn(plain)
        params = jax.tree.map(lambda p: p.astype(np.float64), init(jax.random.PRNGKey(0), batch))

        def grads(cfg):
            f = hk.without_apply_rng(hk.transform(loss_fn(cfg, Parallel()))).apply
            return jax.jit(jax.value_and_grad(f))(params, batch)

        (lp, gp), (lb, gb) = grads(plain), grads(blocky)
        errs = [abs(float(lb - lp)) / abs(float(lp))]
        for b, p in zip(jax.tree.leaves(gb), jax.tree.leaves(gp), strict=True):
            errs.append(float(np.max(np.abs(b - p)) / np.max(np.abs(p))))
        assert len(errs) == len(jax.tree.leaves(params)) + 1 and max(errs) <= 1e-12
