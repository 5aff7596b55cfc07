"""``scripts/decode_chunks.py`` (docs/benchmarks.md, "Decode: chunks of steps") runs at tiny size: one
JSON line with both ways' milliseconds a step, their ratio, and no roofline on a CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshlm.generate.programs import DECODE_CHUNK

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "JAX_PLATFORMS": "cpu"}


# slow: a script's run (its cost); chunked decoding itself: test_generate.py's
# test_chunked_decode_draws_the_tokens_of_single_steps, quick
@pytest.mark.slow
def test_decode_script_reports_both_ways():
    args = ["--config", "tiny-llama", "--batch", "2", "--prompt", "8", "--new", "10", "--reps", "1"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "decode_chunks.py"), *args],
        capture_output=True, text=True, timeout=300, env=ENV,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(done.stdout.splitlines()[-1])
    assert (
        row["chunk"] == DECODE_CHUNK and set(row["ms_per_step"]) == {"chunk", "single"} and row["same_tokens"]
    )
    assert all(v > 0 for v in row["ms_per_step"].values()) and row["single_over_chunk"] > 0
    assert row["device"] == "cpu" and row["roofline_ms"] is None


# slow: as above
@pytest.mark.slow
def test_decode_script_times_several_chunk_lengths_with_the_same_tokens():
    """``--chunks 8,16``: each length its own programs (their chunk programs return 8 and 16 tokens a
    row: Generators once shared one length's), timed beside the others, the tokens of single steps at
    every length (bf16 weights and cache)."""
    args = ["--config", "tiny-llama", "--batch", "2", "--prompt", "8", "--new", "17", "--reps", "1"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "decode_chunks.py"), *args, "--chunks", "8,16", "--bf16"],
        capture_output=True, text=True, timeout=300, env=ENV,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(done.stdout.splitlines()[-1])
    assert set(row["ms_per_step"]) == {"chunk", "chunk 16", "single"} and row["same_tokens"]
    assert row["chunk_ran"] == {"chunk": 8, "chunk 16": 16}  # each length its own programs
    assert row["dtype"] == "bfloat16" and all(v > 0 for v in row["ms_per_step"].values())


def test_decode_script_refuses_a_chunk_length_that_is_not_a_whole_number_in_one_line():
    """Bad input before any work: ``--chunks 8,0`` (or ``8,x``) is one line naming the fix."""
    for bad in ("8,0", "8,x"):
        done = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "decode_chunks.py"), "--chunks", bad],
            capture_output=True, text=True, timeout=60, env=ENV,
        )  # fmt: skip
        assert done.returncode == 2 and "whole numbers >= 1" in done.stderr and "Traceback" not in done.stderr
