"""MFU in every train run on an accelerator: each logged step's per-device model TFLOP/s and MFU, over
a known chip's spec bf16 peak or an unknown chip's measured one; on CPU the rows are as they were
(tests/test_train.py checks their keys). The accelerator is faked: the device-kind lookup replaced."""

import pytest
from helpers import read_metrics, tiny_lm_config, write_corpus

from meshlm.model.config import get_config
from meshlm.model.transformer import param_shapes
from meshlm.parallel.mesh import make_mesh
from meshlm.perf import mfu
from meshlm.perf.flops import model_flops_per_step
from meshlm.perf.train_run import train


def test_train_logs_tflops_and_mfu_on_a_known_chip(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(mfu, "accelerator", lambda: "TPU v5 lite")
    (tmp_path / "corpus").mkdir()
    tcfg = tiny_lm_config(write_corpus(tmp_path / "corpus"), tmp_path / "run", steps=2)
    train(tcfg, make_mesh(1, 2))
    assert "against TPU v5 lite's spec bf16 peak of 197 TFLOP/s per device" in capsys.readouterr().err
    flops = model_flops_per_step(get_config("tiny-lm"), param_shapes(get_config("tiny-lm")), 8, 32)
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # the FLOP rate per device over the token rate: the model's FLOPs per token over 2 devices (no
        # step time in it, so no machine's noise)
        per_token = r["tflops_per_device"] * 1e12 / r["tokens_per_s"]
        assert per_token == pytest.approx(flops / (8 * 32) / 2)
        assert r["mfu"] == pytest.approx(r["tflops_per_device"] * 1e12 / 197e12)


def test_an_unknown_chip_is_measured_and_cpu_has_none(monkeypatch):
    cfg = get_config("tiny-lm")
    assert mfu.utilisation(cfg, 8, 32, 1) is None  # CPU: no MFU terms, rows unchanged
    monkeypatch.setattr(mfu, "accelerator", lambda: "Future TPU v9")
    monkeypatch.setattr("meshlm.perf.peak.matmul_peak_flops", lambda dtype, n, repeats: 5e13)
    got = mfu.utilisation(cfg, 8, 32, 4)
    assert got.peak == 5e13 and "measured bf16 matmul peak (not a known chip)" in got.line()
    row = got.row(2.0)
    assert row["mfu"] == pytest.approx(got.flops_per_step / 2.0 / 4 / 5e13)
