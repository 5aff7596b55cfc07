"""Chat SFT data: ``data prepare --chat`` renders conversations with the tokenizer's chat template into
ids and a loss mask equal to transformers' ``apply_chat_template(..., return_assistant_tokens_mask=True)``
(a template with {% generation %} markers), finds the same spans by rendering prefixes on a template
without them, refuses a template whose spans cannot be found, and packs rows whose batches carry the
targets' mask."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from meshlm.data.chat import ChatTemplate, conversation
from meshlm.data.chat_store import Packer, load_template, prepare_chat
from meshlm.data.store import open_store
from meshlm.data.stream import Batcher
from meshlm.errors import DataError

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "chat"
CONVERSATIONS = EXAMPLES / "conversations.jsonl"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def rows() -> list[dict]:
    return [json.loads(line) for line in CONVERSATIONS.read_text().splitlines()]


def chat_tokenizer_dir(out: Path, template: str | None) -> Path:
    """A Qwen3-style tokenizer directory saved by transformers (ChatML specials, ``<|im_end|>`` its eos,
    ``<|endoftext|>`` its pad), a byte-level BPE trained here on the bundled conversations (no network)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [m["content"] for r in rows() for m in conversation(r, "row")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("chat")
    return {
        name: chat_tokenizer_dir(base / name, (EXAMPLES / f"{name}.jinja").read_text())
        for name in ("chatml_generation", "chatml")
    }


def test_masks_equal_transformers_assistant_mask(dirs):
    """Generation markers: the mask is transformers' own; without them (prefix rendering): the same."""
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(dirs["chatml_generation"])
    ours = {name: load_template(d) for name, d in dirs.items()}
    assert ours["chatml_generation"].has_generation and not ours["chatml"].has_generation
    for i, row in enumerate(rows()):
        messages = conversation(row, f"row {i}")
        want = hf.apply_chat_template(
            messages, tokenize=True, return_assistant_tokens_mask=True, return_dict=True
        )
        for name, template in ours.items():
            ids, mask = template.encode(messages)
            assert ids.tolist() == list(want["input_ids"]), (name, i)
            assert mask.tolist() == list(want["assistant_masks"]), (name, i)
            assert 0 < mask.sum() < len(mask)  # never silently all ones


def test_train_on_last_and_all(dirs):
    template = load_template(dirs["chatml"])
    messages = next(conversation(r, "row") for r in rows() if len(r.get("messages", [])) == 5)  # 2 turns
    _, every = template.encode(messages)
    _, last = template.encode(messages, "last")
    _, whole = template.encode(messages, "all")
    assert whole.all() and 0 < last.sum() < every.sum()
    dropped = np.flatnonzero(every != last)  # the first turn's tokens only: all before the last turn
    assert (last <= every).all() and dropped.max() < np.flatnonzero(last).min()


def test_template_without_findable_spans_is_one_error(dirs):
    """A template that renders earlier turns differently once more follow (here: numbering turns from
    the end) has no prefix spans: a clear error naming the fix, never a mask of all ones."""
    from meshlm.data.tokenizer_files import load_tokenizer

    text = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ messages|length - loop.index }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant 0\n{% endif %}"
    )
    tok = load_tokenizer(dirs["chatml"] / "tokenizer.json")
    with pytest.raises(DataError, match="generation %}.*--train-on all"):
        ChatTemplate(text, tok).encode(conversation(rows()[0], "row"))
    with pytest.raises(DataError, match="no assistant turn"):
        load_template(dirs["chatml"]).encode([{"role": "user", "content": "hi"}])
    with pytest.raises(DataError, match="not a conversation"):
        conversation({"text": "plain"}, "row 3")


