"""The proof's data-pipeline check on its own batch (>= 3 rows per data shard per micro-batch), and
``val_bpb`` for a BPE tokenizer computed by hand: sum of target losses / ln 2 / the targets' UTF-8
bytes, the end-of-document id counted as one byte."""

import math

import numpy as np
import pytest

from meshlm.data import device_batches
from meshlm.model.config import get_config
from meshlm.parallel.mesh import make_mesh
from meshlm.proof import model_problem, verify
from meshlm.proof.data_pipeline import ROWS_PER_SHARD


def _rows_row_major(batcher, step, rows, total, accum, cache):
    """The wrong reshape: a shard's rows taken micro-batch after micro-batch, not interleaved."""
    start, stop = rows.start or 0, total if rows.stop is None else rows.stop
    width = stop - start
    if (start, width) not in cache:
        b = batcher.batch(step, shard=start // width, num_shards=total // width)
        cache[(start, width)] = {k: v.reshape(accum, width, -1) for k, v in b.items()}
    return cache[(start, width)]


@pytest.mark.parametrize(("dp", "mp"), [(2, 1), (1, 2)])
def test_verify_data_check_catches_a_wrong_accumulation_reshape(monkeypatch, dp, mp):
    """verify's own batch is 2 x dp rows (one row per shard per micro-batch), where the wrong reshape
    and the right one agree: the data check must use its own, larger batch."""
    monkeypatch.setattr(device_batches, "_rows", _rows_row_major)
    problem = model_problem(get_config("tiny"), "tiny", mp, 2 * dp, 8, dp=dp)
    report = verify(problem, make_mesh(dp, mp), controls=(), data_steps=2)
    rows = {c["name"]: c for c in report.checks if c["name"].startswith("data pipeline")}
    assert rows["data pipeline (accumulation 1)"]["ok"]  # one micro-batch: no reshape to get wrong
    assert not rows["data pipeline (accumulation 2)"]["ok"] and not report.ok
    assert f"of {ROWS_PER_SHARD * 2 * dp} x 8" in rows["data pipeline (accumulation 1)"]["detail"]


def _gpt2_byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet (its published ``bytes_to_unicode``), inverted: char -> byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


TEXT = "# café, naïve, 日本語, emoji 🚀\ndef f(x):\n    return x * 2  # ünïcödé\n"


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    """(a run with a 300-id byte-level BPE trained on multi-byte text, its val_bpb row, a byte count by
    hand: id -> UTF-8 bytes, from the tokenizer's vocabulary through GPT-2's byte-level alphabet)."""
    from meshlm.train.config import TrainConfig
    from meshlm.train.loop import evaluate
    from meshlm.train.run import build_run

    tmp_path = tmp_path_factory.mktemp("bpb")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(120):  # short documents: several end-of-document ids in the validation targets
        (corpus / f"f{i}.py").write_text(TEXT.replace("f(", f"g{i}("))
    tcfg = TrainConfig(
        config="tiny-lm",
        data=(str(corpus),),
        steps=1,
        batch_size=4,
        seq_len=16,
        warmup_steps=1,
        eval_every=0,
        eval_batches=4,
        save_every=0,
        sample_tokens=0,
        tokenizer="bpe-300",
        out=str(tmp_path / "run"),
    )
    run = build_run(tcfg, make_mesh(1, 2))
    try:
        row = evaluate(run)
    finally:
        run.release()
    tok = run.tokenizer
    vocab = {i: s for s, i in tok.tok.get_vocab(with_added_tokens=True).items()}
    byte_of = _gpt2_byte_of_char()
    specials = set(tok.specials.values())
    assert all(c in byte_of for i, s in vocab.items() if i not in specials for c in s)
    n_bytes = {i: (1 if i == tok.eod_id else 0) if i in specials else len(s) for i, s in vocab.items()}
    return run, row, n_bytes


def _host_logits(run):
    """The unsharded model's logits (float64 numpy) of ``run``'s parameters: tokens [B, T] -> [B, T, V]."""
    import haiku as hk
    import jax

    from meshlm.model.transformer import logits_fn
    from meshlm.parallel.context import Parallel
    from meshlm.parallel.placement import to_host

    apply = hk.transform(logits_fn(run.cfg, Parallel())).apply
    params = jax.tree.map(to_host, run.params)
    return lambda tokens: np.asarray(apply(params, None, np.asarray(tokens)), np.float64)


def _nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log p(target) per position, from the logits by hand (numpy, float64)."""
    top = logits.max(axis=-1, keepdims=True)
    log_z = top[..., 0] + np.log(np.exp(logits - top).sum(axis=-1))
    return log_z - np.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]


def test_val_bpb_of_a_bpe_run_by_hand(bpe_run):
    """meshlm's val_bpb for a BPE tokenizer against a count by hand: the per-target losses of the
    unsharded model, in bits, over the targets' UTF-8 bytes (multi-byte characters included), the
    end-of-document id counting one byte (as the byte tokenizer's NUL) and other specials none."""
    from meshlm.parallel.placement import to_host

    run, row, n_bytes = bpe_run
    logits = _host_logits(run)
    loss_sum, byte_sum, input_bytes, eods, multibyte = 0.0, 0, 0, 0, 0
    for b in run.val:
        inputs, targets = to_host(b["inputs"]), to_host(b["targets"])
        loss_sum += float(_nll(logits(inputs), targets).sum())
        byte_sum += sum(n_bytes[int(i)] for i in targets.reshape(-1))
        input_bytes += sum(n_bytes[int(i)] for i in inputs.reshape(-1))
        eods += int((targets == run.tokenizer.eod_id).sum())
        multibyte += sum(n_bytes[int(i)] > 1 for i in targets.reshape(-1))
    assert eods > 0 and multibyte > 0  # the count covers both rules
    assert input_bytes != byte_sum  # counting the inputs' bytes instead gives another figure
    want = loss_sum / math.log(2) / byte_sum
    assert row["val_bpb"] == pytest.approx(want, rel=1e-5), (row, want)


def test_eval_bits_per_byte_by_hand(bpe_run):
    """``meshlm eval``'s bits per byte on a stream that does not end in EOD, cut into windows whose edges
    hold multi-byte tokens: the input and target bytes differ, in every window and in total, and the
    figure is the targets' (sum of -log2 p(target) / their UTF-8 bytes, recomputed here in numpy)."""
    from meshlm.data.stream import TokenStream
    from meshlm.train.evaluation import evaluate_stream

    run, _, n_bytes = bpe_run
    tok, seq = run.tokenizer, 8
    tokens = tok.encode(TEXT * 3).astype(np.int64)  # no EOD: the stream ends in the text's last token
    assert tok.eod_id not in tokens and n_bytes[int(tokens[-1])] == 1  # "\n": add a multi-byte ending
    tokens = np.concatenate([tokens, tok.encode(" 日本語")])
    n = len(tokens)
    assert n % seq and n_bytes[int(tokens[-1])] > 1
    result = evaluate_stream(
        run.cfg, run.params, run.layout, TokenStream(tokens, vocab_size=tok.vocab_size, eod_id=tok.eod_id),
        tok, seq_len=seq, batch_size=2, progress=False,
    )  # fmt: skip
    logits = _host_logits(run)
    shifted = np.concatenate([[tok.eod_id], tokens])  # window k: inputs [k T - 1, k T + T - 1), alone
    loss_sum, byte_sum, edges = 0.0, 0, 0
    for lo in range(0, n, seq):
        inputs, targets = shifted[lo : lo + seq], tokens[lo : lo + seq]
        inputs = inputs[: len(targets)]
        loss_sum += float(_nll(logits(inputs[None]), targets[None]).sum())
        byte_sum += sum(n_bytes[int(i)] for i in targets)
        edges += n_bytes[int(inputs[0])] != n_bytes[int(targets[-1])]  # the bytes this window's shift moves
    assert edges > n // seq // 2  # most windows: input and target bytes differ
    assert byte_sum == len((TEXT * 3 + " 日本語").encode())  # the targets are the whole text, once
    want = loss_sum / math.log(2) / byte_sum
    assert result.tokens == n and result.bytes == byte_sum, (result, byte_sum)
    assert result.bits_per_byte == pytest.approx(want, rel=1e-5), (result.bits_per_byte, want)
