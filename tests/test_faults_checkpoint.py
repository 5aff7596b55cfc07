"""Damaged or edited checkpoints fail with one line naming what is wrong, never load silently wrong:
an edited metadata (the model config) fails its digest; an invalid config names the field and the
checkpoint; a missing or truncated array file is named; a file passed as --checkpoint is refused.
"""

import json
import math
import shutil
from contextlib import nullcontext
from pathlib import Path

import pytest
from helpers import run_cli, run_meshlm

from meshlm.errors import CheckpointError, ConfigError
from meshlm.io.integrity import meta_digest
from meshlm.io.model_io import load_model, read_config, save_model
from meshlm.model.config import from_dict, get_config
from meshlm.parallel.mesh import make_mesh

# orbax's "unraisable" reports after failed reads, collected into this module's tests and filtered
# here (the ``collect_orbax_garbage`` fixture, conftest.py).
pytestmark = [
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
    pytest.mark.usefixtures("collect_orbax_garbage"),
]


STEP = 3
MODIFIED = "was modified or damaged after saving"


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    from meshlm.train.step import init_model

    cfg = get_config("tiny-llama")
    params, _ = init_model(cfg, make_mesh(1, 1), 0)
    out = tmp_path_factory.mktemp("saved") / "run"
    save_model(out, cfg, params, step=STEP)
    return out


@pytest.fixture
def run(saved_run, tmp_path) -> Path:
    """A private copy of the saved checkpoint, free to damage."""
    return Path(shutil.copytree(saved_run, tmp_path / "run"))


def _meta_file(run: Path) -> Path:
    return run / str(STEP) / "meta" / "metadata"


def _record_file(run: Path) -> Path:
    return run / str(STEP) / "integrity" / "metadata"


def edit_config(run: Path, **changes) -> dict:
    meta = json.loads(_meta_file(run).read_text())
    meta["model_config"].update(changes)
    _meta_file(run).write_text(json.dumps(meta))
    return meta


def reseal(run: Path, meta: dict) -> None:
    """Re-write the integrity record to match ``meta``: as if it had been saved like that."""
    record = json.loads(_record_file(run).read_text())
    record["meta_sha256"] = meta_digest(meta)
    _record_file(run).write_text(json.dumps(record))


def make_old_format(run: Path) -> None:
    """The integrity record an older meshlm wrote: format 1, no digest of the meta."""
    record = json.loads(_record_file(run).read_text())
    record["format"] = 1
    del record["meta_sha256"]
    _record_file(run).write_text(json.dumps(record))


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("meshlm: error:")]
    assert len(lines) == 1, err
    return lines[0]


def verify(path: Path) -> int:
    return run_cli("verify", "--checkpoint", str(path), "--mesh", "1x1")


def generate(path: Path) -> int:
    return run_cli(
        "generate", "--checkpoint", str(path), "--mesh", "1x1", "--prompt", "12", "--max-new-tokens", "2"
    )


# ---------------------------------------------------------------- edited metadata


@pytest.mark.parametrize("command", [verify, generate])
@pytest.mark.parametrize("where", ["run", "step"])
def test_edited_rope_theta_is_refused(run, capsys, command, where):
    edit_config(run, rope_theta=500000.0)
    with pytest.warns(UserWarning) if where == "run" else nullcontext():  # run dir: "skipping corrupt"
        assert command(run if where == "run" else run / str(STEP)) == 2
    line = error_line(capsys)
    assert MODIFIED in line and str(run / str(STEP)) in line and "cannot be trusted" in line


def test_edited_meta_is_refused_by_the_library(run):
    edit_config(run, norm_eps=-1)  # caught by the digest before the config is even parsed
    with pytest.raises(CheckpointError, match=MODIFIED):
        read_config(run / str(STEP))
    with pytest.raises(CheckpointError, match=MODIFIED):
        load_model(run / str(STEP), make_mesh(1, 1))


# ---------------------------------------------------------------- invalid configs


BAD_CONFIGS = [
    ("d_model", "abc", "an integer >= 1"),
    ("d_model", 64.0, "an integer >= 1"),
    ("d_model", True, "an integer >= 1"),
    ("max_seq_len", -5, "an integer >= 1"),
    ("n_kv_heads", -1, "an integer >= 0"),
    ("head_dim", -8, "an integer >= 0"),
    ("rotary_dim", "4", "an integer >= 0"),
    ("n_heads", -1, "an integer >= 0"),
    ("norm_eps", -1, "a finite number > 0"),
    ("norm_eps", math.nan, "a finite number > 0"),
    ("norm_eps", 0.0, "a finite number > 0"),
    ("rope_theta", 0, "a finite number > 0"),
    ("rope_theta", math.inf, "a finite number > 0"),
    ("rope_theta", "10000", "a finite number > 0"),
    ("z_loss", -0.5, "a finite number >= 0"),
    ("tie_embeddings", 1, "true or false"),
    ("remat", "false", "one of none, full, selective"),
    ("remat", 1, "a string"),
    ("rotary_style", None, "a string"),
    ("family", 3, "a string"),
]


