"""The main job explains itself: a start line naming the model, the mesh and what each axis splits; at
the end, next commands that the CLI accepts and that run (prepare + eval on the run's validation
split); the loss plot labels the loss per token, with val_bpb on its own axis."""

from __future__ import annotations

import json
import shlex

import pytest
from helpers import run_cli, write_corpus

from meshlm.cli import build_parser
from meshlm.model.config import get_config
from meshlm.parallel.mesh import make_mesh
from meshlm.train.config import METRICS, TrainConfig
from meshlm.train.explain import next_commands, start_line
from meshlm.train.metrics import compare_curves, loss_figure, plot_loss_curve


def test_start_line_names_model_mesh_and_splits():
    cfg = get_config("cpu")
    line = start_line(TrainConfig(), cfg, make_mesh(2, 2), 3_400_000)
    assert line.startswith("model: the cpu preset, a llama of 4 layers, d_model 256, 3.40M parameters;")
    assert "mesh 2x2 (dp x mp) on 4 fake CPU devices" in line
    assert "attention's 8 heads (4 per device)" in line and "768 hidden units (384 each)" in line
    assert "over mp=2; the batch of 32 sequences over dp=2 (16 each)" in line
    line = start_line(TrainConfig(fsdp=True), cfg, make_mesh(1, 4), 10)
    assert "the whole batch on every device (dp=1)" in line and "(FSDP)" in line


@pytest.mark.parametrize("data", [(), ("corpus dir/*.py",)])
def test_next_commands_parse(data):
    lines = next_commands(
        TrainConfig(data=data, out="runs/my run"), make_mesh(2, 2), "runs/my run/tokenizer.json"
    )
    assert [shlex.split(c)[1] for c in lines] == ["generate", "verify", "data", "eval"]
    for line in lines:
        build_parser().parse_args(shlex.split(line)[1:])  # the CLI accepts every one (exits 2 if not)
    assert "--data 'runs/my run-valdata'" in lines[-1]


def test_loss_plot_is_per_token_with_bpb_on_its_own_axis():
    rows = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0, "val_loss": 4.2, "val_bpb": 2.5}]
    fig = loss_figure(rows, "nats/token")
    left, right = fig.axes
    assert left.get_ylabel() == "loss (nats/token)" and right.get_ylabel() == "validation bits per byte"
    assert [t.get_text() for t in left.get_legend().get_texts()][-1] == "val_bpb (right)"


def test_compare_draws_both_runs_curves_each_labelled_with_its_run(tmp_path, capsys):
    """--compare: loss_curve.png holds this run's series and the other run's, each series labelled with
    its run and holding that run's points (the figure's data, not its pixels); before any work, a
    directory without metrics.jsonl or the run's own --out is refused in one line."""
    other = tmp_path / "float"
    other.mkdir()
    theirs = [{"step": 1, "loss": 5.5}, {"step": 2, "loss": 4.5, "val_loss": 4.6, "val_bpb": 2.7}]
    (other / METRICS).write_text("".join(json.dumps(r) + "\n" for r in theirs))
    mine = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0, "val_loss": 4.2, "val_bpb": 2.5}]
    compare = compare_curves(str(other), str(tmp_path / "int8"))
    fig = loss_figure(mine, "nats/token", compare)
    series = {line.get_label(): line.get_xydata().tolist() for ax in fig.axes for line in ax.get_lines()}
    assert series == {
        "train loss (int8)": [[1, 5.0], [2, 4.0]],
        "validation loss (int8)": [[2, 4.2]],
        "val_bpb (right) (int8)": [[2, 2.5]],
        "train loss (float)": [[1, 5.5], [2, 4.5]],
        "validation loss (float)": [[2, 4.6]],
        "val_bpb (right) (float)": [[2, 2.7]],
    }
    assert len(fig.axes[0].get_legend().get_texts()) == 6
    (tmp_path / "int8").mkdir()
    png = plot_loss_curve(mine, tmp_path / "int8", "nats/token", compare)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for bad, why in ((tmp_path / "nowhere", "no metrics.jsonl there"), (other, "is this run's --out")):
        assert run_cli("train", "--compare", str(bad), "--out", str(other)) == 2
        assert why in capsys.readouterr().err


def test_a_run_prints_what_it_does_and_what_to_run_next(tmp_path, capsys):
    """A tiny run: its start line and next commands; the prepare and eval it suggests work."""
    (tmp_path / "corpus").mkdir()
    corpus = write_corpus(tmp_path / "corpus")
    out = str(tmp_path / "run")
    argv = ["train", "--data", corpus, "--config", "tiny-lm", "--steps", "1", "--batch-size", "4"]
    argv += ["--seq-len", "16", "--eval-batches", "1", "--sample-tokens", "0", "--mesh", "2x2", "--out", out]
    assert run_cli(*argv) == 0
    err = capsys.readouterr().err
    assert "mesh 2x2 (dp x mp) on " in err and "over mp=2; the batch of 4 sequences over dp=2" in err
    suggested = err[err.index("next: ") :].splitlines()[1:]
    assert [shlex.split(c)[1] for c in suggested] == ["generate", "verify", "data", "eval"]
    for line in suggested[2:]:
        assert run_cli(*shlex.split(line)[1:], *(["--json"] if "eval" in line else [])) == 0, line
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["tokens"] > 0 and "val split" in result["data"]
