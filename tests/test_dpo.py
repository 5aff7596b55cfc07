"""DPO: the loss equals trl's ``DPOTrainer`` loss on the same log-probs (sigmoid and IPO, float64, 1e-12);
pairs render by the stated rule; ``verify --objective dpo``'s proof (sums, loss, every gradient equal
to the unsharded autodiff on 2x2, FSDP + SP, pp 2 with 4 micro-batches, cp 2, each control detected);
``train --objective dpo`` on the bundled pairs learns on 2x2 and resumes bit for bit from its cache."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from helpers import eval_rows, train_rows

from meshlm.data.pairs import Renderer, encode_pairs, read_pairs
from meshlm.data.tokenizer import ByteTokenizer
from meshlm.errors import CheckpointError, ConfigError, DataError
from meshlm.proof import format_report

PAIRS = Path(__file__).resolve().parents[1] / "examples" / "dpo" / "pairs.jsonl"


def _trl_loss(policy, reference, mask, beta: float, loss: str) -> float:
    """trl's own ``DPOTrainer._compute_loss`` (trl 1.16) on per-target log-probs ``policy`` [2P, T]
    (0 off the completion, as its fused head gives them), the reference's sums [2P] and the targets'
    completion mask [2P, T]; trl's batch is [chosen..., rejected...]."""
    import torch
    from trl import DPOTrainer

    n = len(policy) // 2
    order = np.r_[0 : 2 * n : 2, 1 : 2 * n : 2]  # ours: rows 2i, 2i + 1 -> trl's halves
    per_token = torch.tensor(policy[order] * mask[order], dtype=torch.float64)
    completion = torch.tensor(np.pad(mask[order], ((0, 0), (1, 0))), dtype=torch.long)  # on input_ids
    zeros = torch.zeros_like(per_token)
    outputs = SimpleNamespace(
        log_probs=per_token, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool(), aux_loss=None
    )
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=SimpleNamespace(device="cpu", gather_for_metrics=lambda x: x, gather=lambda x: x),
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=[loss],
        loss_weights=[1.0],
        beta=beta,
        use_weighting=False,
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    ref = torch.tensor(reference[order], dtype=torch.float64)
    inputs = {
        "input_ids": torch.zeros_like(completion),
        "attention_mask": torch.ones_like(completion),
        "completion_mask": completion,
        "ref_chosen_logps": ref[:n],
        "ref_rejected_logps": ref[n:],
    }
    return float(DPOTrainer._compute_loss(trainer, lambda **kw: outputs, inputs, False))


@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_loss_equals_trls_dpo_trainer(loss):
    from meshlm.model import preference

    rng = np.random.default_rng(0)
    rows, t, beta = 8, 12, 0.3
    per_token = -rng.gamma(2.0, 1.0, (rows, t))
    mask = np.zeros((rows, t), np.uint8)
    for r in range(rows):
        start, end = sorted(rng.choice(np.arange(1, t + 1), 2, replace=False))
        mask[r, start - 1 : end] = 1  # lengths differ row by row: IPO's normaliser matters
    reference = (per_token * mask).sum(1) + rng.normal(0, 2.0, rows)
    with jax.enable_x64(True):
        policy = preference.sequence_logps(per_token, mask)
        ours = float(preference.dpo_loss(policy, reference, mask.sum(1), beta, loss))
    want = _trl_loss(per_token, reference, mask, beta, loss)
    assert abs(ours - want) <= 1e-12 * max(1.0, abs(want)), (ours, want)
    assert want > 0.05  # not a degenerate case


