"""Training: a short run learns and logs; SIGTERM saves; settings checked on resume; errors. (The exact
resume after SIGKILL and the restores onto other meshes and layouts: tests/test_resume.py.)"""

import argparse
import dataclasses
import signal
import subprocess
import sys
from functools import partial

import jax
import numpy as np
import optax
import pytest
from helpers import (
    eval_rows,
    meshlm_argv,
    read_metrics,
    run_cli,
    tiny_lm_config,
    train_args,
    train_rows,
    wait_for,
    write_corpus,
)

from meshlm.cli.train import add_parser, train_config
from meshlm.errors import CheckpointError, TokenRangeError, TrainingError
from meshlm.io.checkpoint import Checkpointer
from meshlm.parallel.mesh import make_mesh
from meshlm.train.config import CLI_HIDDEN, TrainConfig, resolve, resume_must_match
from meshlm.train.loop import _one_step, save, train
from meshlm.train.optim import clip_by_global_norm
from meshlm.train.run import build_run


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


_tcfg = partial(tiny_lm_config, steps=12, lr=3e-3, warmup_steps=2, eval_every=6, eval_batches=2, save_every=6)


def test_short_run_learns_and_writes_outputs(corpus, tmp_path):
    summary = train(_tcfg(corpus, tmp_path, steps=16), make_mesh(2, 2))
    trains, evals = train_rows(tmp_path), eval_rows(tmp_path)
    assert len(trains) + len(evals) == len(read_metrics(tmp_path))
    assert [r["step"] for r in trains] == list(range(1, 17))
    assert set(trains[0]) == {"step", "loss", "lr", "grad_norm", "tokens_per_s"}
    assert set(evals[0]) == {"step", "val_loss", "val_bpb"}
    assert np.mean([r["loss"] for r in trains[-3:]]) < trains[0]["loss"] - 0.5
    assert evals[-1]["val_bpb"] < evals[0]["val_bpb"]
    assert summary["val_bpb_end"] == evals[-1]["val_bpb"]
    assert (tmp_path / "loss_curve.png").stat().st_size > 1000
    assert any((tmp_path / "tensorboard").iterdir())
    assert Checkpointer(tmp_path).all_steps() == [6, 12, 16]


def test_metrics_log_writes_events_without_importing_torch(tmp_path, children_import_meshlm):
    """tensorboardX imports torch when it is installed (~1.7 s of CPU at every `meshlm train` start,
    the SIGKILL/launch tests start dozens); the log's writer is imported without it, and still writes."""
    code = (
        "import sys; from pathlib import Path; from meshlm.train.metrics import MetricsLog; "
        "log = MetricsLog(Path(sys.argv[1])); log.write({'step': 1, 'loss': 2.0}); log.close(); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False"] and any((tmp_path / "tensorboard").iterdir())


def test_fresh_refuses_existing_checkpoints_and_resume_checks_settings(corpus, tmp_path):
    train(_tcfg(corpus, tmp_path, steps=2, eval_every=0, save_every=0), make_mesh(1, 2))
    with pytest.raises(CheckpointError, match="--fresh.*already holds checkpoints"):
        build_run(_tcfg(corpus, tmp_path, steps=4, fresh=True), make_mesh(1, 2))
    with pytest.raises(CheckpointError, match="lr: saved 0.003, now 0.01"):
        build_run(_tcfg(corpus, tmp_path, steps=4, lr=1e-2), make_mesh(1, 2))


def test_out_of_vocab_data_is_refused(corpus, tmp_path):
    with pytest.raises(TokenRangeError, match="outside the vocabulary \\[0, 64\\)"):
        build_run(_tcfg(corpus, tmp_path, config="tiny-llama"), make_mesh(1, 2))


def test_non_finite_loss_stops_and_keeps_last_good_state(corpus, tmp_path):
    with pytest.raises(TrainingError, match="non-finite loss .* at step"):
        train(
            _tcfg(
                corpus, tmp_path, steps=30, lr=1e9, clip_norm=0, warmup_steps=1, eval_every=0, save_every=0
            ),
            make_mesh(1, 2),
        )
    steps = Checkpointer(tmp_path).all_steps()
    assert steps, "the last good state must be saved"
    from meshlm.io.model_io import load_model

    _, params, _ = load_model(tmp_path, make_mesh(1, 1))
    assert all(np.isfinite(np.asarray(p)).all() for p in jax.tree.leaves(params))


