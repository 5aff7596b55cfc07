"""`meshlm convert --from-hf` on damaged transformers directories: exit code 2, one line naming the file
and the problem, nothing written to --out, no file outside the model directory ever read.

The directories are built by hand (config.json with json.dumps, tensors with safetensors.numpy) from a
valid tiny Llama / GPT-J written by ``save_hf``; no torch. Nothing here trains or compiles.
"""

import json
import shutil

import numpy as np
import pytest
from helpers import run_cli
from safetensors.numpy import load_file, save_file

from meshlm.io import hf_config, hf_weights
from meshlm.model.config import get_config


def _save(preset: str, out) -> None:
    cfg = get_config(preset)
    rng = np.random.default_rng(0)
    flat = {p: rng.normal(0, 0.05, s).astype(d) for p, (s, d) in hf_weights.expected_shapes(cfg).items()}
    hf_weights.save_hf(cfg, flat, out)


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    """{family: a valid directory}; tests damage copies of them."""
    dirs = {}
    for family, preset in (("llama", "tiny-llama"), ("gptj", "tiny-gptj")):
        dirs[family] = tmp_path_factory.mktemp(family)
        _save(preset, dirs[family])
    return dirs


@pytest.fixture
def model(valid, tmp_path):
    """A fresh copy of the valid Llama directory, to damage."""
    return shutil.copytree(valid["llama"], tmp_path / "model")


def _refused(tmp_path, capsys, model_dir, *expected: str) -> str:
    """Convert ``model_dir``: exit 2, one stderr line holding every ``expected`` text, --out not created."""
    out = tmp_path / "out"
    assert run_cli("convert", "--from-hf", str(model_dir), "--out", str(out), "--mesh", "1x1") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("meshlm: error: "), err
    assert "Traceback" not in err
    for text in expected:
        assert text in err, (text, err)
    assert not out.exists()
    return err


def _edit_config(d, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))  # NaN / Infinity are written as JSON's extensions


def _edit_tensor(d, name: str, fn) -> None:
    tensors = load_file(d / hf_weights.WEIGHTS_FILE)
    tensors[name] = fn(tensors[name])
    save_file(tensors, d / hf_weights.WEIGHTS_FILE)


def test_valid_directories_convert(valid, tmp_path, capsys):
    for family, d in valid.items():
        assert run_cli("convert", "--from-hf", str(d), "--out", str(tmp_path / family), "--mesh", "1x1") == 0
    assert capsys.readouterr().err == ""


# --- unreadable safetensors ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "content, reason",
    [(b"", "header too small"), (b"not a safetensors file at all " * 4, "header"), (None, "")],
)
def test_unreadable_safetensors(model, tmp_path, capsys, content, reason):
    path = model / hf_weights.WEIGHTS_FILE
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if content is None else content)  # None: truncated
    _refused(tmp_path, capsys, model, f"{path} is not a readable safetensors file", reason, "re-save it")


# --- config.json --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"{not json", "is not readable JSON"),
        (b"", "is not readable JSON"),
        (b"\xff\xfe\x00garbage", "is not readable JSON"),
        (b"[1, 2, 3]", "holds an array, not a JSON object"),
        (b'"llama"', "holds a string, not a JSON object"),
        (b"5", "holds the value 5, not a JSON object"),
        (b"[" * 100_000, "is not readable JSON"),
    ],
)
def test_config_not_a_json_object(model, tmp_path, capsys, content, problem):
    (model / "config.json").write_bytes(content)
    _refused(tmp_path, capsys, model, f"{model / 'config.json'} ", problem)