def test_pairs_render_by_the_plain_rule_and_drop_what_does_not_fit():
    tok = ByteTokenizer()
    records = read_pairs([PAIRS])
    train, val, dropped = encode_pairs(records, Renderer(tok), 48, tok.eod_id)
    assert (dropped, train.pairs + val.pairs) == (0, len(records)) and val.pairs >= 1
    ids = train.tokens[0]
    prompt = records[0][1]["prompt"] if train.pairs else ""
    completion = records[0][1]["chosen"].encode() + b"\0"  # the completion then EOD (0)
    # the first training pair's chosen row: prompt bytes, completion, EOD; the mask on its targets
    head = len(prompt.encode())
    assert bytes(ids[head : head + len(completion)].astype(np.uint8)) == completion
    assert train.mask[0].tolist() == [0] * (head - 1) + [1] * len(completion) + [0] * (
        48 - head + 1 - len(completion)
    )
    short = encode_pairs(records, Renderer(tok), 24, tok.eod_id)
    assert short[2] > 0  # the capital pairs no longer fit 24 bytes: dropped, counted
    with pytest.raises(DataError, match="at least 2 pairs"):
        encode_pairs(records, Renderer(tok), 8, tok.eod_id)


@pytest.mark.parametrize(
    ("layout", "rows", "accum"),
    # 2x2 quick (a pair across two data shards); the other layouts slow: the same proof on more layouts
    # (its cost is its scale), each layout's own bug class proven quick in its axis's proof
    [
        (dict(dp=2, mp=2), 6, 1),  # 3 rows a data shard: pair 1 sits across the two shards
        pytest.param(
            dict(dp=2, mp=2, fsdp=True, sp=True), 8, 2, marks=pytest.mark.slow
        ),  # --accum-steps 2: 2 pairs a micro-batch
        pytest.param(
            dict(dp=2, pp=2, microbatches=4), 8, 1, marks=pytest.mark.slow
        ),  # a row per data shard per micro-batch
        pytest.param(dict(dp=2, cp=2), 4, 1, marks=pytest.mark.slow),
    ],
    ids=["2x2", "fsdp-sp-accum2", "pp2-m4", "cp2"],
)
def test_verify_dpo_equal_unsharded_and_its_controls_detected(layout, rows, accum):
    """The proof in float64: chosen and rejected sums, the loss and every gradient within 1e-12 of the
    unsharded autodiff, also where a pair's rows sit in different data shards (the pairs meet on the
    global rows) and under gradient accumulation (the step's mean over its pairs, not per micro-batch);
    the three controls detected (and each changes the traced program), with accumulation a fourth: a
    pair's rows dealt to two micro-batches."""
    from meshlm.model.config import get_config
    from meshlm.parallel.layout import Layout
    from meshlm.proof.dpo import prove_dpo

    lay = Layout(**layout)
    with jax.enable_x64(True):
        report = prove_dpo(
            get_config("tiny-llama"), "tiny-llama", lay, rows, 16, dtype=np.float64, accum=accum
        )
    assert report.ok, format_report(report)
    # pretraining's report (issue 59): the sums and every gradient as leaves by path, the loss its own row
    leaves = {p.path: p for p in report.params}
    assert {"dpo/chosen", "dpo/rejected", "head/w"} <= set(leaves) and report.loss_ok
    assert max(p.max_abs_err for p in leaves.values()) > 0  # two programs: not the same numbers by chance
    assert len(report.controls) == 3 + (accum > 1), report.controls
    assert all(c["detected"] is True for c in report.controls), report.controls
    _assert_pretraining_schema(report.to_json())


def _assert_pretraining_schema(out: dict) -> None:
    """``verify --json``'s keys as pretraining's proof gives them."""
    assert out["ok"] is True and {"rtol", "atol"} <= set(out["tolerance"])
    assert {"sharded", "reference"} <= set(out["loss"])
    assert out["params"] and all({"path", "max_rel_err", "ok"} <= set(p) for p in out["params"])
    assert out["controls"] and all({"name", "detected"} <= set(c) for c in out["controls"])


