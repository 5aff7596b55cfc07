"""The fourth reliability pass (issue 36, cases 4 and 6): the wrong answers and unclear behaviours of
a held-out probe, each reproduced. One owner per output directory, named; nothing written outside
--out; a refused command leaves nothing that blocks its rerun; one error line per bad flag. The fifth
probe's (issue 47, item 2) at the end: the capacity factor's bound, MoE routing metrics under --pp, no
merge-conflict marker in the tree, empty data lists and paths, settings.toml's absolute out and the
fresh-start line, --out that is the --checkpoint, the cp prefill's docs, a z-loss model's export."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from helpers import run_cli, write_corpus

from meshlm.data.store import write_marker
from meshlm.io.run_lock import LOCK_FILE, RunLock


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _last_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    return lines[0]


# ---------------------------------------------------------------- a live command's output is in use


def _live_prepare(out: Path) -> RunLock:
    """``out`` as a live `data prepare` leaves it mid-way: its lock held, its marker and a token file
    written, no index.json yet. Held by this process: a second open of the lock conflicts all the same."""
    lock = RunLock(out).acquire()
    write_marker(out)
    (out / "train.tokens").write_bytes(b"\0" * 64)
    return lock


def test_prepare_on_a_live_prepares_out_names_its_owner(corpus, tmp_path, capsys):
    out = tmp_path / "store"
    lock = _live_prepare(out)
    try:
        code = run_cli("data", "prepare", "--data", corpus, "--out", str(out), "--workers", "1")
        line = _last_error(capsys)
    finally:
        lock.release()
    assert code == 2 and f"in use by another run (pid {os.getpid()} on host " in line, line
    assert "interrupted" not in line


@pytest.mark.parametrize("direction", ["--to-hf", "--from-hf"])
def test_convert_into_a_live_runs_out_names_its_owner(tmp_path, capsys, direction):
    out = tmp_path / "hf"
    lock = RunLock(out).acquire()
    (out / "config.json").write_text("{}\n")  # what the live conversion wrote so far
    try:
        code = run_cli("convert", direction, str(tmp_path / "absent"), "--out", str(out))
        line = _last_error(capsys)
    finally:
        lock.release()
    assert code == 2 and f"in use by another run (pid {os.getpid()} on host " in line, line
    assert "not an empty directory" not in line


# ---------------------------------------------------------------- --out that is a symbolic link


@pytest.mark.parametrize("command", ["prepare", "convert"])
def test_out_that_is_a_link_is_refused_before_any_work(corpus, tmp_path, capsys, command):
    (tmp_path / "real").mkdir()
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "real", target_is_directory=True)
    if command == "prepare":
        code = run_cli("data", "prepare", "--data", corpus, "--out", str(link), "--workers", "1")
    else:
        code = run_cli("convert", "--to-hf", str(tmp_path / "absent"), "--out", str(link))
    line = _last_error(capsys)
    assert code == 2 and f"--out {link} is a symbolic link (to {tmp_path / 'real'})" in line, line
    assert list((tmp_path / "real").iterdir()) == []  # nothing written where it leads


def test_the_run_lock_refuses_a_linked_directory(tmp_path):
    from meshlm.errors import CheckpointError

    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        RunLock(tmp_path / "link").acquire()
    assert not (tmp_path / "real" / LOCK_FILE).exists()


# ---------------------------------------------------------------- a bad flag is one line

# (command line, the prog that answers): a bad value for every subcommand
ONE_LINE = [
    ("train --lr -1", "meshlm train"),
    ("verify --steps -5", "meshlm verify"),
    ("generate --checkpoint c --top-p 0", "meshlm generate"),
    ("eval --checkpoint c --data d --batch-size 0", "meshlm eval"),
    ("convert --to-hf c --out o --seed -1", "meshlm convert"),
    ("launch -n 0 -- verify", "meshlm launch"),
    ("bench --peak-n 0", "meshlm bench"),
    ("memory --devices 0", "meshlm memory"),
    ("plan --devices 0", "meshlm plan"),
    ("tokenizer train --vocab-size 0 --out t", "meshlm tokenizer train"),
    ("data prepare --out s --workers -1", "meshlm data prepare"),
    ("configs --json=yes", "meshlm configs"),
    ("train --no-such-flag", "meshlm train"),
    ("data prepare --out s --no-such-flag", "meshlm data prepare"),
    ("no-such-command", "meshlm"),
]


@pytest.mark.parametrize(("argv", "prog"), ONE_LINE, ids=[case[0] for case in ONE_LINE])
def test_a_bad_flag_is_one_line_without_the_usage_block(argv, prog, capsys):
    with pytest.raises(SystemExit) as exc:
        run_cli(*argv.split())
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), captured.err
    assert lines[0].endswith(f"(see {prog} --help)"), lines[0]


# ---------------------------------------------------------------- --cp-strategy without --cp

NO_CP = [
    "train --cp-strategy allgather",
    "train --cp-strategy allgather --mesh 1x2",
    "verify --cp-strategy allgather",
    "bench --cp-strategy allgather",
    "plan --cp-strategy allgather --mesh 1x2",
]


@pytest.mark.parametrize("argv", NO_CP)
def test_cp_strategy_without_cp_is_refused_like_microbatches_without_pp(argv, monkeypatch, capsys):
    def too_late(*args, **kwargs):
        raise AssertionError("--cp-strategy without --cp must be refused before setup")

    for command in ("train", "verify", "bench", "plan"):
        monkeypatch.setattr(f"meshlm.cli.{command}.setup", too_late)
    assert run_cli(*argv.split()) == 2
    line = _last_error(capsys)
    message = "--cp-strategy allgather needs context parallelism; add --cp 2 (or more) or drop it"
    assert line == f"meshlm: error: {message}"


def test_the_default_cp_strategy_is_accepted_without_cp():
    from meshlm.parallel.layout import Layout

    assert Layout(dp=2, cp_strategy="ring").cp == 1


# ---------------------------------------------------------------- --val-fraction: help and check agree


def test_val_fraction_help_and_check_agree(capsys):
    from meshlm.cli.data import VAL_FRACTION
    from meshlm.data.sources import check_fraction
    from meshlm.errors import DataError

    for value in (1e-9, 0.05, 0.5, 0.999, 1.0, 0.0, -0.1, 1.5):
        try:
            check_fraction(value)
            checked = True
        except DataError:
            checked = False
        assert VAL_FRACTION.contains(value) == checked, value
    with pytest.raises(SystemExit):
        run_cli("data", "prepare", "--help")
    assert "in (0, 1)," in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        run_cli("data", "prepare", "--out", "s", "--val-fraction", "1")
    assert exc.value.code == 2
    assert "argument --val-fraction: must be a finite number in (0, 1), got 1.0" in _last_error(capsys)


# ---------------------------------------------------------------- eval --split on raw text


def test_eval_split_train_on_raw_text_is_refused_not_ignored(corpus, monkeypatch, capsys):
    def too_late(*args, **kwargs):
        raise AssertionError("--split train on raw text must be refused before setup")

    monkeypatch.setattr("meshlm.cli.evaluate.setup", too_late)
    assert run_cli("eval", "--checkpoint", "c", "--data", corpus, "--split", "train") == 2
    line = _last_error(capsys)
    assert "--split train picks a token store's split, but --data is raw text" in line, line


def test_eval_split_is_checked_for_library_callers(corpus):
    from meshlm.data.tokenizer import ByteTokenizer
    from meshlm.errors import ConfigError
    from meshlm.model.config import get_config
    from meshlm.train.eval_settings import EvalConfig
    from meshlm.train.evaluation import eval_stream

    ecfg = EvalConfig(checkpoint="c", data=(corpus,), split="train")
    with pytest.raises(ConfigError, match="--split train picks a token store's split"):
        eval_stream(ecfg, ByteTokenizer(), get_config("tiny-lm"))


# ---------------------------------------------------------------- a refused prepare leaves nothing


def _truncated_gz(path: Path) -> Path:
    import gzip
    import json

    # Rows past the first batch that the check before work reads: the cut is found while writing.
    rows = "".join(json.dumps({"text": os.urandom(50).hex()}) + "\n" for i in range(3000))
    data = gzip.compress(rows.encode())
    path.write_bytes(data[: len(data) * 3 // 4])
    return path


@pytest.mark.parametrize(
    ("bad", "out_exists"), [("empty.jsonl", False), ("empty.jsonl", True), ("truncated.jsonl.gz", False)]
)
def test_a_refused_prepare_leaves_nothing_that_blocks_the_rerun(corpus, tmp_path, capsys, bad, out_exists):
    data = tmp_path / bad
    data.write_bytes(b"") if bad == "empty.jsonl" else _truncated_gz(data)
    out = tmp_path / "store"
    if out_exists:
        out.mkdir()
    code = run_cli("data", "prepare", "--data", str(data), "--out", str(out), "--workers", "1")
    line = _last_error(capsys)
    assert code == 2 and line.startswith("meshlm: error: "), line
    assert (sorted(os.listdir(out)) == []) if out_exists else not out.exists()
    code = run_cli("data", "prepare", "--data", corpus, "--out", str(out), "--workers", "1")
    assert code == 0, capsys.readouterr().err
    assert (out / "index.json").is_file()


# ---------------------------------------------------------------- nothing written under $HOME


def test_a_first_train_with_a_fresh_home_writes_nothing_under_it(corpus, tmp_path):
    """matplotlib's font cache and config directory went to $HOME/.cache and $HOME/.config."""
    from helpers import run_meshlm

    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MPL", "XDG_"))}
    env |= {"HOME": str(home), "TMPDIR": str(tmp)}
    flags = "--config tiny-lm --steps 1 --batch-size 2 --seq-len 16 --sample-tokens 0 --devices 1"
    done = run_meshlm("train", "--data", corpus, *flags.split(), "--out", str(tmp_path / "run"), env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "run" / "loss_curve.png").is_file()
    assert sorted(str(p.relative_to(home)) for p in home.rglob("*")) == []
    assert sorted(p.name for p in tmp.iterdir() if p.name.startswith("meshlm-")) == []  # removed at exit