def test_clipping_equals_optax():
    rng = np.random.default_rng(0)
    grads = {"a": {"w": rng.normal(size=(4, 5)).astype(np.float32)}, "b": {"v": rng.normal(size=7)}}
    for max_norm in (0.1, 1.0, 100.0):
        ours, _ = clip_by_global_norm(grads, max_norm)
        theirs, _ = optax.clip_by_global_norm(max_norm).update(grads, optax.EmptyState())
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6), ours, theirs)


def _cli_train(out, corpus, steps, *extra):
    return meshlm_argv(*train_args(corpus, out, steps), "--devices", "4", *extra)


def _losses(out):
    return [(r["step"], r["loss"]) for r in train_rows(out)]


# slow: the same SIGTERM save as
# tests/test_faults_multiprocess.py::test_sigterm_under_launch_saves_and_exits_143 (quick), without the
# launcher
@pytest.mark.slow
def test_sigterm_saves_and_exits_143(corpus, tmp_path):
    proc = subprocess.Popen(_cli_train(tmp_path, corpus, 200), stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err  # interrupted and saved: 143, not success
    assert "SIGTERM: saved a checkpoint at step" in err
    last = _losses(tmp_path)[-1][0]
    assert Checkpointer(tmp_path).latest_step() == last


# slow: its cost (two runs); verify's accumulation check (tests/test_data_check.py) and its proofs with micro-
# batches catch a wrong accumulation, quick
@pytest.mark.slow
def test_accumulation_equals_one_big_batch(corpus, tmp_path):
    """2 micro-batches of 4 rows = one batch of 8 rows: same data, same mean gradient (allclose)."""
    mesh = make_mesh(2, 2)
    one = build_run(_tcfg(corpus, tmp_path / "a", steps=3, accum_steps=1), mesh)
    two = build_run(_tcfg(corpus, tmp_path / "b", steps=3, accum_steps=2), mesh)
    for _ in range(3):
        np.testing.assert_allclose(float(_one_step(one)["loss"]), float(_one_step(two)["loss"]), rtol=1e-5)
    for x, y in zip(jax.tree.leaves(one.params), jax.tree.leaves(two.params), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-6)


def test_bf16_compute_keeps_float32_master_weights(corpus, tmp_path):
    run = build_run(_tcfg(corpus, tmp_path, steps=3, compute_dtype="bfloat16"), make_mesh(1, 2))
    losses = [float(_one_step(run)["loss"]) for _ in range(3)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert {p.dtype for p in jax.tree.leaves(run.params)} == {np.dtype("float32")}


def test_restarts_never_duplicate_metrics_rows(corpus, tmp_path):
    """Found by scripts/soak_resume.py: a kill before the first checkpoint left the step-0 eval row,
    and re-running a finished command appended a second final eval row."""
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 0, "val_loss": 5.5, "val_bpb": 8.0}\n{"step": 1, "loss": 5.4, "lr": 0.0, "grad_norm": 1.0,'
        ' "tokens_per_s": 1.0}\n{"step": 2, "lo'  # a torn line, as a SIGKILL mid-write leaves it
    )
    tcfg = _tcfg(corpus, tmp_path, steps=4, eval_every=2, save_every=2)
    with pytest.warns(UserWarning, match="rows of an earlier run.*moved it aside"):  # no checkpoint
        train(tcfg, make_mesh(1, 2))
    train(tcfg, make_mesh(1, 2))  # already finished: resumes at step 4, evaluates it again
    evals = [r["step"] for r in eval_rows(tmp_path)]
    trains = [r["step"] for r in train_rows(tmp_path)]
    assert evals == [0, 2, 4] and trains == [1, 2, 3, 4]


def test_seq_len_defaults_to_the_presets_context(corpus, tmp_path, capsys):
    """`meshlm train --config tiny-llama` used to fail: the default 128 exceeded its max_seq_len 64."""
    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    parsed = sub.choices["train"].parse_args(["--config", "tiny-llama"])
    assert resolve(train_config(parsed))[0].seq_len == 64
    assert resolve(TrainConfig(config="cpu"))[0].seq_len == 128
    assert resolve(TrainConfig(config="small"))[0].seq_len == 128  # max_seq_len 256: still 128
    # Rotary: max_seq_len is the config's limit, not a learned table's: longer is accepted, with a note.
    assert resolve(TrainConfig(config="tiny-llama", seq_len=128))[0].seq_len == 128
    assert "is above the tiny-llama config's max_seq_len=64: accepted" in capsys.readouterr().err
    # The checkpoint meta records the resolved length, so explicit and default both resume from it.
    run = build_run(_tcfg(corpus, tmp_path, seq_len=0), make_mesh(1, 2))
    save(run)
    run.ckpt.close()
    assert Checkpointer(tmp_path).read_meta()["train_config"]["seq_len"] == 64
    for seq_len in (0, 64):
        resumed = build_run(_tcfg(corpus, tmp_path, seq_len=seq_len), make_mesh(1, 2))
        assert resumed.tcfg.seq_len == 64
        resumed.ckpt.close()


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_byte_data_on_a_small_vocabulary_fails_up_front(preset, tmp_path, monkeypatch, capsys):
    def too_late(*args, **kwargs):
        raise AssertionError("the vocabulary check must come before devices and data")

    monkeypatch.setattr("meshlm.cli.train.setup", too_late)
    monkeypatch.setattr("meshlm.train.run.load_splits", too_late)
    code = run_cli("train", "--config", preset, "--tokenizer", "bytes", "--out", str(tmp_path / "out"))
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert f"the {preset} preset has vocab_size=64" in err and "tiny-lm" in err
    assert not (tmp_path / "out").exists()


def test_resume_must_match_comes_from_field_metadata():
    assert set(resume_must_match()) == {
        "config",
        "data",
        "text_field",
        "doc_mask",
        "batch_size",
        "seq_len",
        "lr",
        "warmup_steps",
        "min_lr_ratio",
        "weight_decay",
        "clip_norm",
        "accum_steps",
        "compute_dtype",
        "opt_dtype",
        "quant",
        "seed",
        "moe_aux_loss",
        "moe_capacity_factor",
        "moe_bias_rate",
        "mtp_weight",
        "objective",
        "dpo_beta",
        "dpo_loss",
        "lora_rank",
        "lora_alpha",
        "lora_targets",
        "lora_dropout",
        "base_dtype",
    }


def test_optimizer_settings_reach_the_optimizer():
    """Every TrainConfig field the optimizer also has is handed to it (one left out would train with
    OptimConfig's default instead, silently)."""
    from meshlm.train.optim import OptimConfig

    shared = {f.name for f in dataclasses.fields(OptimConfig)} & {
        f.name for f in dataclasses.fields(TrainConfig)
    }
    assert shared == {
        "lr", "warmup_steps", "min_lr_ratio", "weight_decay", "clip_norm", "accum_steps", "opt_dtype"
    }  # fmt: skip
    tcfg = TrainConfig(
        lr=0.5, warmup_steps=7, min_lr_ratio=0.25, weight_decay=0.3, clip_norm=2.0, accum_steps=2,
        opt_dtype="bf16",
    )  # fmt: skip
    ocfg = tcfg.optim()
    assert {n: getattr(ocfg, n) for n in shared} == {n: getattr(tcfg, n) for n in shared}
    assert ocfg.total_steps == tcfg.steps


def test_every_train_config_field_has_help_and_a_flag():
    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    parser = sub.choices["train"]
    dests = vars(parser.parse_args([]))
    for f in dataclasses.fields(TrainConfig):
        assert f.metadata.get("help"), f"{f.name} has no help"
        assert f.name in dests or f.metadata["cli"] == CLI_HIDDEN, f"{f.name} has no flag"
    assert train_config(parser.parse_args([])) == TrainConfig()  # flag defaults = field defaults
    flags = parser.parse_args(["--bf16", "--data", "a", "b", "--seq-len", "32", "--fresh", "--seed", "3"])
    assert train_config(flags) == TrainConfig(
        compute_dtype="bfloat16", data=("a", "b"), seq_len=32, fresh=True, seed=3
    )
