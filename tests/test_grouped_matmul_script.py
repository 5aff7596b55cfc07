"""``scripts/grouped_matmul_cpu.py`` (docs/benchmarks.md's bound on XLA:CPU's grouped matmul) runs as the
page shows it and reports every case: one repetition, one call each."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "grouped_matmul_cpu.py"


def test_grouped_matmul_script_reports_every_case():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--reps", "1", "--inner", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    report = json.loads(out)
    xla = {"xla dense (dense-eq)", "xla batched dot", "xla per-expert dots", "xla ragged_dot"}
    assert set(report["ms"]) == xla | {"numpy dense", "numpy batched"}
    assert all(ms > 0 for ms in report["ms"].values())
    assert set(report["over_xla_dense"]) == xla and report["over_xla_dense"]["xla dense (dense-eq)"] == 1.0
    assert report["cores"] >= 1
