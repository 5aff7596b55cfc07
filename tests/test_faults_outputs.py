"""Nothing outside --out is written: an output that is a link out of the run directory (or a special
file) is refused before the run writes anything; writes never follow a link that appears later.
Data paths that are not regular files (a FIFO, a device) are one-line errors, never opened."""

import hashlib
import os

import pytest
from helpers import run_cli, run_meshlm, train_args, train_rows, write_corpus

from meshlm.errors import CheckpointError
from meshlm.train import outputs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _snapshot(path):
    """name -> sha256 of every file under ``path`` (or of ``path`` itself): unchanged means untouched."""
    if path.is_file():
        return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()}
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def _outside(tmp_path, is_dir):
    """A user's file or directory outside the run directory, with content to protect."""
    target = tmp_path / "outside"
    if is_dir:
        target.mkdir()
        (target / "keep.txt").write_text("the user's file\n")
    else:
        target.write_text('{"step": 999, "loss": 1.0}\nthe user\'s file\n')
    return target


def _train(corpus, out, steps=2):
    return run_cli(*train_args(corpus, out, steps, save_every=2), "--mesh", "1x2")


def _error_line(err):
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and lines[0].startswith("meshlm: error: "), err
    return lines[0]


# ---------------------------------------------------------------- outputs planted as links


@pytest.mark.parametrize(
    ("name", "is_dir", "refused"),
    [
        ("loss_curve.png", False, True),
        ("metrics.jsonl", False, True),
        ("metrics.tmp", False, False),  # not a name the run writes (its temp files are new names)
        ("tensorboard", True, True),
        (".lock", False, True),  # the run lock itself: never opened through a link
    ],
)
def test_output_link_out_of_the_run_is_never_written_through(corpus, tmp_path, capsys, name, is_dir, refused):
    target = _outside(tmp_path, is_dir)
    before = _snapshot(target)
    run = tmp_path / "run"
    run.mkdir()
    (run / name).symlink_to(target, target_is_directory=is_dir)
    code = _train(corpus, run)
    if refused:
        assert code == 2
        line = _error_line(capsys.readouterr().err)
        assert f"{run / name} is a symbolic link (to {target})" in line and "remove it" in line
        assert not (run / "metrics.jsonl").exists() or name == "metrics.jsonl"
    else:
        assert code == 0, capsys.readouterr().err
        assert [r["step"] for r in train_rows(run)] == [1, 2]
    assert _snapshot(target) == before
    assert (run / name).is_symlink()  # the user's link is left as it was


def test_link_inside_tensorboard_is_refused(corpus, tmp_path, capsys):
    target = _outside(tmp_path, False)
    before = _snapshot(target)
    (tmp_path / "run" / "tensorboard").mkdir(parents=True)
    (tmp_path / "run" / "tensorboard" / "events.out.tfevents.1.host").symlink_to(target)
    assert _train(corpus, tmp_path / "run") == 2
    assert "events.out.tfevents.1.host is a symbolic link" in _error_line(capsys.readouterr().err)
    assert _snapshot(target) == before


def test_fifo_as_an_output_is_refused_without_blocking(corpus, tmp_path, capsys):
    (tmp_path / "run").mkdir()
    os.mkfifo(tmp_path / "run" / "metrics.jsonl")
    assert _train(corpus, tmp_path / "run") == 2
    assert "metrics.jsonl is a FIFO, not a regular file" in _error_line(capsys.readouterr().err)


def test_out_itself_that_is_a_link_is_refused(corpus, tmp_path, capsys):
    """Refused, not followed: a run writes only inside the directory it is given (issue 36)."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    assert _train(corpus, tmp_path / "link") == 2
    line = _error_line(capsys.readouterr().err)
    assert f"--out {tmp_path / 'link'} is a symbolic link (to {tmp_path / 'real'})" in line, line
    assert list((tmp_path / "real").iterdir()) == []


# ---------------------------------------------------------------- a link that appears after the check


def test_writes_never_follow_a_link_that_appears_later(tmp_path):
    target = _outside(tmp_path, False)
    before = _snapshot(target)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(target)
    with pytest.raises(CheckpointError, match=r"cannot open .*metrics\.jsonl.*remove it"):
        outputs.append_text(run / "metrics.jsonl", "{}\n")
    with pytest.raises(CheckpointError, match="cannot open"):
        outputs.read_text(run / "metrics.jsonl")
    (run / "loss_curve.png").symlink_to(target)
    outputs.replace_text(run / "loss_curve.png", "new\n")  # replaces the link itself
    assert not (run / "loss_curve.png").is_symlink()
    assert (run / "loss_curve.png").read_text() == "new\n"
    assert _snapshot(target) == before
    assert sorted(p.name for p in run.iterdir()) == ["loss_curve.png", "metrics.jsonl"]  # no temp left


def test_rewrite_breaks_a_hard_link(tmp_path):
    """A hard-linked copy (``cp -al RUN backup``) keeps its content when the run rewrites its log."""
    (tmp_path / "run").mkdir()
    copy = tmp_path / "copy.jsonl"
    copy.write_text("a\n")
    os.link(copy, tmp_path / "run" / "metrics.jsonl")
    outputs.replace_text(tmp_path / "run" / "metrics.jsonl", "b\n")
    outputs.append_text(tmp_path / "run" / "metrics.jsonl", "c\n")
    assert copy.read_text() == "a\n"
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == "b\nc\n"


# ---------------------------------------------------------------- data that is not a regular file


@pytest.mark.parametrize(("kind", "what"), [("fifo", "a FIFO"), ("device", "a character device")])
def test_special_file_as_data_is_one_line_without_blocking(tmp_path, kind, what):
    if kind == "fifo":
        data = tmp_path / "pipe"
        os.mkfifo(data)
    else:
        data = "/dev/zero"
    out = tmp_path / "run"
    proc = run_meshlm("train", "--data", str(data), "--config", "tiny-lm", "--out", str(out), timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = _error_line(proc.stderr)
    assert f"{data}' is not a regular file ({what}): pass text files, directories or globs" in line
    assert not out.exists()  # refused before the run directory was made
