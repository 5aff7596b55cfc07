"""Every impossible value is refused before any work starts: one line naming the flag, exit code 2.

Flags out of range fail while argparse parses them (``meshlm CMD: error: argument --FLAG: must be ...``,
one line, no usage block); values only the mesh or the file system can rule out fail in the command's
``run`` before ``setup`` (``meshlm: error: ...``). Library users get the same ranges from the configs.
Nothing here trains or compiles.
"""

import os

import pytest
from helpers import run_cli

from meshlm.errors import ConfigError
from meshlm.train.config import TrainConfig

# (command line, the flag the message names, what the message says the value must be)
BAD_FLAGS = [
    ("train --lr -1", "--lr", "must be a finite number > 0, got -1.0"),
    ("train --lr nan", "--lr", "must be a finite number > 0, got nan"),
    ("train --lr inf", "--lr", "must be a finite number > 0, got inf"),
    ("train --weight-decay nan", "--weight-decay", "must be a finite number >= 0, got nan"),
    ("train --clip-norm -1", "--clip-norm", "must be a finite number >= 0 (0 disables), got -1.0"),
    ("train --warmup-steps -5", "--warmup-steps", "must be an integer >= 0, got -5"),
    ("train --eval-every -1", "--eval-every", "must be an integer >= 0 (0: only at the end), got -1"),
    ("train --save-every -1", "--save-every", "must be an integer >= 0 (0: only at the end), got -1"),
    ("train --sample-tokens -1", "--sample-tokens", "must be an integer >= 0 (0: none), got -1"),
    ("train --seq-len -1", "--seq-len", "must be an integer in [0, 16,777,216] (0: the preset's default; no"),
    ("train --seq-len 1000000000000", "--seq-len", "must be an integer in [0, 16,777,216] (0: the preset"),
    ("train --steps 0", "--steps", "must be an integer >= 1, got 0"),
    ("train --steps abc", "--steps", "must be an integer >= 1, got 'abc'"),
    ("train --seed -1", "--seed", "must be an integer >= 0, got -1"),
    ("verify --steps -5", "--steps", "must be an integer in [0, 10000], got -5"),
    ("verify --batch-size 0", "--batch-size", "must be an integer >= 1, got 0"),
    ("verify --batch-size -2", "--batch-size", "must be an integer >= 1, got -2"),
    ("verify --seq-len -3", "--seq-len", "must be an integer >= 2, got -3"),
    ("verify --seq-len 0", "--seq-len", "must be an integer >= 2, got 0"),
    ("bench --gen-tokens -1", "--gen-tokens", "must be an integer >= 0, got -1"),
    ("bench --peak-n 0", "--peak-n", "must be an integer >= 1, got 0"),
    ("bench --warmup -1", "--warmup", "must be an integer >= 0, got -1"),
    ("generate --checkpoint c --max-new-tokens 0", "--max-new-tokens", "must be an integer >= 1, got 0"),
    ("generate --checkpoint c --temperature -1", "--temperature", "must be a finite number >= 0, got -1.0"),
    ("generate --checkpoint c --temperature nan", "--temperature", "must be a finite number >= 0, got nan"),
    ("generate --checkpoint c --top-k -1", "--top-k", "must be an integer >= 0, got -1"),
    ("generate --checkpoint c --top-p 0", "--top-p", "must be a finite number in (0, 1], got 0.0"),
    ("generate --checkpoint c --top-p 1.5", "--top-p", "must be a finite number in (0, 1], got 1.5"),
    ("launch -n 0 -- verify", "-n/--num-processes", "must be an integer >= 1, got 0"),
    (
        "launch -n 2 --devices-per-process 0 -- verify",
        "--devices-per-process",
        "must be an integer in [1, 4096], got 0",
    ),
    ("memory --devices 100000", "--devices", "must be an integer in [1, 4096], got 100000"),
    ("memory --devices 0", "--devices", "must be an integer in [1, 4096], got 0"),
    ("memory --init-timeout 0", "--init-timeout", "must be an integer >= 1, got 0"),
    ("memory --num-processes 0", "--num-processes", "must be an integer >= 1, got 0"),
    ("memory --process-id -1", "--process-id", "must be an integer >= 0, got -1"),
    ("convert --to-hf c --out o --seed -1", "--seed", "must be an integer >= 0, got -1"),
]


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a command gets as far as devices (or launching processes)."""

    def too_late(*args, **kwargs):
        raise AssertionError("a bad value must be refused before setup")

    for command in ("train", "verify", "bench", "generate", "memory", "convert"):
        monkeypatch.setattr(f"meshlm.cli.{command}.setup", too_late)
    monkeypatch.setattr("meshlm.parallel.launch.main_launch", too_late)


def _one_error_line(err: str, prefix: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    return lines[0]


@pytest.mark.parametrize(("argv", "flag", "message"), BAD_FLAGS, ids=[case[0] for case in BAD_FLAGS])
def test_bad_flag_fails_while_parsing(argv, flag, message, no_work, capsys):
    command = argv.split()[0]
    with pytest.raises(SystemExit) as exc:
        run_cli(*argv.split())
    assert exc.value.code == 2
    line = _one_error_line(capsys.readouterr().err, f"meshlm {command}: error: ")
    assert f"argument {flag}: {message}" in line, line


# (command line, the one-line message): values only the mesh rules out, refused by `run` before `setup`
BAD_FOR_THE_MESH = [
    (
        "verify --batch-size 3 --mesh 2x2",
        "--batch-size 3 is not a multiple of dp=2 (--mesh 2x2 is DPxMP); use e.g. --batch-size 4",
    ),
    (
        "bench --batch-size 6 --mesh 4x1",
        "--batch-size 6 is not a multiple of dp=4 (--mesh 4x1 is DPxMP); use e.g. --batch-size 8",
    ),
    ("verify --mesh 0x2", "bad --mesh '0x2': expected DPxMP with positive integers"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_FOR_THE_MESH, ids=[case[0] for case in BAD_FOR_THE_MESH])
def test_value_the_mesh_rules_out_fails_before_setup(argv, message, no_work, capsys):
    assert run_cli(*argv.split()) == 2
    line = _one_error_line(capsys.readouterr().err, "meshlm: error: ")
    assert message in line, line


def test_bench_out_is_an_existing_file(no_work, tmp_path, capsys):
    out = tmp_path / "bench.json"
    out.write_text("keep me")
    assert run_cli("bench", "--out", str(out)) == 2
    line = _one_error_line(capsys.readouterr().err, "meshlm: error: ")
    assert f"--out {out} is an existing file" in line and "directory" in line, line
    assert out.read_text() == "keep me" and sorted(tmp_path.iterdir()) == [out]


def test_process_id_out_of_range_fails_in_setup_before_work(monkeypatch, capsys):
    """Only the pair is out of range, so the flags parse; setup refuses it before joining any job."""
    for name in ("JAX_COMPILATION_CACHE_DIR",):  # setup drops it for multi-process runs: restore it after
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])
    monkeypatch.setattr("meshlm.perf.memory.memory_report", lambda *a: pytest.fail("work was done"))
    argv = "memory --coordinator 127.0.0.1:1234 --num-processes 2 --process-id 2"
    assert run_cli(*argv.split()) == 2
    line = _one_error_line(capsys.readouterr().err, "meshlm: error: ")
    assert "process_id must be an int in [0, 2)" in line, line


# (TrainConfig keyword arguments, the start of the ConfigError message)
BAD_TRAIN_CONFIGS = [
    ({"lr": -1}, "lr must be a finite number > 0, got -1 (the default is --lr 0.003)"),
    ({"lr": float("nan")}, "lr must be a finite number > 0, got nan"),
    ({"lr": float("inf")}, "lr must be a finite number > 0, got inf"),
    ({"weight_decay": float("nan")}, "weight_decay must be a finite number >= 0, got nan"),
    ({"clip_norm": -1.0}, "clip_norm must be a finite number >= 0 (0 disables), got -1.0"),
    ({"warmup_steps": -5}, "warmup_steps must be an integer >= 0, got -5"),
    ({"min_lr_ratio": 1.5}, "min_lr_ratio must be a finite number in [0, 1], got 1.5"),
    ({"eval_every": -1}, "eval_every must be an integer >= 0 (0: only at the end), got -1"),
    ({"save_every": -1}, "save_every must be an integer >= 0 (0: only at the end), got -1"),
    ({"sample_tokens": -1}, "sample_tokens must be an integer >= 0 (0: none), got -1"),
    ({"seq_len": -1}, "seq_len must be an integer in [0, 16,777,216] (0: the preset's default; no model"),
    ({"steps": 0}, "steps must be an integer >= 1, got 0 (the default is --steps 280)"),
    ({"steps": 2.5}, "steps must be an integer >= 1, got 2.5"),
    ({"batch_size": 0}, "batch_size must be an integer >= 1, got 0"),
    ({"seed": -1}, "seed must be an integer >= 0, got -1"),
    (
        {"batch_size": 6, "accum_steps": 4},
        "batch_size=6 is not divisible by accum_steps=4; use e.g. --batch-size 8",
    ),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_TRAIN_CONFIGS, ids=[str(k) for k, _ in BAD_TRAIN_CONFIGS])
def test_train_config_rejects_impossible_values(kwargs, message):
    with pytest.raises(ConfigError) as exc:
        TrainConfig(**kwargs)
    assert str(exc.value).startswith(message), str(exc.value)


def test_train_config_keeps_its_special_zeros():
    """0 has a meaning for these (preset default, never, none, no clipping): still accepted."""
    cfg = TrainConfig(seq_len=0, eval_every=0, save_every=0, sample_tokens=0, clip_norm=0.0, weight_decay=0)
    assert cfg.seq_len == 0 and cfg.clip_norm == 0.0


def test_bench_settings_reject_negative_gen_tokens_and_peak_n():
    from meshlm.model.config import get_config
    from meshlm.parallel.layout import Layout
    from meshlm.parallel.mesh import make_mesh
    from meshlm.perf.bench import BenchSettings, run_bench

    with pytest.raises(ConfigError, match="--gen-tokens must be >= 0"):
        BenchSettings(seq_len=8, gen_new_tokens=-1).check(get_config("tiny-llama"), Layout(dp=2))
    # Refused before the implementations are built or compiled.
    with pytest.raises(ConfigError, match="--peak-n 0 is too small to measure a peak"):
        run_bench(get_config("tiny-llama"), "tiny-llama", make_mesh(2, 2), BenchSettings(seq_len=8), peak_n=0)
