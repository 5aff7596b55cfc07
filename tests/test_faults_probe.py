"""The third reliability pass (issue 27): the wrong answers of an adversarial probe, each reproduced.

One line on stderr naming the problem and the fix, the documented exit code, nothing lost, nothing
half-written taken for whole, one owner per output directory. Subprocesses are bounded by timeouts;
nothing asserts on timing."""

from __future__ import annotations

import os
import stat

import numpy as np

from meshlm.io import hf_weights
from meshlm.model.config import get_config


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# ---------------------------------------------------------------- convert --to-hf: file modes


def test_exported_weights_have_the_mode_of_every_other_output(tmp_path):
    cfg = get_config("tiny-llama")
    flat = {p: np.zeros(s, d) for p, (s, d) in hf_weights.expected_shapes(cfg).items()}
    old = os.umask(0o022)
    try:
        out = hf_weights.save_hf(cfg, flat, tmp_path / "hf")
    finally:
        os.umask(old)
    assert _mode(out / hf_weights.CONFIG_FILE) == 0o644
    assert _mode(out / hf_weights.WEIGHTS_FILE) == 0o644  # safetensors alone wrote 0600
    assert sorted(p.name for p in out.iterdir()) == [hf_weights.CONFIG_FILE, hf_weights.WEIGHTS_FILE]
