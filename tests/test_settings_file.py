"""``--settings FILE``: every command's settings from a TOML file of its flags' names, flags overriding
it; a training run writes its resolved settings as that file and runs again from it. And the mesh:
every command that takes one takes the same mesh flags (``MeshFlags``), refusing in one line the
options it runs without."""

from __future__ import annotations

import dataclasses
import importlib
import tomllib

import pytest
from helpers import run_cli, train_args, write_corpus

from meshlm.cli import build_parser
from meshlm.cli.common import settings_from
from meshlm.cli.settings_file import parse_args
from meshlm.cli.verify_settings import VerifySettings
from meshlm.io.checkpoint import Checkpointer
from meshlm.parallel.layout import CP_STRATEGIES
from meshlm.parallel.pipeline_schedule import SCHEDULES
from meshlm.perf.bench_settings import BenchSettings
from meshlm.perf.plan_settings import PlanCommand
from meshlm.settings import (
    CLI_HIDDEN,
    CP_STRATEGY_NAMES,
    MESH_OPTIONS,
    PP_SCHEDULE_NAMES,
    WITHOUT,
    MeshFlags,
    flag_name,
    toml_text,
)
from meshlm.train.config import TrainConfig, resolve
from meshlm.train.eval_settings import EvalConfig

MESH_COMMANDS = ("train", "verify", "bench", "plan", "eval", "generate", "memory")
REQUIRED = {"generate": ["--checkpoint", "c"]}

# One value of every kind away from its default: switches, lists, None-defaults, byte sizes.
SETTINGS = {
    "train": TrainConfig(
        config="tiny-lm", data=("a", "b c"), steps=3, lr=1e-2, compute_dtype="bfloat16", pp=2, fsdp=True
    ),
    "verify": VerifySettings(config="tiny-llama", steps=2, x64=True, batch_size=4, collectives=False, cp=2),
    "plan": PlanCommand(config="tiny-llama", device_memory=2**30, remat="full", pp=2, pp_schedule="gpipe"),
    "bench": BenchSettings(config="tiny-llama", gen_new_tokens=0, vocab_size=300, memory_options=True),
    "eval": EvalConfig(checkpoint="runs/x", data=("d",), split="train", batch_size=2),
}


def _file(tmp_path, values: dict, name: str = "s.toml") -> str:
    path = tmp_path / name
    path.write_text(toml_text(values))
    return str(path)


def _fields(settings) -> dict:
    return {
        f.name: getattr(settings, f.name)
        for f in dataclasses.fields(settings)
        if f.metadata["cli"] != CLI_HIDDEN
    }


@pytest.mark.parametrize("command", sorted(SETTINGS))
def test_a_settings_file_round_trips(command, tmp_path):
    want = SETTINGS[command]
    args = parse_args(build_parser(), [command, "--settings", _file(tmp_path, _fields(want))])
    assert settings_from(args, type(want)) == want


def test_flags_override_the_file(tmp_path):
    path = _file(tmp_path, {"steps": 3, "fsdp": True, "mesh": "2x2", "data": ["a"]})
    args = parse_args(build_parser(), ["train", "--settings", path, "--steps", "5", "--data", "b"])
    tcfg = settings_from(args, TrainConfig)
    assert (tcfg.steps, tcfg.fsdp, tcfg.data, args.mesh) == (5, True, ("b",), "2x2")
    # a switch the file turns on, the command line turns off
    args = parse_args(build_parser(), ["train", "--settings", path, "--no-fsdp"])
    assert settings_from(args, TrainConfig).fsdp is False
    # a required flag may come from the file
    path = _file(tmp_path, {"checkpoint": "runs/x", "prompt": ["hi"]}, "g.toml")
    args = parse_args(build_parser(), ["generate", "--settings", path])
    assert (args.checkpoint, args.prompt) == ("runs/x", ["hi"])


BAD = [
    ("lrr = 1", "unknown setting 'lrr'; valid: accum_steps, attention, "),
    ('lr = "abc"', "lr must be a number, got 'abc'"),
    ("steps = 1.5", "steps must be an integer, got 1.5"),
    ("steps = 0", "steps: must be an integer >= 1, got 0"),
    ("fsdp = 1", "fsdp must be true or false, got 1"),
    (
        'remat = "most"',
        "remat must be one of none, full, selective, save_qkv_proj, save_qkv_mlp_in, save_qkv_attn, "
        "got 'most'",
    ),
    ('data = "a"', "data must be a list, got 'a'"),
    ("compute_dtype = true", "compute_dtype must be a string, got True"),
    ("steps = ", "not a TOML file"),
]


