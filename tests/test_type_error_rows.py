"""A varying-axis type error raised while tracing the sharded program is a failing proof row naming
where (the collective and the layer calling it, or the output) and the typing rule, with exit 1, not
a traceback; as a control the same fault still counts as rejected by the type system."""

from helpers import run_cli

from meshlm.model.config import get_config
from meshlm.parallel.context import Parallel
from meshlm.parallel.mesh import make_mesh
from meshlm.proof import format_report, model_problem, verify
from meshlm.proof.control_runs import REJECTED
from meshlm.proof.controls import Control


def _row(report) -> dict:
    (row,) = [c for c in report.checks if c["name"] == "varying-axis types"]
    return row


def _verify(dp, mp, **kw):
    problem = model_problem(get_config("tiny-llama"), "tiny-llama", mp, 2 * dp, 8, dp=dp)
    return verify(problem, make_mesh(dp, mp), **kw)


def test_a_missing_all_reduce_is_a_row_naming_the_collective_and_the_rule(monkeypatch):
    monkeypatch.setattr(Parallel, "g", lambda self, x: x)
    report = _verify(1, 2, controls=())
    assert not report.ok
    row = _row(report)
    assert not row["ok"] and "Unsupported pcast from=varying" in row["detail"]
    assert "f (parallel/context.py:" in row["detail"] and "model/transformer.py" in row["detail"]
    assert "rule: f (pcast to per-shard) was applied to a value that is per-shard already" in row["detail"]
    assert "check varying-axis types" in format_report(report) and not report.params[0].ok


def test_a_loss_left_per_shard_names_the_loss(monkeypatch):
    monkeypatch.setattr(Parallel, "batch_mean", lambda self, x: x)
    row = _row(_verify(2, 1, controls=()))
    assert not row["ok"] and "the loss (out_specs P())" in row["detail"]
    assert "varying over {dp}" in row["detail"] and "the data-parallel mean" in row["detail"]


def test_cli_exit_1_not_a_traceback(monkeypatch, capsys):
    monkeypatch.setattr(Parallel, "g", lambda self, x: x)
    args = ("verify", "--config", "tiny-llama", "--mesh", "1x2", "--seq-len", "8", "--no-collectives")
    assert run_cli(*args) == 1
    out = capsys.readouterr()
    assert "check varying-axis types" in out.out and "FAILED" in out.out and "Traceback" not in out.err
    assert "controls: not run (the sharded program could not be traced)" in out.out


class _NotReduced(Parallel):
    def g(self, x):
        return x


def test_as_a_control_the_same_fault_is_rejected_by_the_type_system():
    control = Control(name="not reduced", applies=lambda w: True, par_cls=_NotReduced)
    (c,) = _verify(1, 2, controls=(control,)).controls
    assert c["detected"] and c["by"] == REJECTED and c["margin"] is None
