"""Every command's flags come from its settings dataclass; one default sequence length; one byte format.

``train``, ``verify``, ``bench`` and ``plan`` build their own flags from the fields of ``TrainConfig``,
``VerifySettings``, ``BenchSettings`` and ``PlanCommand`` (``meshlm.cli.common.add_flags``): a field
is a flag with its help, range and default, and the parsed flags build the dataclass back.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from meshlm.cli import bench, plan, train, verify
from meshlm.cli.common import settings_from
from meshlm.cli.verify_settings import VerifySettings
from meshlm.errors import ConfigError
from meshlm.model.config import default_seq_len, get_config
from meshlm.perf.bench_settings import BenchSettings
from meshlm.perf.plan_settings import PlanCommand
from meshlm.settings import CLI_HIDDEN, SEQ_LEN_DEFAULT_TEXT
from meshlm.train.config import TrainConfig
from meshlm.units import format_bytes, parse_bytes

COMMANDS = {"train": (train, TrainConfig), "verify": (verify, VerifySettings)}
COMMANDS |= {"bench": (bench, BenchSettings), "plan": (plan, PlanCommand)}


def _parser(name: str) -> argparse.ArgumentParser:
    sub = argparse.ArgumentParser().add_subparsers()
    COMMANDS[name][0].add_parser(sub)
    return sub.choices[name]


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_field_is_a_flag_and_the_defaults_agree(name):
    parser, cls = _parser(name), COMMANDS[name][1]
    dests = vars(parser.parse_args([]))
    for f in dataclasses.fields(cls):
        assert f.metadata.get("help"), f"{name}: {f.name} has no help"
        assert f.name in dests or f.metadata["cli"] == CLI_HIDDEN, f"{name}: {f.name} has no flag"
    assert settings_from(parser.parse_args([]), cls) == cls()  # flag defaults = field defaults


@pytest.mark.parametrize(
    ("name", "argv", "want"),
    [
        ("verify", ["--no-collectives", "--seq-len", "32", "--remat", "full"], {"collectives": False}),
        ("bench", ["--gen-tokens", "0", "--memory-options"], {"gen_new_tokens": 0, "memory_options": True}),
        (
            "plan",
            ["--bf16", "--device-memory", "1GiB"],
            {"compute_dtype": "bfloat16", "device_memory": 2**30},
        ),
    ],
)
def test_flags_build_the_settings(name, argv, want):
    got = settings_from(_parser(name).parse_args(argv), COMMANDS[name][1])
    assert {k: getattr(got, k) for k in want} == want


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_one_default_sequence_length_stated_in_every_help(name):
    assert SEQ_LEN_DEFAULT_TEXT in " ".join(_parser(name).format_help().split())
    assert SEQ_LEN_DEFAULT_TEXT == "min(128, the model's max_seq_len)"


def test_the_default_sequence_length_rule():
    assert default_seq_len(get_config("small")) == 128  # max_seq_len 256
    assert default_seq_len(get_config("tiny-llama")) == 64  # max_seq_len 64
    assert default_seq_len(get_config("tiny-llama"), 32) == 32  # given: kept
    plan_run = PlanCommand(config="llama2-7b").settings(get_config("llama2-7b"))
    assert plan_run.seq_len == 128 and plan_run.remat == "none"


def test_verify_settings_check_their_ranges():
    with pytest.raises(ConfigError, match="seq_len must be an integer >= 2"):
        VerifySettings(seq_len=1)


@pytest.mark.parametrize(
    ("n", "unit", "digits", "text"),
    [
        (3 * 2**30 // 2, None, 2, "1.50 GiB"),
        (5 * 2**20, None, 2, "5.00 MiB"),
        (512, None, 2, "0.50 KiB"),
        (8 * 2**20, "MiB", None, "8 MiB"),
        (2**30, "GiB", 3, "1.000 GiB"),
        (None, None, 2, "-"),
    ],
)
def test_one_byte_format_binary_units(n, unit, digits, text):
    assert format_bytes(n, unit, digits) == text


def test_decimal_units_are_read_as_powers_of_ten():
    assert parse_bytes("1MB") == 10**6 and parse_bytes("1MiB") == 2**20 and parse_bytes("2 gb") == 2 * 10**9
    with pytest.raises(ValueError, match="must be a size with a unit"):
        parse_bytes("12")