# ---------------------------------------------------------------- convert --to-hf says which step


def _run_of_two_steps(ck: Path) -> None:
    """A run directory holding steps 1 and 2 of a tiny model (no training: two saves)."""
    from meshlm.io.checkpoint import Checkpointer
    from meshlm.io.model_io import FORMAT
    from meshlm.model.config import get_config
    from meshlm.parallel.mesh import make_mesh
    from meshlm.train.step import init_model

    cfg = get_config("tiny-llama")
    params, _ = init_model(cfg, make_mesh(1, 1), 0)
    meta = {"format": FORMAT, "model_config": cfg.to_dict(), "tokenizer": {"kind": "bytes"}}
    with Checkpointer(ck, keep=3) as ckpt:
        ckpt.save(1, {"params": params}, meta)
        ckpt.save(2, {"params": params}, meta)


def _flip_byte(step_dir: Path) -> None:
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    victim = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))


def test_convert_to_hf_says_which_step_it_exported(tmp_path, capsys):
    import json

    ck = tmp_path / "run"
    _run_of_two_steps(ck)
    assert run_cli("convert", "--to-hf", str(ck), "--out", str(tmp_path / "a"), "--mesh", "1x1") == 0
    assert f"converted {ck} step 2 -> " in capsys.readouterr().out
    _flip_byte(ck / "2")
    with pytest.warns(UserWarning, match="skipping corrupt checkpoint step 2"):
        code = run_cli("convert", "--to-hf", str(ck), "--out", str(tmp_path / "b"), "--mesh", "1x1", "--json")
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["step"], summary["skipped_steps"]) == (1, [2])
    with pytest.warns(UserWarning, match="skipping corrupt checkpoint step 2"):
        assert run_cli("convert", "--to-hf", str(ck), "--out", str(tmp_path / "c"), "--mesh", "1x1") == 0
    out = capsys.readouterr().out
    assert f"converted {ck} step 1 (not the newer step 2: damaged, see the warning above) -> " in out, out


