"""The prover proven: each way `verify` itself could be wrong, planted, must make it fail.

1. A reference that is not independent (built from the sharded program) must fail verify's
   independence checks, although its values then agree exactly.
2. Controls must be able to fail: a no-op fault is "not detected"; a crash is a verifier error, never
   a detection; only JAX's varying-axis type check counts as a rejection.
3. What the proof covers must include z-loss, KV-head replication on 4 devices, the data pipeline,
   wrong sharding rules (a failing row, not a traceback) and wasted communication.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_cli, verify_preset
from jax import lax

from meshlm.errors import VerifierError
from meshlm.model.config import get_config
from meshlm.model.layers import VocabEmbed, upcast
from meshlm.parallel.axes import MP
from meshlm.parallel.context import Parallel
from meshlm.parallel.mesh import make_mesh
from meshlm.proof import format_report, model_problem, verify
from meshlm.proof.controls import CONTROLS, Control
from meshlm.proof.data_pipeline import data_checks
from meshlm.proof.runs import Runs
from meshlm.sharding.rules import RULES, param_specs


def _verify(name, dp, mp, *, steps=0, dtype=jnp.float32, cfg=None, **kw):
    return verify_preset(name, dp, mp, batch=2 * dp, dtype=dtype, cfg=cfg, steps=steps, **kw)


def _check(report, name) -> dict:
    (row,) = [c for c in report.checks if c["name"] == name]
    return row


# ---------------------------------------------------------------- 1. independence of the reference


def test_independence_is_checked_and_reported():
    report = _verify("tiny-llama", 2, 2, controls=())
    assert report.ok, format_report(report)
    for name in (
        "reference names no mesh axis",
        "reference runs on one device",
        "sharded program communicates",
    ):
        assert _check(report, name)["ok"]
    assert "check reference runs on one device" in format_report(report)


def test_reference_computed_by_the_sharded_program_fails(monkeypatch):
    """The mutant: every value then agrees exactly, so only the independence check can catch it."""
    monkeypatch.setattr(Runs, "reference_grads", lambda self: self.grads(self.problem.build_loss))
    report = _verify("tiny-llama", 1, 2, controls=())
    assert all(p.max_abs_err == 0 for p in report.params)  # the values alone would pass
    assert not report.ok
    assert not _check(report, "reference runs on one device")["ok"]


def test_reference_program_with_a_mesh_axis_fails(monkeypatch):
    def sharded_reference(self):
        return self.sharded_fn(self.problem.build_loss), (self.params, self.batch)

    monkeypatch.setattr(Runs, "reference_program", sharded_reference)
    report = _verify("tiny", 1, 2, controls=())
    row = _check(report, "reference names no mesh axis")
    assert not row["ok"] and "shard_map" in row["detail"]
    assert not report.ok


def _embed_without_mask(self, tokens):
    """A sharding-specific bug in layer code: ids outside this shard's slice are not zeroed, so every
    shard adds its row 0 (unsharded, every id is inside: the reference is unaffected)."""
    table = self._table()
    local = tokens - self.par.vocab_start(table.shape[0])
    rows = jnp.take(table, jnp.clip(local, 0, table.shape[0] - 1), axis=0)
    return self.par.row_out(rows)


# 1x2 slow: 2x2 catches the canary on a model split too (scale)
@pytest.mark.parametrize(
    ("dp", "mp", "caught"), [(1, 1, False), pytest.param(1, 2, True, marks=pytest.mark.slow), (2, 2, True)]
)
def test_canary_in_layer_code_fails_verify_when_sharded(monkeypatch, dp, mp, caught):
    monkeypatch.setattr(VocabEmbed, "__call__", _embed_without_mask)
    report = _verify("tiny-llama", dp, mp, controls=())
    assert report.ok is not caught, format_report(report)
    if caught:
        assert not {p.path: p for p in report.params}["embed/embeddings"].ok


# ---------------------------------------------------------------- 2. controls that can fail


class _Silent(Parallel):
    """Changes the program (one more multiply) but not a value: traced, it is not inert (``inertness``)."""

    def row_out(self, partial, bias=None):
        return super().row_out(partial, bias) * 1.0


def test_a_no_op_control_is_not_detected_and_fails_the_proof():
    """A control that changes no value: before any run the prover calls a plant that reaches no code a
    prover bug (tests/test_every_control.py); one that changes the program but no value runs, is not
    detected, and fails the proof."""
    noop = Control(name="no-op", applies=lambda w: True, par_cls=_Silent)
    report = _verify("tiny-llama", 2, 2, controls=(noop,))
    (c,) = report.controls
    assert {k: c[k] for k in ("name", "detected", "how")} == {
        "name": "no-op",
        "detected": False,
        "how": "no difference",
    }
    assert c["by"] == "values" and c["margin"] < 1  # measured, in tolerances: within them
    assert not report.ok and "NOT DETECTED" in format_report(report)


class _Crashes(Parallel):
    def row_out(self, partial, bias=None):
        raise RuntimeError("a bug in the control")


class _NotReduced(Parallel):
    """Leaves the row-parallel output per-shard: JAX's check_vma rejects the program."""

    def g(self, x):
        return x


