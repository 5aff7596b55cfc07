"""The loop reads each step's metrics one step late (no device sync per step) and still writes every row,
in order, up to a crash or a non-finite step; a non-finite step saves the exact last good state."""

import re

import pytest
from helpers import tiny_lm_config, train_rows, write_corpus

from meshlm.errors import TrainingError
from meshlm.io.checkpoint import Checkpointer
from meshlm.parallel.mesh import make_mesh
from meshlm.train import loop


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


_tcfg = tiny_lm_config


def test_rows_of_finished_steps_survive_a_crash(corpus, tmp_path, monkeypatch):
    real = loop.device_batch

    def failing(batcher, step, mesh, accum):
        if step == 4:  # building step 5's batch, while step 4 is still in flight
            raise RuntimeError("planted data failure")
        return real(batcher, step, mesh, accum)

    monkeypatch.setattr(loop, "device_batch", failing)
    with pytest.raises(RuntimeError, match="planted data failure"):
        loop.train(_tcfg(corpus, tmp_path, steps=8), make_mesh(1, 2))
    assert [r["step"] for r in train_rows(tmp_path)] == [1, 2, 3, 4]


def test_non_finite_step_read_late_saves_the_state_before_it(corpus, tmp_path):
    with pytest.raises(TrainingError) as err:
        loop.train(_tcfg(corpus, tmp_path, steps=30, lr=1e9, clip_norm=0), make_mesh(1, 2))
    bad = int(re.search(r"at step (\d+)", str(err.value)).group(1))
    good = int(re.search(r"state \(step (\d+)\)", str(err.value)).group(1))
    assert good == bad - 1
    assert Checkpointer(tmp_path).all_steps()[-1] == good
    assert [r["step"] for r in train_rows(tmp_path)] == list(range(1, good + 1))
