"""The ranges of post-training's flags (issue 59 item 5): --lora-rank at most its targets' widths, LoRA's
other flags only with --lora-rank, --dpo-beta where float32 stays finite. Each is one line on stderr and
exit code 2 before devices start, with nothing written to --out. Nothing here compiles."""

import json

import pytest
from helpers import run_cli

from meshlm.errors import ConfigError
from meshlm.model.config import get_config
from meshlm.train.config import TrainConfig

# tiny-llama: d_model 64, 8 heads of 8, 4 KV heads (k, v: 64 x 32), d_ff 128
TOO_WIDE = "--lora-rank 33 exceeds the smallest width of the weights it adapts: k (attn/wk) is 64 x 32; "
TOO_WIDE += "give --lora-rank R <= 32"


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a command gets as far as devices."""

    def too_late(*args, **kwargs):
        raise AssertionError("a bad value must be refused before setup")

    for command in ("train", "verify"):
        monkeypatch.setattr(f"meshlm.cli.{command}.setup", too_late)


@pytest.fixture
def base(tmp_path):
    """A checkpoint as far as a check before devices reads it: a complete step's meta (no arrays)."""
    step = tmp_path / "base" / "0"
    (step / "meta").mkdir(parents=True)
    (step / "commit_success.txt").write_text("")
    meta = {"format": "meshlm-checkpoint-v1", "model_config": get_config("tiny-llama").to_dict()}
    (step / "meta" / "metadata").write_text(json.dumps(meta))
    return step.parent


def _refused(argv: list[str], capsys, parsing: bool = False) -> str:
    """The one error line of ``meshlm ARGV`` (exit code 2); ``parsing``: argparse's own."""
    if parsing:
        with pytest.raises(SystemExit) as exc:
            run_cli(*argv)
        assert exc.value.code == 2
    else:
        assert run_cli(*argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("command", ["train", "verify --checkpoint", "verify --config"])
def test_lora_rank_above_its_targets_widths_is_one_line(command, base, tmp_path, no_work, capsys):
    out = tmp_path / "run"
    argv = {
        "train": ["train", "--checkpoint", str(base), "--out", str(out)],
        "verify --checkpoint": ["verify", "--checkpoint", str(base)],
        "verify --config": ["verify", "--config", "tiny-llama"],
    }[command]
    assert TOO_WIDE in _refused([*argv, "--lora-rank", "33"], capsys)
    assert not out.exists()


def test_lora_rank_is_checked_against_the_targets_it_names():
    llama = get_config("tiny-llama")
    assert llama.replace(lora_rank=32, lora_targets="q,k,v,o").lora_rank == 32  # k and v are 32 wide
    assert llama.replace(lora_rank=64, lora_targets="q,o,gate,up,down").lora_rank == 64
    with pytest.raises(ConfigError, match=r"gate \(mlp/w_gate\) is 64 x 128; give --lora-rank R <= 64$"):
        llama.replace(lora_rank=65, lora_targets="gate,up")
    with pytest.raises(ConfigError, match="exceeds the smallest width"):  # library users alike
        llama.replace(lora_rank=10**9, lora_targets="q")


ALPHA = (
    "--lora-alpha applies to LoRA adapters; give --lora-rank R > 0, or drop --lora-alpha for a full fine-tune"
)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ("train --lora-alpha 16", ALPHA),
        ("train --lora-rank 0 --lora-alpha 16", ALPHA),
        ("verify --lora-alpha 16", ALPHA),
        (
            "train --lora-targets q,v --lora-dropout 0.1",
            "--lora-targets and --lora-dropout apply to LoRA adapters; give --lora-rank R > 0, or drop "
            "--lora-targets and --lora-dropout for a full fine-tune",
        ),
    ],
)
def test_lora_flags_without_a_rank_are_one_line(argv, message, tmp_path, no_work, capsys):
    out = tmp_path / "run"
    line = _refused([*argv.split(), *(["--out", str(out)] if argv.startswith("train") else [])], capsys)
    assert line == f"meshlm: error: {message}", line
    assert not out.exists()
    with pytest.raises(ConfigError, match="--lora-alpha applies to LoRA adapters"):  # library users alike
        TrainConfig(lora_alpha=16.0)


@pytest.mark.parametrize("beta", ["1e30", "1001", "0", "-1", "1e-5", "nan"])
def test_dpo_beta_outside_its_range_is_one_line(beta, tmp_path, no_work, capsys):
    out = tmp_path / "run"
    line = _refused(["train", "--objective", "dpo", "--dpo-beta", beta, "--out", str(out)], capsys, True)
    assert "argument --dpo-beta: must be a finite number in [0.001, 1000] (DPO's usual 0.01-0.5)" in line
    assert not out.exists()


def test_dpo_beta_range_in_the_library():
    assert TrainConfig(dpo_beta=1e-3).dpo_beta == 1e-3 and TrainConfig(dpo_beta=1e3).dpo_beta == 1e3
    with pytest.raises(ConfigError, match=r"dpo_beta must be a finite number in \[0.001, 1000\]"):
        TrainConfig(dpo_beta=1e30)