# slow: its cost (two 2x2 float64 proofs with 2 AdamW steps each, ~30 CPU-s); DPO's loss and gradients:
# test_verify_dpo_equal_unsharded_and_its_controls_detected[2x2], quick; the train step's LoRA part:
# tests/test_lora.py::test_verify_lora_proves_k_adamw_steps_of_the_adapters_and_the_base_kept
@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", [0, 2])
def test_verify_dpo_proves_k_adamw_steps(lora_rank):
    """``verify --objective dpo --steps 2`` (issue 59): training's DPO step (2 micro-batches of whole
    pairs, the clip acting, AdamW) against the unsharded optax step on DPO's formula: every parameter and
    AdamW-state leaf within the tolerance after each step; with LoRA the adapters' alone, and the frozen
    base bitwise its start."""
    from meshlm.model import lora
    from meshlm.model.config import get_config
    from meshlm.parallel.layout import Layout
    from meshlm.proof.dpo import prove_dpo

    cfg = get_config("tiny-llama")
    if lora_rank:
        cfg = cfg.replace(lora_rank=lora_rank, lora_alpha=4.0, lora_targets="q,down")
    with jax.enable_x64(True):
        report = prove_dpo(cfg, "tiny-llama", Layout(dp=2, mp=2), 8, 16, dtype=np.float64, steps=2)
    assert report.ok and report.steps == 2, format_report(report)
    leaves = {p.path: p for p in report.params}
    counters = [p for p in leaves if p.startswith("opt_state")]
    assert counters and all(leaves[p].max_abs_err == 0 for p in counters)  # both took 2 steps
    trained = [p for p in leaves if "/" in p and not p.startswith("dpo/")]
    if lora_rank:
        assert {p for p in trained if lora.is_adapter(p)} == {
            "layers/attn/lora_wq_a",
            "layers/attn/lora_wq_b",
            "layers/mlp/lora_w_down_a",
            "layers/mlp/lora_w_down_b",
        }
        # A drawn with B (B = 0 would leave A's gradient 0, unproven): A's leaves moved and compared
        assert max(leaves[p].max_abs_err for p in trained if p.endswith("_a")) > 0
        (kept,) = report.checks
        assert kept["name"] == "LoRA: frozen base unchanged by the steps" and kept["ok"], kept
    assert max(leaves[p].max_rel_err for p in trained) > 0  # the steps moved: two programs' rounding
    _assert_pretraining_schema(report.to_json())


def test_verify_dpo_refuses_what_training_refuses_before_any_work(capsys):
    """Half a pair (an odd --batch-size), a batch whose 2 proof-step micro-batches would split a pair,
    and what DPO does not train: training's one-line errors, exit 2, before any work."""
    from helpers import run_cli

    base = ("verify", "--objective", "dpo", "--config", "tiny-llama", "--mesh", "1x2", "--devices", "2")
    cases = [
        (
            (*base, "--batch-size", "3"),
            "--objective dpo takes pairs: --batch-size 3 must be even (2 rows a pair)",
        ),
        ((*base, "--batch-size", "6", "--steps", "2"), "--batch-size 6 must be a multiple of 2 x 2"),
        ((*base, "--doc-mask"), "a document mask has nothing to separate; leave out --doc-mask"),
        ((*base[:4], "tiny-mixtral", *base[5:]), "--objective dpo trains dense models"),
        ((*base, "--lora-rank", "2", "--lora-dropout", "0.1"), "trains without dropout"),
    ]
    for argv, line in cases:
        assert run_cli(*argv) == 2, argv
        err = capsys.readouterr().err
        assert line in err and err.count("\n") == 1 and err.startswith("meshlm: error: "), err


def _dpo_config(out, **kw):
    from meshlm.train.config import TrainConfig

    base = dict(config="tiny-lm", tokenizer="bytes", objective="dpo", data=(str(PAIRS),), seq_len=48)
    base |= dict(batch_size=32, lr=3e-3, warmup_steps=1, dpo_beta=0.5, eval_every=0, eval_batches=1)
    base |= dict(save_every=0, sample_tokens=0)
    return TrainConfig(**{**base, **kw, "out": str(out)})