LLAMA_BAD = [
    ({"hidden_size": "64"}, "hidden_size must be an integer >= 1, got '64'"),
    ({"hidden_size": 64.0}, "hidden_size must be an integer >= 1, got 64.0"),
    ({"hidden_size": True}, "hidden_size must be an integer >= 1, got True"),
    ({"hidden_size": -64}, "hidden_size must be an integer >= 1, got -64"),
    ({"hidden_size": None}, "has no 'hidden_size'"),
    ({"vocab_size": 0}, "vocab_size must be an integer >= 1, got 0"),
    ({"num_hidden_layers": 1.5}, "num_hidden_layers must be an integer >= 1, got 1.5"),
    ({"intermediate_size": [128]}, "intermediate_size must be an integer >= 1, got [128]"),
    ({"num_attention_heads": 0}, "num_attention_heads must be an integer >= 1, got 0"),
    ({"num_key_value_heads": 0}, "num_key_value_heads must be an integer >= 1, got 0"),
    ({"num_key_value_heads": 3}, "num_attention_heads=8 is not a multiple of num_key_value_heads=3"),
    ({"head_dim": 0}, "head_dim must be an integer >= 1, got 0"),
    ({"head_dim": None, "hidden_size": 60}, "hidden_size=60 is not divisible by num_attention_heads=8"),
    ({"max_position_embeddings": "64"}, "max_position_embeddings must be an integer >= 1, got '64'"),
    ({"max_position_embeddings": None}, "max_position_embeddings must be an integer >= 1, got None"),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps must be a finite number > 0, got '1e-6'"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps must be a finite number > 0, got -1e-06"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a finite number > 0, got nan"),
    ({"rope_theta": "abc"}, "rope_theta must be a finite number > 0, got 'abc'"),
    ({"rope_theta": 0}, "rope_theta must be a finite number > 0, got 0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": float("inf")}}, "rope_theta must be"),
    ({"partial_rotary_factor": True}, "partial_rotary_factor=True is not supported"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),
    ({"attention_bias": 0}, "attention_bias must be true or false, got 0"),
    ({"attention_dropout": "0.0"}, "attention_dropout must be a finite number in [0, 1], got '0.0'"),
    ({"model_type": ["llama"]}, "model_type=['llama'] is not supported"),
]
GPTJ_BAD = [
    ({"n_embd": "64"}, "n_embd must be an integer >= 1, got '64'"),
    ({"n_head": 6}, "n_embd=64 is not divisible by n_head=6"),
    ({"n_inner": -5}, "n_inner must be an integer >= 1, got -5"),
    ({"rotary_dim": 0}, "rotary_dim must be an integer >= 1, got 0"),
    ({"rotary_dim": 3}, "rotary_dim=3 must be even and <= n_embd/n_head=8"),
    ({"rotary_dim": 4.0}, "rotary_dim must be an integer >= 1, got 4.0"),
    ({"n_positions": None}, "n_positions must be an integer >= 1, got None"),
    ({"layer_norm_epsilon": float("inf")}, "layer_norm_epsilon must be a finite number > 0, got inf"),
    ({"resid_pdrop": -0.5}, "resid_pdrop must be a finite number in [0, 1], got -0.5"),
]


@pytest.mark.parametrize(
    "family, changes, problem", [("llama", *c) for c in LLAMA_BAD] + [("gptj", *c) for c in GPTJ_BAD]
)
def test_bad_config_values(valid, tmp_path, capsys, family, changes, problem):
    d = shutil.copytree(valid[family], tmp_path / "model")
    _edit_config(d, **changes)
    _refused(tmp_path, capsys, d, f"{d / 'config.json'}: ", problem)


def test_config_checks_name_hf_fields():
    """The library function too: HF's field names, not meshlm's (d_model, n_heads)."""
    from meshlm.errors import ConfigError

    good = hf_config.config_to_hf(get_config("tiny-llama"))
    with pytest.raises(ConfigError, match="hidden_size must be an integer"):
        hf_config.config_from_hf({**good, "hidden_size": "64"})
    with pytest.raises(ConfigError, match="must be a JSON object"):
        hf_config.config_from_hf([good])


# --- the sharded index --------------------------------------------------------------------------


def _shard(d, weight_map=None) -> dict:
    """Move model.safetensors into an index of one shard; returns the index's weight_map."""
    (d / hf_weights.WEIGHTS_FILE).rename(d / "model-00001-of-00001.safetensors")
    names = load_file(d / "model-00001-of-00001.safetensors")
    index = {"metadata": {}, "weight_map": {n: "model-00001-of-00001.safetensors" for n in names}}
    if weight_map is not None:
        index["weight_map"] = weight_map
    (d / hf_weights.INDEX_FILE).write_text(json.dumps(index))
    return index["weight_map"]


def test_sharded_index_converts(model, tmp_path):
    _shard(model)
    assert run_cli("convert", "--from-hf", str(model), "--out", str(tmp_path / "out"), "--mesh", "1x1") == 0


@pytest.mark.parametrize(
    "index, problem",
    [
        ({"metadata": {}}, "has no weight_map object"),
        ({"weight_map": ["model-00001-of-00001.safetensors"]}, "has no weight_map object"),
        ({"weight_map": {}}, "has no weight_map object"),
        (
            {"weight_map": {"model.norm.weight": 5}},
            "weight_map['model.norm.weight'] must be a file name, got 5",
        ),
        ({"weight_map": {"model.norm.weight": ""}}, "must be a file name, got ''"),
        ([1, 2], "holds an array, not a JSON object"),
    ],
)
def test_bad_index(model, tmp_path, capsys, index, problem):
    _shard(model)
    (model / hf_weights.INDEX_FILE).write_text(json.dumps(index))
    _refused(tmp_path, capsys, model, str(model / hf_weights.INDEX_FILE), problem)