# ---------------------------------------------------------------- a refused train leaves nothing


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory, corpus):
    """A tokenizer.json of a small BPE: a run copies it into its directory (bytes write none)."""
    from meshlm.data.bpe import train_bpe

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(train_bpe([Path(corpus, "f0.py").read_text()], 260).to_json(), encoding="utf-8")
    return path


def _refuse(*args, **kwargs):
    from meshlm.errors import ConfigError

    raise ConfigError("planted: a value found bad while starting")


@pytest.mark.parametrize("stage", ["building", "compiling"])
@pytest.mark.parametrize("out_exists", [False, True])
def test_a_refused_train_leaves_the_directory_as_it_was(
    corpus, bpe_file, tmp_path, monkeypatch, capsys, stage, out_exists
):
    from helpers import train_args

    out = tmp_path / "run"
    if out_exists:
        out.mkdir()
        (out / "notes.txt").write_text("the user's\n")
    # building: after tensorboard/ is made; compiling: the first evaluation, after tokenizer.json too
    target = "meshlm.train.run.eval_arrays" if stage == "building" else "meshlm.train.loop._eval_and_log"
    monkeypatch.setattr(target, _refuse)
    argv = [*train_args(corpus, out, 2), "--mesh", "1x1", "--tokenizer", str(bpe_file), "--devices", "1"]
    assert run_cli(*argv) == 2
    assert "planted" in _last_error(capsys)
    assert (sorted(os.listdir(out)) == ["notes.txt"]) if out_exists else not out.exists()