# slow: its cost (two DPO runs and a resume); DPO's loss and gradients: the quick proof on 2x2 and
# test_loss_equals_trls_dpo_trainer; an exact resume: tests/test_resume.py's quick cell
@pytest.mark.slow
def test_train_dpo_learns_and_resumes_bitwise_from_its_cached_reference(tmp_path):
    from meshlm.parallel.mesh import make_mesh
    from meshlm.train.loop import _one_step, save, train
    from meshlm.train.run import build_run

    steps = 12
    train(_dpo_config(tmp_path / "ref", steps=steps), make_mesh(2, 2))
    rows = train_rows(tmp_path / "ref")
    assert {"reward_accuracy", "reward_margin", "reward_chosen", "reward_rejected"} <= set(rows[0])
    assert rows[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)  # the policy is the reference at step 1
    first, last = rows[:3], rows[-3:]
    assert np.mean([r["loss"] for r in last]) < np.mean([r["loss"] for r in first]) - 0.2  # 0.69 -> ~0.3
    assert (
        np.mean([r["reward_accuracy"] for r in last]) > 0.75 > np.mean([r["reward_accuracy"] for r in first])
    )
    assert "val_reward_accuracy" in eval_rows(tmp_path / "ref")[-1]
    # a run killed after its checkpoint at step 4: the same command resumes, reading the cached
    # reference log-probs (the starting weights are gone), bit for bit
    cut = build_run(_dpo_config(tmp_path / "cut", steps=steps), make_mesh(2, 2))
    for _ in range(4):
        _one_step(cut)
    save(cut)
    cut.release()
    cache = (tmp_path / "cut" / "dpo_reference.npy").read_bytes()
    assert cache == (tmp_path / "ref" / "dpo_reference.npy").read_bytes()
    train(_dpo_config(tmp_path / "cut", steps=steps), make_mesh(2, 2))
    got = [(r["step"], r["loss"]) for r in train_rows(tmp_path / "cut")]
    assert got == [(r["step"], r["loss"]) for r in rows[4:]]
    (tmp_path / "cut" / "dpo_reference.npy").unlink()  # a resume without its cache is one clear error
    with pytest.raises(CheckpointError, match="reference log-probs"):
        train(_dpo_config(tmp_path / "cut", steps=steps), make_mesh(2, 2))


def test_dpo_accumulation_deals_whole_pairs_and_refuses_odd_batches(tmp_path):
    """With --accum-steps A the device batch's micro-batch a is rows [a B / A, (a + 1) B / A) of the
    step's pairs (whole pairs, on every data shard), and a run trains as with one; a batch whose
    micro-batches would split a pair is one line."""
    from meshlm.data.device_batches import device_batch
    from meshlm.data.pairs import PairBatcher, PairRows
    from meshlm.parallel.layout import Layout
    from meshlm.parallel.mesh import make_mesh
    from meshlm.train.loop import train
    from meshlm.train.run import build_run

    rows = PairRows(np.arange(40 * 9, dtype=np.int32).reshape(40, 9), np.ones((40, 8), np.uint8))
    one, two = PairBatcher(rows, 8, 0), PairBatcher(rows, 8, 0, accum=2)
    one.ref = two.ref = np.arange(40 * 8, dtype=np.float32).reshape(40, 8)
    whole = one.batch(3)
    got = device_batch(two, 3, Layout.of(make_mesh(2, 2)), 2)
    for key in ("inputs", "targets", "completion_mask", "ref_logps"):
        np.testing.assert_array_equal(np.asarray(got[key]), whole[key].reshape(2, 4, 8))
    runs = {}  # the whole run: the same losses and reward metrics with 2 micro-batches as with one
    for a in (1, 2):
        train(_dpo_config(tmp_path / f"acc{a}", steps=3, batch_size=8, accum_steps=a), make_mesh(2, 2))
        runs[a] = train_rows(tmp_path / f"acc{a}")
    assert runs[2][-1]["reward_margin"] != 0
    for r1, r2 in zip(runs[1], runs[2], strict=True):
        for k in ("loss", "reward_accuracy", "reward_margin", "reward_chosen", "logps_rejected"):
            assert r2[k] == pytest.approx(r1[k], rel=1e-4, abs=1e-6), (r1["step"], k)
    with pytest.raises(DataError, match="multiple of 2 x 2"):
        build_run(_dpo_config(tmp_path / "a", accum_steps=2, batch_size=6), make_mesh(1, 2))
    with pytest.raises(DataError, match="must be even"):
        build_run(_dpo_config(tmp_path / "b", batch_size=5), make_mesh(1, 2))