@pytest.mark.parametrize(("field", "value", "expected"), BAD_CONFIGS)
def test_from_dict_names_field_value_and_expectation(field, value, expected):
    with pytest.raises(ConfigError) as err:
        from_dict({**get_config("tiny-llama").to_dict(), field: value})
    message = str(err.value)
    assert message.startswith(f"{field} must be {expected}") and message.endswith(f", got {value!r}")


def test_config_values_are_normalised():
    cfg = from_dict({**get_config("tiny-llama").to_dict(), "rope_theta": 500000, "norm_eps": 1})
    assert isinstance(cfg.rope_theta, float) and isinstance(cfg.norm_eps, float)
    assert json.loads(cfg.to_json())["rope_theta"] == 500000.0


@pytest.mark.parametrize(
    ("field", "value"),
    [("d_model", "abc"), ("d_model", 64.0), ("max_seq_len", -5), ("n_kv_heads", -1), ("norm_eps", -1)],
)
def test_invalid_config_in_a_sealed_checkpoint_names_field_and_checkpoint(run, capsys, field, value):
    reseal(run, edit_config(run, **{field: value}))  # saved like that: the digest matches
    assert verify(run) == 2
    line = error_line(capsys)
    assert f"checkpoint {run / str(STEP)} holds an invalid model config: {field} must be" in line
    assert f"got {value!r}" in line and MODIFIED not in line
    with pytest.raises(CheckpointError, match=f"invalid model config: {field} must be"):
        read_config(run)


# ---------------------------------------------------------------- old integrity records


def test_old_format_record_loads_with_one_warning(run):
    make_old_format(run)
    with pytest.warns(UserWarning, match=r"older meshlm \(integrity format 1\).*not protected") as caught:
        cfg, _ = read_config(run)
        _, params, step = load_model(run, make_mesh(1, 1))
    assert cfg == get_config("tiny-llama") and step == STEP and params
    assert len([w for w in caught if "not protected" in str(w.message)]) == 1  # once per step


def test_old_format_record_still_checks_the_config(run):
    make_old_format(run)
    edit_config(run, max_seq_len=-5)  # no digest to catch it: the config check does
    with pytest.warns(UserWarning, match="not protected"):
        with pytest.raises(CheckpointError, match=r"invalid model config: max_seq_len must be .*got -5"):
            read_config(run)


def test_newer_format_record_asks_for_an_upgrade(run):
    record = json.loads(_record_file(run).read_text())
    _record_file(run).write_text(json.dumps({**record, "format": 99}))
    with pytest.raises(CheckpointError, match="integrity format 99, newer than .* upgrade meshlm"):
        read_config(run / str(STEP))


# ---------------------------------------------------------------- damaged array files


def _largest_data_file(run: Path) -> Path:
    files = [p for p in (run / str(STEP) / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    return max(files, key=lambda p: p.stat().st_size)


def test_deleted_array_file_is_one_line_naming_it(run):
    """In a subprocess, to see all of stderr: no tracebacks from orbax's closed event loop."""
    victim = _largest_data_file(run)
    victim.unlink()
    args = ["--checkpoint", str(run / str(STEP)), "--mesh", "1x1"]
    done = run_meshlm("generate", *args, "--prompt", "12", "--max-new-tokens", "2", timeout=240)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"meshlm: error: cannot read arrays of {run / str(STEP) / 'state'}: missing file: {victim} "
        "(deleted or moved); it holds array " + done.stderr.split("it holds array ")[1].strip()
    ]
    assert "Traceback" not in done.stderr and "Event loop" not in done.stderr


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["truncated chunks", "deleted index", "garbled index", "garbled chunk"])
def test_damaged_state_file_is_named(run, capsys, damage):
    state = run / str(STEP) / "state"
    if damage == "truncated chunks":
        path = _largest_data_file(run)
        with path.open("r+b") as f:
            f.truncate(100)
        expect = f"damaged file: {path} is truncated (100 bytes, its data runs to byte "
    elif damage == "deleted index":
        path = state / "manifest.ocdbt"
        path.unlink()
        expect = f"missing file: {path} (the index of the arrays"
    elif damage == "garbled index":  # the b-tree node listing where each chunk is
        (path,) = (state / "d").iterdir()
        _flip(path, 20)
        expect = f"damaged file: {path} (Error decoding b-tree node"
    else:  # a chunk whose zstd frame no longer decodes: tensorstore names the key, we the file
        path = _largest_data_file(run)
        _flip(path, 5)
        expect = f"(in file {path})"
    assert generate(run / str(STEP)) == 2
    assert expect in error_line(capsys)


# ---------------------------------------------------------------- a file as --checkpoint


@pytest.mark.parametrize("command", [verify, generate])
def test_a_file_as_checkpoint_says_so(tmp_path, capsys, command):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    assert command(path) == 2
    line = error_line(capsys)
    assert f"{path} is a file, not a checkpoint directory" in line
    assert "pass a run directory" in line and "one step's directory" in line and "make one" not in line
    assert path.read_text() == "hello"