# ---------------------------------------------------------------- the fifth probe (issue 47, item 2)

ROOT = Path(__file__).resolve().parent.parent
# a line git writes where a merge left a conflict (built here, so that this file holds none itself)
NEWLINE = b"\n"
CONFLICT = re.compile(rb"^(%s)( |$)" % b"|".join(re.escape(c * 7) for c in (b"<", b"|", b">")), re.MULTILINE)


def _tracked_files() -> list[Path]:
    """The files git tracks (docs, sources, tests, configs), or every file outside hidden and build
    directories where the tree is not a git checkout."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "build", "dist", "__pycache__", "node_modules"}
        return [p for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.relative_to(ROOT).parts)]
    return [ROOT / name for name in listed.decode().split("\0") if name]


def conflict_markers(paths) -> list[str]:
    """``path:line`` of every merge-conflict marker line in ``paths``."""
    found = []
    for path in paths:
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            found += [f"{path}:{data.count(NEWLINE, 0, m.start()) + 1}" for m in CONFLICT.finditer(data)]
    return found


def test_no_merge_conflict_marker_anywhere_in_the_tree():
    """docs/models.md carried an unresolved conflict (both halves shipped) and nothing noticed."""
    files = _tracked_files()
    assert any(p.name == "models.md" for p in files) and Path(__file__) in files
    assert conflict_markers(files) == []


def test_the_conflict_check_finds_a_planted_conflict(tmp_path):
    planted = tmp_path / "page.md"
    lines = ["text", "<" * 7 + " HEAD", "ours", "=" * 7, "theirs", ">" * 7 + " branch", "Title", "=" * 7]
    planted.write_text("\n".join(lines) + "\n")
    assert conflict_markers([planted]) == [f"{planted}:2", f"{planted}:6"]


@pytest.mark.parametrize("command", ["train", "verify"])
def test_the_capacity_factors_help_says_which_factor_keeps_every_choice(command, capsys):
    """A factor of 1e8 or 1e30 (the probe's "never drop") overflowed int32; now it is clamped, and the
    help says where the clamp starts (``tests/test_moe.py`` runs the keep mask at 1e8, 1e30, 1.7e308)."""
    with pytest.raises(SystemExit):
        run_cli(command, "--help")
    assert "C >= E / k keeps every choice" in " ".join(capsys.readouterr().out.split())


# slow: a MoE run under pp (its cost); the routing metrics of a step: tests/test_moe.py's
# test_train_step_returns_the_routing_statistics, quick
@pytest.mark.slow
def test_an_moe_run_under_pp_writes_its_routing_metrics(corpus, tmp_path, monkeypatch, capsys):
    """docs/training.md promises expert_load, moe_dropped and moe_aux_loss_* on every MoE row; under
    --pp the rows had none (the pipeline's train step returned no statistics). The same run, with a
    relative --out: it says it starts fresh, and its settings.toml names the run by its absolute path
    (relative, `train --settings /abs/run/settings.toml` elsewhere started a new run there unsaid)."""
    import tomllib

    from helpers import train_rows

    monkeypatch.chdir(tmp_path)
    flags = "--config tiny-mixtral --tokenizer bpe-300 --steps 1 --batch-size 4 --seq-len 16 --pp 2"
    flags += " --mesh 1x1 --devices 2 --sample-tokens 0 --eval-every 0 --warmup-steps 1 --out run"
    assert run_cli("train", "--data", corpus, *flags.split()) == 0
    assert (
        f"starting a fresh run in {tmp_path / 'run'} (no checkpoint there to resume)"
        in capsys.readouterr().err
    )
    (row,) = train_rows(tmp_path / "run")
    assert len(row["expert_load"]) == 4 and sum(row["expert_load"]) == 4 * 16 * 2  # tokens x k
    assert row["moe_dropped"] == 0 and row["moe_aux_loss_hf"] > 0
    assert tomllib.loads((tmp_path / "run" / "settings.toml").read_text())["out"] == str(tmp_path / "run")


def _refused_before_setup(monkeypatch):
    def too_late(*args, **kwargs):
        raise AssertionError("refused too late: after setup")

    monkeypatch.setattr("meshlm.cli.train.setup", too_late)


def test_an_empty_data_list_in_a_settings_file_is_refused_like_an_empty_data_flag(
    tmp_path, monkeypatch, capsys
):
    """``data = []`` trained on the default corpus while ``--data`` with no value is refused."""
    _refused_before_setup(monkeypatch)
    settings = tmp_path / "s.toml"
    settings.write_text("data = []\nsteps = 1\n")
    assert run_cli("train", "--settings", str(settings), "--out", str(tmp_path / "run")) == 2
    line = _last_error(capsys)
    assert f"--settings {settings}: data is an empty list, but --data takes at least one value" in line
    assert not (tmp_path / "run").exists()


def test_an_empty_data_path_is_refused_not_read_as_the_working_directory(tmp_path, monkeypatch):
    from meshlm.data.sources import resolve_sources
    from meshlm.errors import DataError

    (tmp_path / "notes.txt").write_text("not meant as training data\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=r"a data path is empty \(''\)"):
        resolve_sources([""])


@pytest.mark.parametrize("inside", [False, True])
def test_out_that_is_the_checkpoint_is_named_as_such(tmp_path, monkeypatch, capsys, inside):
    """``train --checkpoint CK --out CK`` was refused with a list of opt_state mismatches (it tried to
    resume CK's own run); a --checkpoint inside --out would also be rotated away by the run's saves."""
    _refused_before_setup(monkeypatch)
    ck = tmp_path / "ck"
    checkpoint = ck / "2" if inside else ck
    assert run_cli("train", "--checkpoint", str(checkpoint), "--out", str(ck), "--steps", "1") == 2
    line = _last_error(capsys)
    where = f"holds the --checkpoint {checkpoint}" if inside else "is the --checkpoint"
    assert f"--out {ck} {where}: a run writes its own checkpoints into --out; to continue" in line, line
    assert (
        f"drop --checkpoint (meshlm train --out {ck} resumes it), to fine-tune from it pass another --out"
        in line
    )


def test_a_tiny_mixtral_run_exports_dropping_its_z_loss_with_a_note(tmp_path, capsys):
    """The tiny-mixtral preset (the one docs/training.md trains) has a router z-loss, which no
    transformers MoE config holds: `convert --to-hf` refused every run of it with no way out. It exports
    now, says what it dropped, and transformers' model gives the checkpoint's logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import haiku as hk
    import jax
    import jax.numpy as jnp
    import numpy as np

    from meshlm.io.checkpoint import Checkpointer
    from meshlm.io.model_io import FORMAT
    from meshlm.model.config import get_config
    from meshlm.model.transformer import logits_fn
    from meshlm.parallel.context import Parallel
    from meshlm.parallel.mesh import make_mesh
    from meshlm.train.step import init_model

    cfg = get_config("tiny-mixtral")
    assert cfg.router_z_loss_coef == 0.001
    params, _ = init_model(cfg, make_mesh(1, 1), 0)
    meta = {"format": FORMAT, "model_config": cfg.to_dict(), "tokenizer": {"kind": "bytes"}}
    with Checkpointer(tmp_path / "run", keep=1) as ckpt:
        ckpt.save(1, {"params": params}, meta)
    assert (
        run_cli("convert", "--to-hf", str(tmp_path / "run"), "--out", str(tmp_path / "hf"), "--mesh", "1x1")
        == 0
    )
    out = capsys.readouterr().out
    assert (
        "; dropped router_z_loss_coef=0.001 (the router z-loss): a training-only loss, the logits do not"
        in out
    )
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16))
    want = np.asarray(
        jax.jit(hk.transform(logits_fn(cfg, Parallel())).apply)(params, None, jnp.asarray(tokens))
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        got = model(torch.tensor(tokens)).logits.numpy()
    assert type(model).__name__ == "MixtralForCausalLM"
    assert float(np.max(np.abs(got - want)) / np.max(np.abs(want))) <= 1e-5


def test_the_cp_prefill_docs_name_the_models_it_refuses():
    """docs/models.md said the cp prefill was checked on tiny-gemma2, which `generate --cp` refuses
    (as every model of local and global layers): the section names it among the refused, in its line."""
    from meshlm.errors import ConfigError
    from meshlm.generate.programs import check_prefill_cp
    from meshlm.model.config import get_config
    from meshlm.parallel.layout import Layout

    with pytest.raises(ConfigError) as refused:
        check_prefill_cp(get_config("tiny-gemma2"), Layout(mp=2, cp=2), 64)
    text = (ROOT / "docs" / "models.md").read_text()
    section = " ".join(text[text.index("### Prefill over cp") :].split("\n\n- ")[0].split())
    assert f"`tiny-gemma2` among them: `{refused.value}`" in section
    assert "by hand also tiny-gemma2" not in section