def test_index_not_json(model, tmp_path, capsys):
    _shard(model)
    (model / hf_weights.INDEX_FILE).write_bytes(b"\x00\x01 not json")
    _refused(tmp_path, capsys, model, f"{model / hf_weights.INDEX_FILE} is not readable JSON")


def _record_opens(monkeypatch) -> list[str]:
    """Every path safetensors is asked to read, from now on."""
    import safetensors.numpy

    opened, real = [], safetensors.numpy.load_file
    monkeypatch.setattr(
        safetensors.numpy, "load_file", lambda p, **kw: opened.append(str(p)) or real(p, **kw)
    )
    return opened


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_index_outside_the_model_directory_is_never_read(model, tmp_path, capsys, monkeypatch, how):
    secret = tmp_path / "secret.safetensors"  # a real, readable file just outside the model directory
    save_file({"model.norm.weight": np.ones(64, np.float32)}, secret)
    weight_map = _shard(model)
    if how == "symlink":
        (model / "link.safetensors").symlink_to(secret)
        name = "link.safetensors"
    else:
        name = "../secret.safetensors" if how == "dotdot" else str(secret)
    pointing = {**weight_map, "model.norm.weight": name}
    (model / hf_weights.INDEX_FILE).write_text(json.dumps({"weight_map": pointing}))
    opened = _record_opens(monkeypatch)
    _refused(
        tmp_path,
        capsys,
        model,
        str(model / hf_weights.INDEX_FILE),
        "names a file outside the model directory",
    )
    assert opened == []  # refused before any weights file is opened


@pytest.mark.parametrize("name", [hf_weights.WEIGHTS_FILE, hf_weights.CONFIG_FILE])
def test_symlinks_outside_are_refused(model, tmp_path, capsys, monkeypatch, name):
    """A cloned model repository can hold symlinks; none may lead meshlm out of the directory."""
    elsewhere = tmp_path / "elsewhere"
    (model / name).rename(elsewhere)
    (model / name).symlink_to(elsewhere)
    opened = _record_opens(monkeypatch)
    _refused(tmp_path, capsys, model, f"{model / name} is a link to a file outside the model directory")
    assert opened == []


def test_hub_cache_layout_converts(valid, tmp_path):
    """The Hugging Face cache: snapshots/<rev>/* are links to ../../blobs/<hash>; that is allowed."""
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for i, name in enumerate(("config.json", hf_weights.WEIGHTS_FILE)):
        shutil.copy(valid["llama"] / name, repo / "blobs" / f"hash{i}")
        (snapshot / name).symlink_to(f"../../blobs/hash{i}")
    assert (
        run_cli("convert", "--from-hf", str(snapshot), "--out", str(tmp_path / "out"), "--mesh", "1x1") == 0
    )


def test_tensor_in_two_shards(model, tmp_path, capsys):
    weight_map = _shard(model)
    save_file({"model.norm.weight": np.ones(64, np.float32)}, model / "extra.safetensors")
    (model / hf_weights.INDEX_FILE).write_text(
        json.dumps({"weight_map": {**weight_map, "model.norm.weight": "extra.safetensors"}})
    )
    _refused(tmp_path, capsys, model, "tensor model.norm.weight is in both")


# --- tensor values and dtypes -------------------------------------------------------------------


def _poison(value):
    def fn(w):
        w = w.copy()
        w.flat[:3] = value
        return w

    return fn


@pytest.mark.parametrize(
    "fn, problem",
    [
        (_poison(np.nan), "has 3 non-finite value(s) (NaN or Inf) of 4096"),
        (_poison(np.inf), "has 3 non-finite value(s)"),
        (lambda w: w.astype(np.float64) * 1e300, "non-finite value(s)"),  # overflows float32
        (lambda w: w.astype(np.int32), "has dtype int32, not floating point"),
        (lambda w: w > 0, "has dtype bool, not floating point"),
    ],
)
def test_bad_tensor_values(model, tmp_path, capsys, fn, problem):
    _edit_tensor(model, "model.embed_tokens.weight", fn)
    _refused(tmp_path, capsys, model, "tensor model.embed_tokens.weight", problem)


def test_float16_and_bfloat16_still_convert(model, tmp_path):
    import ml_dtypes

    _edit_tensor(model, "model.embed_tokens.weight", lambda w: w.astype(np.float16))
    _edit_tensor(model, "model.norm.weight", lambda w: w.astype(ml_dtypes.bfloat16))
    assert run_cli("convert", "--from-hf", str(model), "--out", str(tmp_path / "out"), "--mesh", "1x1") == 0
