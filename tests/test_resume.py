"""Resume and restore over the axes, each cell trained once. A checkpoint is a format and the layout a
sharding: a run killed with SIGKILL resumes bit for bit (every step's loss equal to a run never
stopped), and a checkpoint restores onto other meshes and layouts holding the saved parameters and AdamW
state exactly. One uninterrupted `meshlm train` per CLI cell (module-scoped) serves every check of it:

- fsdp-sp (2x2: tensor-parallel weights over mp, FSDP's weights and moments over dp, the sequence over
  mp, selective remat): the SIGKILL resume; its step-9 checkpoint restored without fsdp or sp on 1x4 and
  on 4x1 continues allclose to the run's own losses (another mesh changes only the sums' order).
- pp (2 stages, 1F1B, on 1x2): the SIGKILL resume; its checkpoint restores without a pipeline (1x2) and
  under pp 2 x cp 2 (GPipe, the ring) exactly, and a step trains there.
- moe-bias (tiny-cpu-moe: cpu-moe's router, its selection bias balanced at 1e-2 without an aux loss, on
  2x2 ep 2): the SIGKILL resume, its own short run; every step's loss and expert load (which the bias
  decides) equal to a run never stopped.
- ep (tiny-mixtral on 2x1 ep 2, in process: the CLI's launch would cost more than its two steps): two
  steps straight equal one step, a restore and one more, bitwise; the checkpoint restores without ep and
  onto ep 4 exactly.

A tensor-parallel cell alone (2x2 without fsdp) is not run: its weights' mp split is the fsdp-sp cell's,
and a restore without fsdp is checked exactly by the pp and ep chains below."""

import argparse
import dataclasses
import importlib.util
import os
import shutil
import signal
import subprocess
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import meshlm_argv, tiny_lm_config, train_args, train_rows, wait_for, write_corpus
from jax.sharding import PartitionSpec as P

from meshlm.cli.train import add_parser, train_config
from meshlm.parallel.axes import MP
from meshlm.parallel.layout import Layout
from meshlm.parallel.mesh import make_mesh
from meshlm.train.loop import _one_step, save
from meshlm.train.run import build_run

