"""Training: a short run learns and logs; exact resume after SIGKILL; resume on another mesh; errors."""

import json
import os
import signal
import subprocess

import jax
import numpy as np
import optax
import pytest
from helpers import meshlm_argv, train_args, wait_for, write_corpus

from meshlm.errors import CheckpointError, TokenRangeError, TrainingError
from meshlm.io.checkpoint import Checkpointer
from meshlm.parallel.mesh import make_mesh
from meshlm.train.config import TrainConfig
from meshlm.train.loop import _one_step, build_run, save, train
from meshlm.train.optim import clip_by_global_norm


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _tcfg(corpus, out, **kw):
    base = dict(
        config="tiny-lm",
        data=(corpus,),
        steps=12,
        batch_size=8,
        seq_len=32,
        lr=3e-3,
        warmup_steps=2,
        eval_every=6,
        eval_batches=2,
        save_every=6,
        sample_tokens=0,
        out=str(out),
    )
    return TrainConfig(**{**base, **kw})


def test_short_run_learns_and_writes_outputs(corpus, tmp_path):
    summary = train(_tcfg(corpus, tmp_path, steps=16), make_mesh(2, 2))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    eval_rows = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in train_rows] == list(range(1, 17))
    assert set(train_rows[0]) == {"step", "loss", "lr", "grad_norm", "tokens_per_s"}
    assert set(eval_rows[0]) == {"step", "val_loss", "val_bpb"}
    assert np.mean([r["loss"] for r in train_rows[-3:]]) < train_rows[0]["loss"] - 0.5
    assert eval_rows[-1]["val_bpb"] < eval_rows[0]["val_bpb"]
    assert summary["val_bpb_end"] == eval_rows[-1]["val_bpb"]
    assert (tmp_path / "loss_curve.png").stat().st_size > 1000
    assert any((tmp_path / "tensorboard").iterdir())
    assert Checkpointer(tmp_path).all_steps() == [6, 12, 16]


def test_resume_on_another_mesh_continues_allclose(corpus, tmp_path):
    ref = train(_tcfg(corpus, tmp_path / "ref", steps=8, eval_every=0, save_every=0), make_mesh(2, 2))
    assert ref["step"] == 8
    tcfg = _tcfg(corpus, tmp_path / "cut", steps=8, eval_every=0, save_every=0)
    run = build_run(tcfg, make_mesh(2, 2))
    for _ in range(4):
        _one_step(run)
    save(run)
    run.ckpt.close()
    for mesh in [(1, 4), (4, 1)]:
        resumed = build_run(tcfg, make_mesh(*mesh))
        assert resumed.step == 4
    resumed = build_run(tcfg, make_mesh(1, 4))
    losses = [float(_one_step(resumed)["loss"]) for _ in range(4)]
    want = [
        json.loads(line)["loss"]
        for line in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()
        if '"loss"' in line
    ][4:8]
    np.testing.assert_allclose(losses, want, rtol=1e-5)


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


def _cli_train(out, corpus, steps):
    return meshlm_argv(*train_args(corpus, out, steps), "--devices", "4")


def _losses(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def test_sigkill_then_resume_is_bitwise_identical(corpus, tmp_path):
    steps = 14
    ref = subprocess.run(
        _cli_train(tmp_path / "ref", corpus, steps), capture_output=True, text=True, timeout=300
    )
    assert ref.returncode == 0, ref.stderr
    victim = subprocess.Popen(_cli_train(tmp_path / "cut", corpus, steps), stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "cut" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 7)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    resumed = subprocess.run(
        _cli_train(tmp_path / "cut", corpus, steps), capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stderr
    got, want = _losses(tmp_path / "cut"), _losses(tmp_path / "ref")
    assert [s for s, _ in got] == list(range(1, steps + 1))  # no duplicated or missing steps
    assert got == want  # bitwise: same floats from the resume point on (and before)


def test_sigterm_saves_and_exits_cleanly(corpus, tmp_path):
    proc = subprocess.Popen(_cli_train(tmp_path, corpus, 200), stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "SIGTERM: saved a checkpoint at step" in err
    last = _losses(tmp_path)[-1][0]
    assert Checkpointer(tmp_path).latest_step() == last


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
    train(tcfg, make_mesh(1, 2))
    train(tcfg, make_mesh(1, 2))  # already finished: resumes at step 4, evaluates it again
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r["step"] for r in rows if "val_loss" in r]
    trains = [r["step"] for r in rows if "loss" in r]
    assert evals == [0, 2, 4] and trains == [1, 2, 3, 4]
