"""The ``Layout`` record (the mesh's axis sizes and the memory options, validated once, carried as one
value), and two user-facing defects it fixed on the way: the communication check's "+ FSDP" wording on
runs without FSDP, and warnings printed with their Python source line."""

from __future__ import annotations

import jax
import pytest
from helpers import meshlm_argv

from meshlm.errors import ConfigError, MeshError, ShardingError
from meshlm.model.config import get_config
from meshlm.parallel.context import Parallel
from meshlm.parallel.layout import Layout
from meshlm.parallel.mesh import make_mesh
from meshlm.perf.hlo import COLLECTIVES
from meshlm.proof.communication import communication_checks
from meshlm.train.config import TrainConfig, resolve
from meshlm.train.run import checkpoint_meta
from meshlm.train.step import init_model


def test_a_layout_is_validated_where_it_is_built():
    with pytest.raises(MeshError, match="mesh axis mp must be a positive integer, got 0"):
        Layout(dp=2, mp=0)
    with pytest.raises(ConfigError, match="fsdp must be true or false"):
        Layout(fsdp="yes")
    with pytest.raises(
        ShardingError, match="--sp splits the sequence over mp=4, but --seq-len 30 .* --seq-len 32"
    ):
        Layout(mp=4, sp=True).check_seq_len(30)
    Layout(mp=4).check_seq_len(30)  # without --sp the sequence is not split
    with pytest.raises(
        ConfigError, match=r"--batch-size 3 is not a multiple of dp=2 \(--mesh 2x1 is DPxMP\)"
    ):
        Layout(dp=2).check_batch(3)
    with pytest.raises(ConfigError, match="dp x accum_steps = 2 x 2; use e.g. --batch-size 8"):
        Layout(dp=2).check_batch(6, 2)


def test_a_layout_is_one_value_from_a_mesh_or_from_sizes():
    mesh = make_mesh(2, 2)
    layout = Layout.of(mesh, fsdp=True)
    assert layout == Layout(dp=2, mp=2, fsdp=True) and layout.mesh is mesh  # the mesh is not the value
    assert Layout.of(layout) is layout and Layout.of(layout, sp=True).mesh is mesh
    assert layout.label() == "2x2 + FSDP" and Layout(dp=2, mp=2, sp=True).label() == "2x2 + SP"
    assert Layout.from_dict(layout.to_dict()) == layout
    par = Parallel.on(Layout(dp=2, mp=4, sp=True))
    assert par == Parallel(Layout(dp=2, mp=4, sp=True), sharded=True) and par.layout.mp == 4
    with pytest.raises(ConfigError, match="unknown layout field"):
        Layout.from_dict({"dp": 1, "mp": 1, "zz": 2})


def test_checkpoint_meta_records_the_layout():
    tcfg, cfg = resolve(TrainConfig(config="tiny-lm", fsdp=True))
    meta = checkpoint_meta(tcfg, cfg, 3, Layout(dp=2, mp=2, fsdp=True))
    assert meta["layout"] == {"dp": 2, "mp": 2, "fsdp": True, "sp": False}
    assert meta["mesh"] == {"dp": 2, "mp": 2}  # as before the layout was recorded: older readers keep working


def test_communication_rows_name_only_the_options_that_are_on():
    """Formerly "+ FSDP" on every run: the options were read from a dict that is never empty."""
    cfg = get_config("tiny")
    params, _ = init_model(cfg, make_mesh(1, 2), 0)
    got = {kind: {"count": 0, "bytes": 0} for kind in COLLECTIVES}
    shape = {"batch_shape": (2, 8), "itemsize": 4, "params": params}
    plain = communication_checks(cfg, Layout(dp=1, mp=2), got, **shape)[0]["detail"]
    assert "ff on 1x2 (per layer" in plain and "FSDP" not in plain and "SP" not in plain
    with_sp = communication_checks(cfg, Layout(dp=1, mp=2, sp=True), got, **shape)[0]["detail"]
    assert "ff on 1x2 + SP (per layer" in with_sp
    assert jax.tree.leaves(params)  # the rows were computed from real parameters


def test_warnings_are_one_clean_line(tmp_path):
    """A warning a command prints is ``meshlm: warning: ...`` on one line, not Python's
    ``file.py:67: UserWarning: ...`` followed by the source line that raised it."""
    import subprocess

    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("some text to tokenize\n")
    with open(data / "big.txt", "wb") as f:  # sparse: over the directory scan's 50 MiB file limit
        f.truncate(51 * 2**20)
    argv = meshlm_argv(
        "data", "prepare", "--data", str(data), "--out", str(tmp_path / "out"), "--workers", "1"
    )
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    shown = ("big.txt", "Warning", "warnings.warn(")  # the message, Python's category, the source line
    lines = [line for line in out.stderr.splitlines() if any(s in line for s in shown)]
    assert lines == [
        f"meshlm: warning: skipping {data / 'big.txt'}: 51 MiB is over the 50 MiB limit for files found "
        "in directories or globs; name the file directly to include it"
    ]
