"""``scripts/moe_kernels.py`` (issue 64: the experts alone by ragged_dot and gmm at several tilings against
the dense MLP, on the chip) runs on CPU at tiny shapes, the kernel in interpret mode, and reports
every case."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "moe_kernels.py"
SRC = Path(__file__).resolve().parents[1] / "src"


# slow: ~15 s of interpret-mode compiles in a subprocess; the kernel's equality with the reference, and in
# shard_map: tests/test_gmm.py::test_the_kernel_in_shard_map_equals_the_reference (quick)
@pytest.mark.slow
def test_moe_kernels_script_smoke():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-smoke"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"},
    ).stdout
    row = json.loads(out.strip().splitlines()[-1])
    assert set(row["ms"]) == {"dense MLP (dense-eq)", "ragged_dot", "gmm auto", "gmm 128,128,128"}
    assert row["failed"] == {} and all(v > 0 for v in row["ms"].values())
    assert row["over_dense"]["dense MLP (dense-eq)"] == 1.0
