"""The router record proven (``proof.router_controls``) and trained: tiny-cpu-moe (cpu-moe's router:
sigmoid scores, a selection bias balanced without an aux loss, expert groups, scaled weights, a shared
expert) on 2x2 with ep 2 in float64, its bias after the steps equal to the unsharded run's bit for bit
(the loads are integer counts), each router control detected; and a run that stops and resumes moves
the bias exactly as one never stopped."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_lm_config, write_corpus

from meshlm.model.config import get_config
from meshlm.parallel.layout import Layout
from meshlm.proof.router_controls import ROUTER_CONTROLS

CFG = get_config("tiny-cpu-moe")


# slow: the router record's options (sigmoid, groups, bias) proven on ep (its cost); the router's code path
# (model.routers) with its controls is proven quick by tests/test_moe.py, the record's math by
# tests/test_routers.py
@pytest.mark.slow
def test_router_proven_on_ep_with_its_bias_bitwise():
    from meshlm.proof import format_report, model_problem, verify
    from meshlm.proof.moe_controls import MOE_CONTROLS

    layout = Layout(dp=2, mp=2, ep=2)
    with jax.enable_x64(True):
        problem = model_problem(CFG, "tiny-cpu-moe", layout, 4, 8)
        controls = MOE_CONTROLS + ROUTER_CONTROLS
        report = verify(problem, layout, steps=2, dtype=jnp.float64, controls=controls)
    assert report.ok and max(p.max_rel_err for p in report.params) <= 1e-12, format_report(report)
    (bias,) = [p for p in report.params if p.path.endswith("moe/router/balance_bias")]
    assert bias.max_abs_err == 0.0, bias  # bit for bit: sign(mean - integer counts) x rate
    found = {c["name"]: c["detected"] for c in report.controls}
    assert all(found[c.name] for c in ROUTER_CONTROLS), found


def test_gpt_oss_pieces_proven_under_ep_and_mp():
    """gpt-oss's pieces on tiny-cpu-moe's experts: the router's logit bias, the experts' biases (the
    down bias added once, on mp shard 0's partial), the clamped SwiGLU with alpha; softmax scores,
    renormalised, no groups; through the sorted dispatch (the default "blocks": each row's expert's gate
    and up biases in the grouped matmuls). Loss and every gradient (the biases') equal the unsharded
    model's (the prover's reference: the "dense" dispatch, every expert on every token)."""
    from meshlm.proof import format_report, model_problem, verify

    gpt_oss = dict(router_bias=True, expert_bias=True, swiglu_limit=0.5, swiglu_alpha=1.702)
    plain = dict(router_score="softmax", n_group=0, topk_group=0, balance_bias=False, moe_bias_rate=0.0)
    cfg = CFG.replace(**gpt_oss, **plain, routed_scaling_factor=1.0, n_shared_experts=0, n_layers=1)
    layout = Layout(dp=2, mp=2, ep=2)
    with jax.enable_x64(True):
        problem = model_problem(cfg, "gpt-oss pieces", layout, 4, 8)
        report = verify(problem, layout, dtype=jnp.float64, controls=())
    assert report.ok and max(p.max_rel_err for p in report.params) <= 1e-12, format_report(report)
    paths = {p.path for p in report.params}
    assert {"layers/moe/router/b", "layers/moe/experts/b_down", "layers/moe/experts/b_gate"} <= paths


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


# slow: the bias's exact resume, the same restore path as tests/test_resume.py's quick SIGKILL cell with one
# more leaf
@pytest.mark.slow
def test_bias_balancing_resumes_bitwise(corpus, tmp_path):
    """Two steps straight equal one step, a restore and one more: the losses, the parameters (the
    selection bias among them, moved by exactly +-rate per step) and AdamW's state, bitwise."""
    from meshlm.train.loop import _one_step, save
    from meshlm.train.run import build_run

    def steps(run, n):
        losses = [float(_one_step(run)["loss"]) for _ in range(n)]
        save(run)
        state = jax.tree.map(np.asarray, (run.params, run.opt_state))
        run.ckpt.close()
        return losses, state

    def tcfg(out):
        kw = dict(
            config="tiny-cpu-moe", tokenizer="bpe-300", steps=4, lr=3e-3, batch_size=4, seq_len=16, ep=2
        )
        return tiny_lm_config(corpus, tmp_path / out, **kw)

    layout = Layout(dp=2, ep=2)
    straight, want = steps(build_run(tcfg("straight"), layout), 2)
    first, _ = steps(build_run(tcfg("cut"), layout), 1)
    second, got = steps(build_run(tcfg("cut"), layout), 1)
    assert first + second == straight
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, got, want)))
    bias = want[0]["layers/moe/router"]["balance_bias"]  # [L, E] after 2 steps of +-rate or 0
    steps_taken = np.round(bias / np.float32(CFG.moe_bias_rate))
    assert np.abs(steps_taken).max() == 2 and np.all(np.abs(steps_taken) <= 2)
