"""``--pp`` and its schedule: every combination the pipeline cannot run is one line naming the problem and
the fix, exit code 2, before any device exists; generate and eval refuse --pp naming the mesh to use."""

import pytest
from helpers import run_cli

from meshlm.errors import ConfigError
from meshlm.parallel.layout import Layout

BAD = [
    ("verify --config tiny-llama --pp 4", "2 layers cannot be split into pp x virtual stages = 4 x 1 chunks"),
    (
        "verify --config tiny-deep --pp 2 --pp-schedule interleaved --virtual-stages 3",
        "8 layers cannot be split into pp x virtual stages = 2 x 3 chunks",
    ),
    (
        "verify --config tiny-deep --pp 4 --pp-schedule interleaved --virtual-stages 2 --microbatches 2",
        "runs micro-batches in groups of pp=4, but microbatches=2; use a multiple of 4",
    ),
    (
        "verify --pp 2 --pp-schedule interleaved --virtual-stages 1",
        "the interleaved schedule needs --virtual-stages 2",
    ),
    (
        "verify --pp 2 --pp-schedule interleaved",
        "2 layers cannot be split into pp x virtual stages = 2 x 2 chunks",
    ),
    ("verify --pp 2 --virtual-stages 2", "--virtual-stages 2 needs --pp-schedule interleaved"),
    (
        "train --config tiny-llama --pp 2 --microbatches 3 --batch-size 8 --mesh 1x2",
        "--batch-size 8 is not a multiple of dp x accum_steps x microbatches = 1 x 1 x 3; use e.g. "
        "--batch-size 9",
    ),
    (
        "verify --pp 2 --batch-size 6 --mesh 2x1",
        "not a multiple of dp x accum_steps x microbatches = 2 x 1 x 4",  # verify: M = 2 pp
    ),
    ("bench --microbatches 4", "--microbatches needs a pipeline; add --pp 2 (or more) or drop it"),
    ("plan --config tiny-llama --schedule-png s.png", "--schedule-png draws a pipeline schedule; add --pp 2"),
    ("generate --checkpoint c --pp 2 --mesh 1x2", "has no pipeline (--pp 2)"),
    ("eval --checkpoint c --pp 2", "drop --pp and use --mesh 1x2"),
]


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a command gets as far as devices."""

    def too_late(*args, **kwargs):
        raise AssertionError("a bad --pp combination must be refused before setup")

    for command in ("train", "verify", "bench", "plan", "generate", "evaluate"):
        monkeypatch.setattr(f"meshlm.cli.{command}.setup", too_late)


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[case[0] for case in BAD])
def test_bad_pipeline_combination_is_one_line_before_setup(argv, message, no_work, capsys):
    assert run_cli(*argv.split()) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("meshlm: error: ") and "Traceback" not in err, err
    assert message in lines[0], lines[0]


def test_pp_is_the_outermost_axis_and_leaves_dp_mp_layouts_unchanged():
    layout = Layout(pp=2, dp=2, mp=2, fsdp=True, microbatches=4)
    assert layout.shape == {"pp": 2, "dp": 2, "mp": 2} and layout.devices == 8
    assert layout.label() == "pp2x2x2 + FSDP (1f1b, M=4)"
    assert Layout.from_dict(layout.to_dict()) == layout
    assert Layout(dp=2, mp=2).to_dict() == {"dp": 2, "mp": 2, "fsdp": False, "sp": False}  # as before
    with pytest.raises(ConfigError, match="needs a pipeline"):
        Layout(dp=2, pp_schedule="gpipe")


def test_pp_and_cp_keep_the_mesh_order_and_combine():
    """Axes in the order (pp, dp, cp, mp), each of pp and cp only when > 1; pp x cp is one mesh."""
    assert tuple(Layout(dp=2, mp=2, cp=2).shape) == ("dp", "cp", "mp")
    assert tuple(Layout(pp=2, dp=2, mp=2).shape) == ("pp", "dp", "mp")
    assert tuple(Layout(dp=2, mp=2).shape) == ("dp", "mp")
    both = Layout(pp=2, cp=2, mp=2, microbatches=2, cp_strategy="allgather")
    assert tuple(both.shape) == ("pp", "dp", "cp", "mp") and both.devices == 8
    assert both.label() == "pp2x1x2 + CP2 allgather (1f1b, M=2)" and both.batch_axes == ("dp", "cp")
    assert both.pipelined and both.context_parallel and Layout.from_dict(both.to_dict()) == both