def test_prepared_pair_store_holds_the_rows_train_makes_from_jsonl(tmp_path, capsys):
    from helpers import run_cli

    from meshlm.data.pair_store import load_pair_store
    from meshlm.model.config import get_config
    from meshlm.parallel.layout import Layout
    from meshlm.train.dpo_run import load_pairs

    store = tmp_path / "pairs"
    assert (
        run_cli("data", "prepare", "--pairs", "--data", str(PAIRS), "--seq-len", "48", "--out", str(store))
        == 0
    )
    assert "prepared 23 + 1 pairs (0 dropped" in capsys.readouterr().err
    tok = ByteTokenizer()
    want = encode_pairs(read_pairs([PAIRS]), Renderer(tok), 48, tok.eod_id)
    for tcfg_data in ((str(store),), (str(PAIRS),)):  # train's own reading of either
        batcher, val, line = load_pairs(
            _dpo_config(tmp_path, data=tcfg_data), get_config("tiny-lm"), Layout(dp=2), tok
        )
        assert np.array_equal(batcher.data.tokens, want[0].tokens) and np.array_equal(
            val.data.mask, want[1].mask
        )
        assert "23 training and 1 validation pairs" in line and "prompt + completion + EOD" in line
    with pytest.raises(DataError, match="--seq-len 48"):
        load_pair_store(store, tok, 64)


def test_pairs_render_with_a_chat_template_as_user_prompt_and_assistant_completion(tmp_path):
    """With a chat-template tokenizer the completion's tokens are the assistant turn's (its end of turn
    included): the masked tokens decode to exactly the completion and ChatML's ``<|im_end|>``."""
    from test_chat_sft import EXAMPLES, chat_tokenizer_dir

    from meshlm.data.pairs import renderer_for
    from meshlm.data.tokenizer_files import directory_tokenizer, load_tokenizer

    directory = chat_tokenizer_dir(tmp_path / "tok", (EXAMPLES / "chatml.jinja").read_text())
    tok = load_tokenizer(str(directory))
    render = renderer_for(directory_tokenizer(directory))
    assert render.template is not None and render.rule.startswith("chat template")
    ids, mask = render("The capital of France is", " Paris.")
    assert tok.decode(ids[mask == 1]) == " Paris.<|im_end|>\n"
    assert tok.decode(ids[mask == 0]).endswith("<|im_start|>assistant\n")  # the prompt: user turn, then
    train, _, _ = encode_pairs(read_pairs([PAIRS]), render, 64, tok.eod_id)
    assert train.mask.sum(axis=1).min() > 0


def test_dpo_refuses_experts_and_doc_mask_saying_why():
    from meshlm.model.config import get_config
    from meshlm.train.dpo import check_dpo

    with pytest.raises(ConfigError, match="router losses .* not part of DPO's gradient pass.*--objective lm"):
        check_dpo(get_config("tiny-mixtral"))
    with pytest.raises(ConfigError, match="nothing packed.*leave out --doc-mask"):
        check_dpo(get_config("tiny-llama").replace(doc_mask=0))


def test_dpo_step_proof_takes_reference_logps_from_the_frozen_weights():
    """``verify --objective dpo --steps 1`` at its smallest (tiny-llama with one layer, 1x2, one pair of
    8 tokens, float32): the sharded step's reference log-probs come from the frozen reference weights,
    as the unsharded step's do. Catches, quick, what only the slow K-step proof did (issue 66): the seam
    fed the trainable weights (the policy's start, another model here): the loss and every gradient move."""
    from meshlm.model.config import get_config
    from meshlm.parallel.layout import Layout
    from meshlm.proof.dpo import prove_dpo

    cfg = get_config("tiny-llama").replace(n_layers=1)
    report = prove_dpo(cfg, "tiny-llama", Layout(dp=1, mp=2), 4, 8, dtype=np.float32, steps=1)
    assert report.ok and report.steps == 1, format_report(report)