def test_a_crashing_control_is_a_verifier_error_not_a_detection():
    crash = Control(name="crash", applies=lambda w: True, par_cls=_Crashes)
    with pytest.raises(VerifierError, match="control 'crash' crashed .*not a detection"):
        _verify("tiny", 1, 2, controls=(crash,))


def test_cli_exit_code_3_for_a_verifier_error(monkeypatch, capsys):
    monkeypatch.setattr("meshlm.proof.controls.DroppedAllReduce.row_out", _Crashes.row_out)
    assert run_cli("verify", "--config", "tiny", "--mesh", "1x2", "--no-collectives") == 3
    assert "verifier error: control 'dropped all-reduce' crashed" in capsys.readouterr().err


def test_only_the_varying_axis_type_check_counts_as_a_rejection():
    reject = Control(name="not reduced", applies=lambda w: True, par_cls=_NotReduced)
    report = _verify("tiny", 1, 2, controls=(reject,))
    (c,) = report.controls
    assert c["detected"] and c["how"].startswith("rejected by JAX's check_vma")


# ---------------------------------------------------------------- 3. coverage


def _xent_z_loss_summed_twice(par, logits, targets, z_loss=0.0):
    """The z-loss bug: the term is added on every shard and summed over them (mp times too big)."""
    logits = upcast(logits)
    vs = logits.shape[-1]
    m = lax.stop_gradient(par.pmax(jnp.max(lax.stop_gradient(logits), axis=-1)))
    shifted = logits - m[..., None]
    local = targets - par.vocab_start(vs)
    inside = (local >= 0) & (local < vs)
    picked = jnp.take_along_axis(shifted, jnp.where(inside, local, 0)[..., None], axis=-1)[..., 0]
    target_logit = par.g(jnp.where(inside, picked, 0.0))
    log_sum = jnp.log(par.g(jnp.sum(jnp.exp(shifted), axis=-1)))
    z = z_loss * jnp.square(log_sum + m)
    return log_sum - target_logit + par.g(lax.pcast(z, MP, to="varying") if par.sharded else z)


def test_z_loss_is_proven_sharded_and_its_bug_is_caught(monkeypatch):
    cfg = get_config("tiny-llama").replace(z_loss=1e-2)
    with jax.enable_x64(True):
        report = _verify("z", 1, 4, cfg=cfg, dtype=jnp.float64, controls=())
        assert report.ok and max(p.max_rel_err for p in report.params) <= 1e-12, format_report(report)
        monkeypatch.setattr("meshlm.model.chunked_xent.vocab_parallel_xent", _xent_z_loss_summed_twice)
        assert not _verify("z", 1, 4, cfg=cfg, dtype=jnp.float64, controls=()).ok
        assert _verify("tiny-llama", 1, 4, dtype=jnp.float64, controls=()).ok  # the bug needs z_loss > 0


