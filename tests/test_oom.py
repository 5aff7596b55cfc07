"""A device's out-of-memory, in bench, train, generate and verify, is one line (exit 2): what was asked,
the planner's estimate and what fits, and the command's flags that cut memory; train's last good
checkpoint is left as it was. The error is injected (the runtime's own class and message, raised where
a step runs): CPU devices do not run out of memory in a test's time."""

import dataclasses
import hashlib
from pathlib import Path

import jax
import pytest
from helpers import run_cli, train_args, write_corpus

from meshlm.errors import is_out_of_memory
from meshlm.io.model_io import load_model, save_model
from meshlm.model.config import get_config
from meshlm.parallel.mesh import make_mesh

# XLA's message on a TPU that cannot allocate a step's buffers (the text is the runtime's)
MESSAGE = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17.21G. (TPU v5 lite, 15.75G limit)"


def _oom(*args, **kwargs):
    raise jax.errors.JaxRuntimeError(MESSAGE)


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("meshlm: error:")]
    assert len(lines) == 1 and "Traceback" not in err and "could not log" not in err, err
    return lines[0]


def _files(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` by its relative path, with the SHA-256 of its bytes."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def test_only_the_runtimes_out_of_memory_is_recognised():
    assert is_out_of_memory(jax.errors.JaxRuntimeError(MESSAGE))
    assert not is_out_of_memory(jax.errors.JaxRuntimeError("INTERNAL: a failed collective"))
    assert not is_out_of_memory(MemoryError("host memory: not a device's"))
    try:
        try:
            _oom()
        except RuntimeError as e:
            raise ValueError("wrapped") from e
    except ValueError as wrapped:
        assert is_out_of_memory(wrapped)  # an error raised from it


def test_train_out_of_memory_is_one_line_and_keeps_the_checkpoint(tmp_path, capsys, monkeypatch):
    (tmp_path / "corpus").mkdir()
    corpus, out = write_corpus(tmp_path / "corpus"), tmp_path / "run"
    assert run_cli(*train_args(corpus, out, 2, save_every=2)) == 0  # a checkpoint at step 2
    capsys.readouterr()
    before = _files(out / "2")
    # step 3 runs out of memory as a step does at run time: when its result is read, step 4 in flight
    monkeypatch.setattr("meshlm.train.loop._train_row", _oom)
    assert run_cli(*train_args(corpus, out, 4, save_every=2)) == 2
    line = _one_line(capsys)
    assert (
        "out of memory on" in line and "in meshlm train: asked tiny-lm on mesh 2x2, batch 8 x seq 32" in line
    )
    assert "the planner's analytic estimate" in line and "parameters and AdamW state" in line
    assert all(
        f in line for f in ("--remat full", "--fsdp", "--batch-size", "--bf16", "meshlm plan --config")
    )
    assert sorted(p.name for p in out.iterdir() if p.name.isdigit()) == ["2"]  # no new checkpoint
    assert _files(out / "2") == before  # the last good one, byte for byte
    assert load_model(out, make_mesh(1, 1))[2] == 2  # and it loads (its integrity record checked)
    fresh = tmp_path / "fresh"  # a run refused before its first checkpoint leaves nothing behind
    monkeypatch.setattr("meshlm.train.loop._dispatch", _oom)  # as a compile that runs out does
    assert run_cli(*train_args(corpus, fresh, 2)) == 2
    assert "out of memory" in _one_line(capsys) and not fresh.exists()  # as it was: absent


def test_bench_out_of_memory_names_impls(capsys, monkeypatch):
    monkeypatch.setattr("meshlm.perf.bench.build_impls", _oom)  # compiling the steps runs out
    assert run_cli("bench", "--config", "tiny-llama", "--mesh", "1x1", "--batch-size", "2") == 2
    line = _one_line(capsys)
    assert "in meshlm bench: asked tiny-llama on mesh 1x1, batch 2 x seq 64, float32 compute" in line
    assert "(4 models' state at once)" in line and "--impls meshlm (1 implementation's state, not 4)" in line


def test_generate_out_of_memory_names_weights_and_cache(tmp_path, capsys, monkeypatch):
    from meshlm.generate.generator import Generator
    from meshlm.train.step import init_model

    cfg = get_config("tiny-llama")
    save_model(tmp_path / "ckpt", cfg, init_model(cfg, make_mesh(1, 1), 0)[0], step=1)
    monkeypatch.setattr(Generator, "generate", _oom)
    argv = ["--checkpoint", str(tmp_path / "ckpt"), "--mesh", "1x1", "--prompt", "12", "--prompt", "3"]
    assert run_cli("generate", *argv) == 2
    line = _one_line(capsys)
    assert "in meshlm generate: asked" in line and "2 prompts; its weights take" in line
    assert "the KV cache of 64 positions per row" in line and "--mesh 1xN" in line


def test_verify_out_of_memory_names_both_models(capsys, monkeypatch):
    monkeypatch.setattr("meshlm.proof.verify", _oom)
    assert run_cli("verify", "--config", "tiny-llama", "--mesh", "1x2") == 2
    line = _one_line(capsys)
    assert "in meshlm verify: asked tiny-llama on mesh 1x2" in line and "(2 models' state at once)" in line
    assert "--seq-len" in line and "--remat full" in line


def test_what_fits_on_a_16_gib_chip(monkeypatch):
    """Against a device's memory limit the line names the largest batch that fits by the planner's
    estimate (its figures: ``analytic``'s), with the asked remat and with --remat full: SmolLM2-360M at
    2048 tokens on one 16 GiB chip fits only with --remat full; Qwen3-1.7B's state alone does not."""
    from meshlm.parallel.layout import Layout
    from meshlm.perf import oom
    from meshlm.perf.plan import analytic

    monkeypatch.setattr(oom, "device_memory", lambda: ("TPU v5 lite", 16 * 2**30))
    one = Layout.of(make_mesh(1, 1))
    asked = oom.Asked("train", "smollm2-360m", get_config("smollm2-360m"), one, 64, 2048, ("--remat full",))
    line = oom.out_of_memory_line(asked)
    assert "out of memory on TPU v5 lite (16.00 GiB)" in line and "--device-memory 16.0GiB" in line
    assert "; fits: batch 4 with --remat full;" in line
    est, limit = oom.Estimate.of(asked), 16 * 2**30
    assert est.peak(4, "full") <= limit < est.peak(8, "full") and est.peak(1, "none") > limit
    planned = analytic(asked.cfg, one, oom._settings(asked, 4, "full"))["peak"]
    assert est.peak(4, "full") == pytest.approx(planned)  # the planner's own figure
    big = oom.Asked("train", "qwen3-1.7b", get_config("qwen3-1.7b"), one, 8, 2048, ("--fsdp",))
    assert "the state alone exceeds 16.00 GiB, no batch fits on this mesh" in oom.out_of_memory_line(big)
    converted = dataclasses.replace(big, config="runs/qwen3", checkpoint="runs/qwen3")  # plan reads it
    assert "`meshlm plan --checkpoint runs/qwen3 --mesh 1x1" in oom.out_of_memory_line(converted)


def test_other_errors_pass_through():
    """Not an out-of-memory: the error is not turned into a line (a bug keeps its traceback)."""
    from meshlm.perf.oom import reported

    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"), reported(lambda: "a line"):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")