ROOT = Path(__file__).resolve().parents[1]
STEPS = 14  # checkpoints every 3 steps (train_args); the victim is killed after step 6
CELLS = {
    "fsdp-sp": ("--fsdp", "--sp", "--remat", "selective"),
    "pp": ("--pp", "2", "--mesh", "1x2"),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _cli_train(out, corpus, *extra):
    return meshlm_argv(*train_args(corpus, out, STEPS), "--devices", "4", *extra)


def _losses(out):
    return [(r["step"], r["loss"]) for r in train_rows(out)]


# The quick tier resumes the fsdp-sp cell after SIGKILL (the exact resume's bug class); the pp cell and
# the restores onto other meshes, layouts, ep and the MoE bias are slow: the same resume and restore
# paths on more layouts (their cost is their scale; a restore onto other meshes: test_checkpoint's).
SLOW = pytest.mark.slow


@pytest.fixture(scope="module", params=["fsdp-sp", pytest.param("pp", marks=SLOW)])
def trained(request, corpus, tmp_path_factory):
    """{cell, extra (its flags), out (the uninterrupted run's directory), tcfg (its TrainConfig, as the
    CLI read it: in-process restores must match its settings)}."""
    extra = CELLS[request.param]
    out = tmp_path_factory.mktemp(request.param) / "ref"
    ref = subprocess.run(_cli_train(out, corpus, *extra), capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr
    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    tcfg = train_config(sub.choices["train"].parse_args([*train_args(corpus, out, STEPS)[1:], *extra]))
    return dict(cell=request.param, extra=extra, out=out, tcfg=tcfg)


def test_sigkill_then_resume_is_bitwise_identical(trained, corpus, tmp_path):
    cut = _cli_train(tmp_path / "cut", corpus, *trained["extra"])
    victim = subprocess.Popen(cut, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "cut" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 7)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    resumed = subprocess.run(cut, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stderr
    got, want = _losses(tmp_path / "cut"), _losses(trained["out"])
    assert [s for s, _ in got] == list(range(1, STEPS + 1))  # no duplicated or missing steps
    assert got == want  # bitwise: same floats from the resume point on (and before)


def _host(run):
    return jax.tree.map(np.asarray, (run.params, run.opt_state))


def _equal(a, b) -> bool:
    return all(jax.tree.leaves(jax.tree.map(np.array_equal, a, b)))


def _steps(run, n):
    """n steps, then save and close: (losses, the saved state on the host)."""
    losses = [float(_one_step(run)["loss"]) for _ in range(n)]
    save(run)
    state = _host(run)
    run.ckpt.close()
    return losses, state


@SLOW
@pytest.mark.parametrize("trained", ["fsdp-sp"], indirect=True)
def test_fsdp_sp_checkpoint_continues_allclose_on_other_meshes_without_them(trained, tmp_path):
    """The run's checkpoint at step 9 (a copy, later steps removed) onto 4x1 and 1x4 without fsdp, sp
    or remat: the next 4 steps' losses are the uninterrupted run's (rtol 1e-5)."""
    shutil.copytree(trained["out"], tmp_path, dirs_exist_ok=True)
    for step in (12, STEPS):  # the run keeps its last 3 checkpoints: 9, 12, 14
        shutil.rmtree(tmp_path / str(step))
    tcfg = dataclasses.replace(trained["tcfg"], out=str(tmp_path), fsdp=False, sp=False, remat="none")
    other = build_run(tcfg, make_mesh(4, 1))
    assert other.step == 9
    other.ckpt.close()
    run = build_run(tcfg, make_mesh(1, 4))
    assert run.step == 9 and run.specs["layers/attn"]["wq"] == P(None, None, MP, None)  # no dp split
    losses = [float(_one_step(run)["loss"]) for _ in range(4)]
    run.ckpt.close()
    want = [loss for step, loss in _losses(trained["out"]) if 9 < step <= 13]
    np.testing.assert_allclose(losses, want, rtol=1e-5)


@SLOW
@pytest.mark.parametrize("trained", ["pp"], indirect=True)
def test_pp_checkpoint_restores_without_pp_and_under_pp_x_cp_exactly(trained, tmp_path):
    """The run's last checkpoint (written under pp 2, 1F1B) restores under pp 2 on 1x2, without a
    pipeline on 1x2 and under pp 2 x cp 2 (GPipe, the ring, on 1x1) with the same values exactly; a
    step trains under pp x cp."""
    shutil.copytree(trained["out"], tmp_path, dirs_exist_ok=True)
    tcfg = lambda **kw: dataclasses.replace(trained["tcfg"], out=str(tmp_path), **kw)
    pp = build_run(tcfg(), Layout(mp=2, **trained["tcfg"].layout_options()))
    assert pp.step == STEPS and pp.layout.pp == 2
    saved = _host(pp)
    pp.ckpt.close()
    plain = build_run(tcfg(pp=1), make_mesh(1, 2))
    assert plain.step == STEPS and plain.layout.pp == 1 and _equal(_host(plain), saved)
    plain.ckpt.close()
    gpipe = dict(pp=2, cp=2, microbatches=2, pp_schedule="gpipe")
    ppcp = build_run(tcfg(**gpipe), Layout(**gpipe))
    assert ppcp.layout.shape == {"pp": 2, "dp": 1, "cp": 2, "mp": 1}
    assert ppcp.specs["layers/attn"]["wq"][0] == "pp"  # restored split over the stages
    assert _equal(_host(ppcp), saved)
    last = [float(_one_step(ppcp)["loss"])]
    ppcp.ckpt.close()
    assert np.all(np.isfinite(last))


@SLOW
def test_ep_resumes_bitwise_and_restores_without_ep_and_onto_ep4(corpus, tmp_path):
    """tiny-mixtral (4 experts) on 2x1 ep 2: two steps straight equal one step, a restore and one more
    (losses and state bitwise); the checkpoint then restores on 1x1 (no ep) and on 4x1 ep 4 (one
    expert per device) with the saved values exactly, and a step trains there."""
    tcfg = lambda out, **kw: tiny_lm_config(
        corpus,
        tmp_path / out,
        config="tiny-mixtral",
        tokenizer="bpe-300",
        steps=4,
        lr=3e-3,
        batch_size=4,
        seq_len=16,
        **kw,
    )
    ep2 = Layout(dp=2, ep=2)
    straight, want = _steps(build_run(tcfg("straight", ep=2), ep2), 2)
    first, _ = _steps(build_run(tcfg("cut", ep=2), ep2), 1)
    resumed = build_run(tcfg("cut", ep=2), ep2)
    assert resumed.step == 1 and resumed.specs["layers/moe/experts"]["w_gate"][1] == "ep"
    second, saved = _steps(resumed, 1)
    assert first + second == straight and _equal(saved, want)  # bitwise
    plain = build_run(tcfg("cut"), Layout())
    assert plain.step == 2 and not plain.layout.experts_split
    assert _equal(_host(plain), saved)
    plain.ckpt.close()
    ep4 = build_run(tcfg("cut", ep=4), Layout(dp=4, ep=4))
    assert ep4.step == 2 and ep4.layout.mesh_shape == {"dp": 1, "ep": 4, "mp": 1}
    assert _equal(_host(ep4), saved)
    last, _ = _steps(ep4, 1)
    assert np.all(np.isfinite(straight + last))


MOE_STEPS = 6  # checkpoints every 2 steps; the victim is killed after step 3 and resumes from step 2


@SLOW
def test_moe_bias_balancing_sigkill_then_resume_is_bitwise_identical(corpus, tmp_path):
    """tiny-cpu-moe's selection bias is state outside AdamW, moved after each step from the global
    load: a run killed mid-way resumes from its checkpoint with the bias, so each step's loss and expert
    load (integer counts the bias's choice decides) equal the uninterrupted run's bit for bit."""
    moe = ("--config", "tiny-cpu-moe", "--tokenizer", "bpe-300", "--ep", "2", "--save-every", "2")
    argv = lambda out: meshlm_argv(*train_args(corpus, out, MOE_STEPS), "--devices", "4", *moe)
    ref = subprocess.run(argv(tmp_path / "ref"), capture_output=True, text=True, timeout=600)
    assert ref.returncode == 0, ref.stderr
    victim = subprocess.Popen(argv(tmp_path / "cut"), stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "cut" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 4, timeout_s=600)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    resumed = subprocess.run(argv(tmp_path / "cut"), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0 and "resuming from" in resumed.stderr, resumed.stderr
    rows = lambda out: [(r["step"], r["loss"], r["expert_load"]) for r in train_rows(out)]
    got, want = rows(tmp_path / "cut"), rows(tmp_path / "ref")
    assert [s for s, *_ in got] == list(range(1, MOE_STEPS + 1))
    assert len({tuple(load) for *_, load in want}) > 1  # the load moves from step to step
    assert got == want  # bitwise, the bias's choices included
    _expert_load_cv_script(tmp_path / "ref" / "metrics.jsonl", tmp_path / "cut" / "metrics.jsonl")


def _expert_load_cv_script(a, b):
    """scripts/expert_load_cv.py's data path (docs/training.md's table and figure) on the two runs."""
    spec = importlib.util.spec_from_file_location("expert_load_cv", ROOT / "scripts" / "expert_load_cv.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    runs = {"ref": script.series(a), "resumed": script.series(b)}
    cvs = [r["cv"] for r in runs["ref"]]
    assert len(cvs) == MOE_STEPS and all(c >= 0 for c in cvs) and runs["ref"] == runs["resumed"]
    lines = script.table(runs, 3).splitlines()
    assert len(lines) == 2 + MOE_STEPS // 3 and f"{sum(cvs[:3]) / 3:.2f}" in lines[2]
    picture = script.svg(runs, "t")
    assert picture.count("<polyline") == 2 and picture == script.svg(runs, "t")