def test_packing_rule_counts_overlong():
    packer = Packer(6, eod=0, overlong="truncate")
    packer.add(np.array([5, 6]), np.array([0, 1], np.uint8))  # 3 with EOD
    packer.add(np.array([7, 8]), np.array([0, 1], np.uint8))  # fits: 6
    packer.add(np.arange(1, 10), np.array([0, 0, 0, 0, 0, 0, 1, 1, 1], np.uint8))  # cut keeps no 1
    packer.add(np.arange(1, 10), np.array([0, 1, 0, 0, 0, 0, 0, 0, 0], np.uint8))  # cut to 6
    packer.flush()
    assert (packer.conversations, packer.dropped, packer.truncated) == (3, 1, 1)
    assert [r[0].tolist() for r in packer.rows] == [[5, 6, 0, 7, 8, 0], [1, 2, 3, 4, 5, 6]]
    assert [r[1].tolist() for r in packer.rows] == [[0, 1, 0, 0, 1, 0], [0, 1, 0, 0, 0, 0]]
    drop = Packer(6, eod=0, overlong="drop")
    drop.add(np.arange(1, 10), np.ones(9, np.uint8))
    assert (drop.conversations, drop.dropped) == (0, 1)


def test_store_batches_carry_the_targets_mask(dirs, tmp_path):
    template = load_template(dirs["chatml"])
    index = prepare_chat([CONVERSATIONS], template, tmp_path / "s", seq_len=48, val_fraction=0.2)
    train = index["splits"]["train"]
    assert train["conversations"] + index["splits"]["val"]["conversations"] + train["dropped"] + index[
        "splits"
    ]["val"]["dropped"] == len(rows())
    stream = open_store(tmp_path / "s").stream("train")
    assert stream.row_len == 49 and int(stream.loss_mask.sum()) == train["masked_tokens"]
    batcher = Batcher(stream, 48, 4, seed=1)
    b = batcher.batch(0)
    assert set(b) == {"inputs", "targets", "loss_mask"} and b["loss_mask"].shape == (4, 48)
    for r, o in enumerate(batcher.offsets(0)):  # whole rows; the mask is the targets' (shifted by one)
        assert o % 49 == 0
        assert b["loss_mask"][r].tolist() == stream.loss_mask[o + 1 : o + 49].tolist()
    with pytest.raises(DataError, match="train with --seq-len 48"):
        Batcher(stream, 32, 4)
    (tmp_path / "s" / "train.mask").write_bytes(b"\1" * train["tokens"])
    with pytest.raises(DataError, match="train.mask does not match"):
        open_store(tmp_path / "s")


def test_eval_reports_the_masked_loss(dirs, tmp_path):
    """``meshlm eval``'s loss on a chat store: the mean of the per-target losses where the mask is 1
    (the same stream without its mask gives every target's loss, in order)."""
    import jax

    from meshlm.data.stream import TokenStream
    from meshlm.model.config import get_config
    from meshlm.train.evaluation import evaluate_stream
    from meshlm.train.step import init_model

    tok = load_template(dirs["chatml"]).tok
    prepare_chat([CONVERSATIONS], load_template(dirs["chatml"]), tmp_path / "s", seq_len=48)
    stream = open_store(tmp_path / "s").stream("train")
    cfg = get_config("tiny-lm").replace(vocab_size=tok.vocab_size)
    mesh = jax.make_mesh((1, 1), ("dp", "mp"), devices=jax.devices()[:1])
    params, _ = init_model(cfg, mesh, seed=0)
    kw = dict(seq_len=16, batch_size=4, keep_per_token=True, progress=False)
    masked_result = evaluate_stream(cfg, params, mesh, stream, tok, **kw)
    plain = TokenStream(np.asarray(stream.tokens), vocab_size=tok.vocab_size, eod_id=tok.eod_id)
    every = evaluate_stream(cfg, params, mesh, plain, tok, **kw).per_token
    trained = np.asarray(stream.loss_mask, bool)
    assert masked_result.tokens == int(trained.sum()) < len(every)
    np.testing.assert_allclose(masked_result.loss, every[trained].mean(), rtol=1e-6)
    assert abs(masked_result.loss - every.mean()) > 1e-3  # the mask changes the number


