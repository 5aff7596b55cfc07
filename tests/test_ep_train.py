"""Training with the experts over ``--ep``: ep is a sharding, not a format. A run saved with ep 2 resumes
bit for bit (the steps after a restore equal the steps of a run never stopped), and its checkpoint
restores without ep and onto ep 4, each restore holding exactly the saved parameters and AdamW state.
(The file-level resume after a SIGKILL does not depend on the layout:
``test_train.test_sigkill_then_resume_is_bitwise_identical``.)"""

import jax
import numpy as np
import pytest
from helpers import tiny_lm_config, write_corpus

from meshlm.parallel.layout import Layout
from meshlm.train.loop import _one_step, save
from meshlm.train.run import build_run


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _host(run):
    return jax.tree.map(np.asarray, (run.params, run.opt_state))


def _steps(run, n):
    """n steps, then save and close: (losses, the saved state on the host)."""
    losses = [float(_one_step(run)["loss"]) for _ in range(n)]
    save(run)
    state = _host(run)
    run.ckpt.close()
    return losses, state


def _equal(a, b) -> bool:
    return all(jax.tree.leaves(jax.tree.map(np.array_equal, a, b)))


def test_ep_resumes_bitwise_and_restores_without_ep_and_onto_ep4(corpus, tmp_path):
    """tiny-mixtral (4 experts) on 2x1 ep 2: two steps straight equal one step, a restore and one more
    (losses and state bitwise); the checkpoint then restores on 1x1 (no ep) and on 4x1 ep 4 (one
    expert per device) with the saved values exactly, and a step trains there."""
    tcfg = lambda out, **kw: tiny_lm_config(
        corpus,
        tmp_path / out,
        config="tiny-mixtral",
        tokenizer="bpe-300",
        steps=4,
        lr=3e-3,
        batch_size=4,
        seq_len=16,
        **kw,
    )
    ep2 = Layout(dp=2, ep=2)
    straight, want = _steps(build_run(tcfg("straight", ep=2), ep2), 2)
    first, _ = _steps(build_run(tcfg("cut", ep=2), ep2), 1)
    resumed = build_run(tcfg("cut", ep=2), ep2)
    assert resumed.step == 1 and resumed.specs["layers/moe/experts"]["w_gate"][1] == "ep"
    second, saved = _steps(resumed, 1)
    assert first + second == straight and _equal(saved, want)  # bitwise
    plain = build_run(tcfg("cut"), Layout())
    assert plain.step == 2 and not plain.layout.experts_split
    assert _equal(_host(plain), saved)
    plain.ckpt.close()
    ep4 = build_run(tcfg("cut", ep=4), Layout(dp=4, ep=4))
    assert ep4.step == 2 and ep4.layout.mesh_shape == {"dp": 1, "ep": 4, "mp": 1}
    assert _equal(_host(ep4), saved)
    last, _ = _steps(ep4, 1)
    assert np.all(np.isfinite(straight + last))
