"""Training under ``--pp``: checkpoints are the same format (pp splits the stacked layer dimension), so a
run saved with a pipeline restores without one and the reverse, bit for bit. (The bitwise resume after a
SIGKILL under --pp is ``test_train.test_sigkill_then_resume_is_bitwise_identical[pp]``.)"""

import jax
import numpy as np
import pytest
from helpers import tiny_lm_config, write_corpus

from meshlm.parallel.layout import Layout
from meshlm.parallel.mesh import make_mesh
from meshlm.train.loop import _one_step, save
from meshlm.train.run import build_run


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _host(run):
    return jax.tree.map(np.asarray, (run.params, run.opt_state))


def _steps(run, n):
    losses = [float(_one_step(run)["loss"]) for _ in range(n)]
    save(run)
    state = _host(run)
    run.ckpt.close()
    return losses, state


def test_checkpoints_restore_across_pp_sizes(corpus, tmp_path):
    """pp2 (1F1B on 1x2) -> no pipeline (1x2) -> pp2 x cp2 (GPipe, the ring on 1x1): each restore holds
    exactly the saved parameters and AdamW state (a step under each writes the checkpoint the next one
    reads), and a step trains under pp x cp."""
    pp = dict(pp=2, microbatches=2)
    tcfg = lambda **kw: tiny_lm_config(corpus, tmp_path, steps=4, lr=3e-3, **kw)
    losses, saved = _steps(build_run(tcfg(**pp), Layout(mp=2, **pp)), 1)
    plain = build_run(tcfg(), make_mesh(1, 2))
    assert plain.step == 1 and plain.layout.pp == 1
    assert _equal(_host(plain), saved)
    more, saved = _steps(plain, 1)
    gpipe = dict(pp=2, cp=2, microbatches=2, pp_schedule="gpipe")
    ppcp = build_run(tcfg(**gpipe), Layout(**gpipe))
    assert ppcp.step == 2 and ppcp.layout.shape == {"pp": 2, "dp": 1, "cp": 2, "mp": 1}
    assert ppcp.specs["layers/attn"]["wq"][0] == "pp"  # restored split over the stages
    assert _equal(_host(ppcp), saved)
    last, _ = _steps(ppcp, 1)
    assert np.all(np.isfinite(losses + more + last))


def _equal(a, b) -> bool:
    return all(jax.tree.leaves(jax.tree.map(np.array_equal, a, b)))
