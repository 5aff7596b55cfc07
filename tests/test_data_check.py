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


def test_val_bpb_of_a_bpe_run_by_hand(tmp_path):
    """meshlm's val_bpb for a BPE tokenizer against a count by hand: the per-target losses of the
    unsharded model, in bits, over the targets' UTF-8 bytes (multi-byte characters included), the
    end-of-document id counting one byte (as the byte tokenizer's NUL) and other specials none."""
    import haiku as hk
    import jax

    from meshlm.model.transformer import logits_fn
    from meshlm.parallel.context import Parallel
    from meshlm.parallel.placement import to_host
    from meshlm.train.config import TrainConfig
    from meshlm.train.loop import evaluate
    from meshlm.train.run import build_run

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
    n_bytes = lambda i: (1 if i == tok.eod_id else 0) if i in specials else len(vocab[i])
    assert all(c in byte_of for i, s in vocab.items() if i not in specials for c in s)

    apply = hk.transform(logits_fn(run.cfg, Parallel())).apply
    params = jax.tree.map(to_host, run.params)
    loss_sum, byte_sum, eods, multibyte = 0.0, 0, 0, 0
    for b in run.val:
        inputs, targets = to_host(b["inputs"]), to_host(b["targets"])
        logp = jax.nn.log_softmax(np.asarray(apply(params, None, inputs), np.float64), axis=-1)
        loss_sum -= float(np.take_along_axis(logp, targets[..., None], axis=-1).sum())
        byte_sum += sum(n_bytes(int(i)) for i in targets.reshape(-1))
        eods += int((targets == tok.eod_id).sum())
        multibyte += sum(
            any(byte_of[c] >= 0x80 for c in vocab[int(i)])
            for i in targets.reshape(-1)
            if int(i) not in specials
        )
    assert eods > 0 and multibyte > 0  # the count covers both rules
    want = loss_sum / math.log(2) / byte_sum
    assert row["val_bpb"] == pytest.approx(want, rel=1e-5), (row, want)
