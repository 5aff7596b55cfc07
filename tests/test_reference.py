"""The reference verify compares against: computed by the very program the independence check reads,
never the sharded program in disguise, and the plainest program (no remat, optax's own clip and
AdamW), so that sharded-side code paths are checked against code they do not share."""

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from meshlm.model.config import get_config
from meshlm.parallel.mesh import make_mesh
from meshlm.proof import format_report, model_problem, verify
from meshlm.proof.runs import Runs


def _verify(name, dp, mp, *, cfg=None, **kw):
    cfg = cfg or get_config(name)
    return verify(model_problem(cfg, name, mp, 2 * dp, 16), make_mesh(dp, mp), controls=(), **kw)


def _check(report, name) -> dict:
    (row,) = [c for c in report.checks if c["name"] == name]
    return row


# "f32 steps" slow: the same check after an AdamW step (its cost: the step's second program); the fault's
# class is caught quick at step 0 in float32 and float64
STEPS_SLOW = pytest.param(1, False, id="f32 steps", marks=pytest.mark.slow)


CASES = [pytest.param(0, False, id="f32"), STEPS_SLOW, pytest.param(0, True, id="f64")]


@pytest.mark.parametrize("steps, x64", CASES)
def test_a_reference_returning_the_sharded_results_on_one_device_fails(monkeypatch, steps, x64):
    """Every gradient then agrees exactly and sits on one device: only exactness can tell, also when
    the training steps (compared separately) are a real reference's, and in float64 (issue 36: the
    row was float32's only, and such a reference passed ``--x64`` with an error of exactly 0)."""

    def borrowed(self):
        return jax.device_put(self.grads(self.problem.build_loss), self.device)

    monkeypatch.setattr(Runs, "reference_grads", borrowed)
    with jax.enable_x64(x64):
        report = _verify("tiny-llama", 1, 2, steps=steps, dtype=jnp.float64 if x64 else jnp.float32)
    assert all(p.ok for p in report.params)
    if not steps:
        assert all(p.max_abs_err == 0 for p in report.params)
    assert _check(report, "reference runs on one device")["ok"]  # the device check alone would pass
    row = _check(report, "reference is not the sharded program")
    assert (
        not row["ok"] and "loss and gradients: all" in row["detail"] and "suspiciously exact" in row["detail"]
    )
    assert not report.ok and "suspiciously exact" in format_report(report)


def test_a_correct_reference_differs_in_rounding_and_passes():
    report = _verify("tiny", 1, 2, steps=1)
    assert report.ok, format_report(report)
    row = _check(report, "reference is not the sharded program")
    assert row["ok"] and "leaves differ in rounding" in row["detail"]
    detail = _check(report, "reference names no mesh axis")["detail"]  # the programs that computed them
    assert "loss and gradients" in detail and "train step" in detail
    with jax.enable_x64(True):  # float64 rounds differently too: the row, passing
        report = _verify("tiny", 1, 2, dtype=jnp.float64)
    row = _check(report, "reference is not the sharded program")
    assert row["ok"] and "leaves differ in rounding" in row["detail"]


def test_the_train_step_that_computes_reference_values_is_the_one_checked(monkeypatch):
    """A mesh axis hidden in the reference's training step (values unchanged) fails the check: the
    step's jaxpr is read, and it is the program that computed the compared training state."""
    from meshlm.proof import runs

    real = runs.reference_step
    one = Mesh(jax.local_devices()[:1], ("x",))

    def with_shard_map(grad_fn, ocfg, opt, **kw):  # kw: what it trains (``part``), a bias rate
        step = real(grad_fn, ocfg, opt, **kw)

        def stepped(params, opt_state, batch):
            p, s, m = step(params, opt_state, batch)
            loss = jax.shard_map(lambda x: x, mesh=one, in_specs=P(), out_specs=P())(m["loss"])
            return p, s, {"loss": loss}

        return stepped

    monkeypatch.setattr(runs, "reference_step", with_shard_map)
    report = _verify("tiny", 1, 2, steps=1)
    assert all(p.ok for p in report.params)
    row = _check(report, "reference names no mesh axis")
    assert not row["ok"] and "shard_map" in row["detail"]


def _norm_of_first_leaf(grads, max_norm):
    """A clip by the wrong norm (one leaf's), shared by nothing but the sharded step: its (scale, norm)."""
    norm = optax.tree.norm(jax.tree.leaves(grads)[0])
    return (jnp.where(norm < max_norm, 1.0, max_norm / norm) if max_norm else jnp.ones(())), norm


def test_a_clip_by_the_wrong_norm_is_caught(monkeypatch):
    """The reference clips with optax.clip_by_global_norm: meshlm's clip is checked against it."""
    monkeypatch.setattr("meshlm.train.optim.clip_scale", _norm_of_first_leaf)  # correct: above
    report = _verify("tiny", 1, 2, steps=1)
    assert any(not p.ok for p in report.params), format_report(report)  # the trained state differs


# save_qkv_attn slow: the same mechanism as save_qkv_mlp_in's case (a named policy), which stays quick
@pytest.mark.parametrize(
    "remat", ["selective", "save_qkv_mlp_in", pytest.param("save_qkv_attn", marks=pytest.mark.slow)]
)
def test_a_remat_path_that_changes_values_is_caught(monkeypatch, remat):
    """The reference runs without remat: a recomputed layer that differs (its input rounded to
    bfloat16 on the remat path only) is caught, where a reference sharing the remat path would agree."""
    from meshlm.model import memory, stack

    def lossy(policy, body, gathers=True):
        if policy == "none":
            return memory.remat_body(policy, body, gathers)
        rounded = lambda x, *rest: body(x.astype(jnp.bfloat16).astype(x.dtype), *rest)
        return memory.remat_body(policy, rounded, gathers)

    monkeypatch.setattr(stack, "remat_body", lossy)
    cfg = get_config("tiny-llama").replace(remat=remat)
    report = _verify("tiny-llama", 1, 2, cfg=cfg)
    assert not report.ok, format_report(report)
    assert _verify("tiny-llama", 1, 2).ok  # remat "none": the lossy path is not taken


def test_what_the_reference_shares_is_pinned_here():
    """The schedule and the weight-decay mask are the two pieces both runs share (settings of the run,
    not of the sharding): pinned against their definitions so that sharing cannot hide a bug."""
    from meshlm.model.params import flat_params
    from meshlm.model.transformer import param_shapes
    from meshlm.train.optim import OptimConfig, decay_mask, schedule

    sched = schedule(OptimConfig(lr=1.0, warmup_steps=4, total_steps=20, min_lr_ratio=0.1))
    assert [float(sched(s)) for s in (0, 2, 4)] == [0.0, 0.5, 1.0]
    assert float(sched(20)) == pytest.approx(0.1) and 0.1 < float(sched(12)) < 1.0
    mask = flat_params(decay_mask(param_shapes(get_config("tiny-gptj"))))
    assert {p for p, on in mask.items() if on} == {
        p for p in mask if p.rsplit("/", 1)[1].startswith("w") and not p.startswith("embed")
    }
    assert not mask["embed/embeddings"] and not mask["head/b"] and mask["head/w"]
