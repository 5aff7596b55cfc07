"""``scripts/flash_tpu.py`` (the chip's measurements of ``--attention flash``, docs/benchmarks.md) runs its
logic on CPU with ``--cpu-smoke``: the kernel in Pallas interpret mode, tiny shapes; every equality case
within the float32 tolerance and a train step per attention kind (plain and flash here: the time a
test may take). Without a TPU and without ``--cpu-smoke`` it refuses in one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "flash_tpu.py"
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "JAX_PLATFORMS": "cpu"}


def run(*args):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=ENV
    )


# slow: the script's whole CPU smoke run (its cost); the kernel it drives: tests/test_flash.py, quick
@pytest.mark.slow
def test_flash_script_cpu_smoke_reports_every_cell():
    done = run("--cpu-smoke", "--kinds", "plain", "flash")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    equal = [r for r in rows if r["part"] == "equality"]
    assert len(equal) == 3 and all(r["worst_rel"] < 2e-5 for r in equal)
    assert "dsink" in equal[1]["errors"]
    steps = {r["attention"]: r for r in rows if r["part"] == "step"}
    assert set(steps) == {"plain", "flash"}
    for row in steps.values():
        assert "error" not in row and row["step_s_median"] > 0 and row["peak_mib"] > 0
    assert abs(steps["plain"]["loss"] - steps["flash"]["loss"]) < 1e-2  # one model, one batch
    assert rows[-1]["part"] == "done"


def test_flash_script_refuses_without_a_tpu():
    done = run("--skip-equality", "--skip-steps")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("flash_tpu.py: no TPU here")