def _controls(*names):
    """The named controls only (each compiles a program of its own; test_transformer.py runs llama's
    attention controls on 2x2 quick, and every control of gptj and llama on 2x2 slow)."""
    found = tuple(c for c in CONTROLS if c.name in names)
    assert len(found) == len(names), names
    return found


KV_REPLICATED = "KV heads not replicated per query group"


def test_kv_heads_replicated_on_four_devices():
    """tiny-gqa has 2 KV heads: on mp = 4 they are replicated, and that control applies."""
    with jax.enable_x64(True):
        report = _verify("tiny-gqa", 1, 4, dtype=jnp.float64, controls=_controls(KV_REPLICATED))
    assert report.ok, format_report(report)
    assert max(p.max_rel_err for p in report.params) <= 1e-12
    assert [c["name"] for c in report.controls] == [KV_REPLICATED]


@pytest.mark.parametrize(("dp", "mp"), [(1, 4), (2, 2), (4, 1)])
def test_data_pipeline_rows_assemble_to_the_one_device_batch(dp, mp):
    rows = data_checks(make_mesh(dp, mp), batch=8, seq_len=16, steps=4)
    assert [r["name"] for r in rows] == ["data pipeline (accumulation 1)", "data pipeline (accumulation 2)"]
    assert all(r["ok"] for r in rows), rows