@pytest.mark.parametrize(("text", "message"), BAD, ids=[case[0] for case in BAD])
def test_a_bad_settings_file_is_one_line(text, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("meshlm.cli.common._setup", lambda *a, **k: pytest.fail("refused before devices"))
    (tmp_path / "bad.toml").write_text(text + "\n")
    assert run_cli("train", "--settings", str(tmp_path / "bad.toml")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"meshlm: error: --settings {tmp_path}/bad.toml: ")
    assert message in err, err


@pytest.mark.parametrize("command", MESH_COMMANDS)
def test_every_mesh_command_takes_the_same_mesh_flags(command):
    sub = build_parser()._subparsers._group_actions[0].choices[command]
    flags = {s for a in sub._actions for s in a.option_strings}
    assert set(WITHOUT) == set(MESH_OPTIONS)  # each option says what a command lacking it runs without
    assert (PP_SCHEDULE_NAMES, CP_STRATEGY_NAMES) == (SCHEDULES, CP_STRATEGIES)  # stated twice: no JAX here
    want = {flag_name(f) for f in dataclasses.fields(MeshFlags)} | {"--mesh", "--devices", "--settings"}
    assert want <= flags, sorted(want - flags)
    argv = "--mesh 2x1 --pp 2 --microbatches 4 --pp-schedule gpipe --cp 1 --cp-strategy allgather --fsdp --sp"
    args = build_parser().parse_args([command, *REQUIRED.get(command, []), *argv.split()])
    want = MeshFlags(pp=2, microbatches=4, pp_schedule="gpipe", cp_strategy="allgather", fsdp=True, sp=True)
    if command == "verify":  # unset, verify picks an exposing V itself (meshlm.proof.defaults)
        want = dataclasses.replace(want, virtual_stages=None)
    assert settings_from(args, MeshFlags) == want


REFUSED = {
    "eval --checkpoint c --fsdp": "meshlm eval runs without FSDP (--fsdp); drop it (a checkpoint",
    "generate --checkpoint c --prompt x --sp": "meshlm generate runs without sequence parallelism (--sp)",
    "memory --pp 2": "meshlm memory has no pipeline (--pp 2)",
    "memory --sp": "meshlm memory runs without sequence parallelism (--sp); drop it (meshlm plan counts it)",
    "bench --fsdp": "meshlm bench runs without FSDP (--fsdp); drop it (--memory-options times FSDP",
}


@pytest.mark.parametrize(("argv", "message"), REFUSED.items(), ids=REFUSED.keys())
def test_a_mesh_option_a_command_runs_without_is_one_line(argv, message, monkeypatch, capsys):
    monkeypatch.setattr("meshlm.cli.common._setup", lambda *a, **k: pytest.fail("refused before devices"))
    assert run_cli(*argv.split()) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_a_run_writes_its_settings_and_runs_again_from_them(tmp_path, monkeypatch):
    """settings.toml, fed back, resolves to the run's settings and mesh, and resumes the run. Start-up
    computes the parameter specs once (it did five times: twice per check, once more to initialise)."""
    specs = []
    for module in ("meshlm.train.run", "meshlm.train.step", "meshlm.io.model_io"):
        counted = _counted(specs, importlib.import_module(module).model_specs)
        monkeypatch.setattr(f"{module}.model_specs", counted)
    (tmp_path / "corpus").mkdir()
    argv = train_args(write_corpus(tmp_path / "corpus"), tmp_path / "run", 1, save_every=1)
    argv += ["--mesh", "1x2", "--eval-batches", "1"]
    assert run_cli(*argv) == 0
    assert len(specs) == 1
    written = tmp_path / "run" / "settings.toml"
    assert "fresh" not in tomllib.loads(written.read_text())
    again = parse_args(build_parser(), ["train", "--settings", str(written)])
    given = build_parser().parse_args(argv)
    assert resolve(settings_from(again, TrainConfig))[0] == resolve(settings_from(given, TrainConfig))[0]
    assert (again.mesh, again.devices) == ("1x2", 2)
    assert run_cli("train", "--settings", str(written), "--steps", "2") == 0  # resumes at step 1
    assert Checkpointer(tmp_path / "run").all_steps() == [1, 2]
    assert tomllib.loads(written.read_text())["steps"] == 2


def _counted(calls: list, fn):
    def wrapped(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return wrapped