def test_train_validation_loss_on_a_chat_store_is_the_masked_loss(dirs, tmp_path):
    """The validation loss ``meshlm train`` logs on a chat store: Σ(mask · loss) / Σ mask over all of
    its validation batches (not every target's mean), from each target's loss computed apart."""
    from meshlm.parallel.mesh import make_mesh
    from meshlm.train.config import TrainConfig
    from meshlm.train.evaluation import per_token_loss_fn
    from meshlm.train.loop import evaluate
    from meshlm.train.run import build_run

    prepare_chat([CONVERSATIONS], load_template(dirs["chatml"]), tmp_path / "s", seq_len=48, val_fraction=0.3)
    tcfg = TrainConfig(
        config="tiny-lm", data=(str(tmp_path / "s"),), tokenizer=str(tmp_path / "s" / "tokenizer.json"),
        seq_len=48, batch_size=4, eval_batches=3, sample_tokens=0, out=str(tmp_path / "run"),
    )  # fmt: skip
    run = build_run(tcfg, make_mesh(2, 1))
    per_token = per_token_loss_fn(run.cfg, run.layout, run.params)
    losses = np.concatenate([np.asarray(per_token(run.params, b)) for b in run.val])
    mask = np.concatenate([np.asarray(b["loss_mask"]) for b in run.val]).astype(bool)
    got = evaluate(run)["val_loss"]
    run.release()
    np.testing.assert_allclose(got, losses[mask].mean(), rtol=1e-5)
    assert abs(got - losses.mean()) > 1e-3  # the mask changes the number


# The SFT proof on 2x2 is quick; on FSDP + SP, pp and cp it is slow: the same proof on more layouts (its
# cost is its scale), each layout's own bug class proven quick in its axis's proof.
@pytest.mark.parametrize(
    "layout",
    [
        dict(dp=2, mp=2),
        pytest.param(dict(dp=2, mp=2, fsdp=True, sp=True), marks=pytest.mark.slow),
        pytest.param(dict(dp=1, mp=2, pp=2, microbatches=4), marks=pytest.mark.slow),
        pytest.param(dict(dp=1, mp=2, cp=2), marks=pytest.mark.slow),
    ],
)
def test_verify_sft_loss_equal_unsharded_and_its_controls_detected(layout):
    """``meshlm verify --objective sft``'s proof, float64: the masked loss and every gradient equal the
    unsharded run's on 2x2, with FSDP + SP, and through a pipeline of 4 micro-batches whose mask counts
    differ, and under cp 2; both SFT controls (the mask after the mean; the loss divided per
    micro-batch / shard: the mean of per-part means) are detected."""
    import jax

    from meshlm.model.config import get_config
    from meshlm.parallel.layout import Layout
    from meshlm.proof import format_report, model_problem, verify
    from meshlm.proof.sft import SFT_CONTROLS, sft_mask, sft_problem

    lay = Layout(**layout)
    cfg = get_config("tiny-llama")
    rows = 2 * lay.dp * lay.pipeline_microbatches
    problem = sft_problem(model_problem(cfg, "tiny-llama", lay, rows, 16))
    counts = problem.batch["loss_mask"].sum(axis=1)
    assert len(set(counts.tolist())) == rows and 0 < counts.min() and counts.max() < 16
    assert sft_mask((3, 16), 0).tolist() == sft_mask((3, 16), 0).tolist()
    with jax.enable_x64(True):
        # under pp the pipeline's controls on what SFT changes: the masked loss's and the gradients' sum over
        # micro-batches (its schedule faults are the engine's alone: tests/test_pp_verify.py)
        faults = ("one micro-batch's gradient dropped", "loss not divided by M")
        report = verify(problem, lay, dtype=np.float64, controls=SFT_CONTROLS, pipeline_faults=faults)
    assert report.ok, format_report(report)
    assert max(p.max_rel_err for p in report.params) <= 1e-12
    names = [c["name"] for c in report.controls]
    assert all(c.name in names for c in SFT_CONTROLS), names
    for c in report.controls:
        assert c["detected"], c
