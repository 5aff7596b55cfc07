"""``scripts/step_memory.py`` (meshlm's and plain JAX's compiled step memory side by side, issue 63.5):
both steps' five figures and their ratio, and with ``--top`` each step's largest temporaries at its
peak and largest heap slots, read back from XLA's dump (tiny-llama on this host's CPU; a process of
its own, as it is run: the dump needs a compile, not the test run's persistent cache's hit)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_step_memory_prints_both_steps_and_their_buffers(tmp_path):
    argv = [sys.executable, str(ROOT / "scripts" / "step_memory.py"), "--config", "tiny-llama"]
    argv += ["--batch-size", "2", "--seq-len", "32", "--top", "2", "--dump", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=True).stdout
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.split()}
    assert len(rows["meshlm"]) == len(rows["plain"]) == len(rows["ratio"]) == 5  # argument ... peak
    for impl in ("meshlm", "plain"):
        assert f"{impl}: the 2 largest temporaries live at its peak" in out
        assert f"{impl}: the 2 largest slots of its memory heap" in out
        assert (tmp_path / impl).is_dir()  # each step's own dump
    assert " MB  " in out.split("largest temporaries")[1]  # buffers were read back, not an empty list