def test_data_pipeline_check_catches_swapped_rows(monkeypatch):
    from meshlm.proof import data_pipeline

    real = data_pipeline.device_batch

    def swapped(batcher, step, mesh, accum):  # shard 0 reads shard 1's offsets
        out = real(batcher, step, mesh, accum)
        return {k: jnp.roll(v, v.shape[-2] // 2, axis=-2) for k, v in out.items()}

    monkeypatch.setattr(data_pipeline, "device_batch", swapped)
    rows = data_checks(make_mesh(2, 2), batch=8, seq_len=16, steps=2)
    assert not any(r["ok"] for r in rows) and "differ" in rows[0]["detail"]


def test_a_rule_with_the_wrong_per_shard_shape_is_a_failing_row():
    """The MLP's input weights split along D instead of F: the layer asks for [D, F/mp]."""
    cfg = get_config("tiny-llama")
    wrong = tuple(
        (r"/mlp/w_(in|gate|up)$", (MP, None)) if p == r"/mlp/w_(in|gate|up)$" else (p, s) for p, s in RULES
    )
    problem = model_problem(cfg, "wrong rule", 2, 2, 16)
    problem = dataclasses.replace(problem, specs_fn=lambda a: param_specs(a, 2, wrong))
    report = verify(problem, make_mesh(1, 2), controls=())
    assert not report.ok
    (row,) = report.params
    assert row.path in ("layers/mlp/w_gate", "layers/mlp/w_up") and not row.ok
    detail = _check(report, "sharding rules")["detail"]
    assert "P(None, 'mp', None)" in detail and "holds (32, 128)" in detail and "with (64, 64)" in detail


# tiny-gptj slow: the same check on another family (scale)
@pytest.mark.parametrize("name", [pytest.param("tiny-gptj", marks=pytest.mark.slow), "tiny-llama"])
def test_communication_is_minimal_and_an_extra_all_reduce_is_caught(name):
    extra_all_reduce = "extra all-reduce after each row-parallel one"
    report = _verify(name, 2, 2, collectives=True, controls=_controls(extra_all_reduce))
    assert report.ok, format_report(report)
    assert _check(report, "all-reduces per step")["ok"] and _check(report, "all-gathers per step")["ok"]
    (extra,) = [c for c in report.controls if c["name"] == extra_all_reduce]
    assert extra["detected"] and "all-reduces per step" in extra["how"]


def test_matrix_rows_and_table(monkeypatch):
    """The rows and the table; a cell is the full proof (values, checks, communication, data pipeline)
    with one control here (every control is tested above and in test_transformer.py)."""
    from meshlm.proof import matrix
    from meshlm.proof.matrix import _cell, format_matrix, meshes

    monkeypatch.setattr(matrix, "verify", functools.partial(verify, controls=_controls("dropped all-reduce")))
    assert meshes(8) == [(8, 1), (4, 2), (2, 4), (1, 8)]
    rows = [
        _cell("tiny-gqa", 1, 2, "plain", {}, x64=False, steps=0, seed=0),
        _cell("tiny-gptj", 1, 3, "plain", {}, x64=False, steps=0, seed=0),
    ]
    assert rows[0]["ok"] is True and rows[1]["ok"] is None and "n_heads=8" in rows[1]["skipped"]
    assert rows[0]["controls"] == "1/1" and rows[0]["checks"].split("/")[0] == rows[0]["checks"].split("/")[1]
    table = format_matrix(rows, markdown=True)
    assert table.splitlines()[0].startswith("| preset | mesh |") and "| PASS |" in table
    assert np.all([len(line.split("|")) == 9 for line in table.splitlines()])


def test_a_nan_error_is_reported_as_nan_not_zero():
    """Issue 36: Python's ``max(0.0, nan)`` is 0.0, so a NaN gradient row read "error 0.0 ... FAIL".
    The verdict was right, the figure not: the row, the worst error and the JSON say NaN."""
    from meshlm.proof.report import LeafResult, Report, worst

    leaf = LeafResult(path="layers/w", shape=(2,), spec="P()")
    leaf.update(np.array([1.0, 2.0]), np.array([1.0, 2.0]), 1e-12, 1e-15)  # a first, exact comparison
    leaf.update(np.array([np.nan, 2.0]), np.array([1.0, 2.0]), 1e-12, 1e-15)
    assert np.isnan(leaf.max_abs_err) and np.isnan(leaf.max_rel_err) and not leaf.ok
    report = Report(config="c", dp=1, mp=1, steps=0, dtype="float64", rtol=1e-12, atol=1e-15, params=[leaf])
    text = format_report(report)
    assert "worst relative error: nan" in text and "FAIL" in text
    assert np.isnan(worst(0.0, float("nan"), 1.0)) and worst() == 0.0


def test_matrix_axes_cells_prove_or_refuse_with_the_layouts_reason(monkeypatch, capsys):
    """``--matrix --axes pp,cp``: every schedule and cp strategy, plain and FSDP + SP, and their pairs;
    a pair the layout refuses is a row with the layout's own line (here without running any proof:
    ``verify`` is replaced), so when the pair is allowed the cell becomes a proof. --axes needs
    --matrix, and names only pp and cp (one line each)."""
    from meshlm.errors import ConfigError
    from meshlm.parallel.layout import Layout
    from meshlm.proof import axes_matrix
    from meshlm.proof.axes_matrix import _cell, axes_cells, parse_axes
    from meshlm.proof.matrix import format_matrix

    cells = dict(axes_cells(("pp", "cp")))
    assert (
        len(cells) == 3 * 2 + 2 * 2 + 3 * 2
        and "pp2 1f1b, fsdp + sp" in cells
        and "cp2 ring, fsdp + sp" in cells
    )
    monkeypatch.setattr(axes_matrix, "verify", lambda *a, **k: pytest.fail("a refused pair runs no proof"))
    pair = cells["pp2 1f1b x cp2 ring"]
    try:
        Layout(**pair)
    except ConfigError as e:
        row = _cell("pp2 1f1b x cp2 ring", pair, 8, x64=False, steps=0, seed=0)
        assert row["ok"] is None and row["refused"] == str(e)
        assert f"refused: {e}" in format_matrix([row])
    else:  # pp x cp allowed (after its merge): the cell is a proof, covered by verify --matrix --axes
        pass
    with pytest.raises(ConfigError, match="--axes pp,ep: ep is not one of pp, cp"):
        parse_axes("pp,ep")
    assert run_cli("verify", "--axes", "pp") == 2
    assert "add --matrix or drop --axes" in capsys.readouterr().err
