"""Uneven pipeline stages (``model.stage_layers.slots``, ``sharding.stage_slots``): a body whose layer
count does not split into the chunks runs in chunks of ceil(body / chunks) slots, the padding slots the
identity with their routing statistics dropped. Proven equal to the unsharded model (the real layers)
in float64, with the classic bug planted and detected: a padding slot's routing statistics counted in
the aux loss. (A padding slot that runs its layer is not a
detectable fault while its parameters are zero: a zero residual layer is the identity with zero
gradients; ``stage_slots.chunk``'s ``where`` keeps it the identity whatever the slot holds.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.model import stage_layers
from meshlm.model.config import get_config
from meshlm.parallel.axes import PP
from meshlm.parallel.layout import Layout
from meshlm.proof import model_problem, verify
from meshlm.sharding import stage_slots

FAULTS = ()  # the engine's faults are proven on every schedule (tests/test_pp_verify.py): here the padding


def test_padding_goes_to_the_first_chunks_and_the_tree_round_trips():
    per, real = stage_layers.slots(get_config("deepseek-v3"), 4)  # 58 MoE layers on 4 stages
    assert per == 15 and len(real) == 58 and real[:14] == tuple(range(13)) + (15,)  # stage 0: 13 layers
    assert stage_layers.slots(get_config("deepseek-v3"), 2) is None  # 58 = 2 x 29: no padding
    slots = stage_slots.Slots(3, 2, 2, (0, 2, 3))
    tree = {"layers/attn": {"w": np.arange(6.0).reshape(3, 2)}, "embed": {"embeddings": np.ones((3, 2))}}
    padded = slots.pad(tree)
    assert padded["layers/attn"]["w"].tolist() == [[0, 1], [0, 0], [2, 3], [4, 5]]
    assert padded["embed"]["embeddings"].shape == (3, 2)  # not the body's: as it was
    np.testing.assert_array_equal(slots.unpad(padded)["layers/attn"]["w"], tree["layers/attn"]["w"])
    # a checkpoint's real stack is read with pp moved to another dimension it divides (no device holds
    # more than the padded stack's share), and padded onto the layer dimension by ``to_device``
    from meshlm.io.model_io import abstract_params

    canonical = abstract_params(get_config("tiny-deepseek-v3").replace(n_layers=4), Layout(pp=2))
    w = canonical["layers/attn"]["wkv_b"]
    assert w.shape[0] == 3 and w.sharding.spec[0] is None and PP in w.sharding.spec


def _verify(name, changes, schedule="gpipe"):
    layout = Layout(pp=2, mp=2, microbatches=2, pp_schedule=schedule)
    cfg = get_config(name).replace(**changes)
    problem = model_problem(cfg, name, layout, 4, 8)
    assert problem.slots is not None  # the body does not split: padded
    with jax.enable_x64(True):
        return verify(problem, layout, steps=1, dtype=jnp.float64, controls=(), pipeline_faults=FAULTS)


def _ok(report):
    return report.ok and report.loss_ok and max(p.max_rel_err for p in report.params) <= 1e-12


# slow: the padded stack's proof on DeepSeek-V3's MoE body (its cost: ~1 CPU-min); the padding's proof on a
# dense model is quick below
@pytest.mark.slow
def test_deepseek_with_an_odd_moe_body_is_proven():
    # 1 dense layer with the embedding, 3 MoE layers on 2 stages: slots [layer, padding], [layer, layer]
    report = _verify("tiny-deepseek-v3", {"n_layers": 4, "mtp_layers": 0, "mtp_weight": 0.0})
    assert _ok(report), [c for c in report.checks if not c["ok"]]
    assert all(c["detected"] for c in report.controls), report.controls


# slow: the planted fault of the proof above, on the same MoE body (its cost)
@pytest.mark.slow
def test_a_padding_slots_aux_loss_counted_is_detected(monkeypatch):
    # the padding slot's (slot 1's) routing statistics counted with layer 0's: its balance loss added
    real = stage_slots.real_statistics
    monkeypatch.setattr(stage_slots, "real_statistics", lambda slots, a: real(slots, a).at[0].add(a[1]))
    report = _verify("tiny-deepseek-v3", {"n_layers": 4, "mtp_layers": 0, "mtp_weight": 0.0})
    assert not report.loss_ok and not _ok(report)  # the loss gains the padding's balance loss


def test_a_dense_model_with_an_odd_layer_count_is_proven():
    report = _verify("tiny-llama", {"n_layers": 3}, schedule="1f1b")
    assert _ok(report), [c for c in report.checks if not c["ok"]]


# slow: a training run with padding slots and its restore without pp (its cost); the padded stack's proof is
# quick above, a restore across layouts in tests/test_checkpoint.py
@pytest.mark.slow
def test_training_with_padding_saves_the_real_layers_a_run_without_pp_loads(tmp_path):
    """cpu's 4 layers on pp 3: chunks of 2 slots, 2 of them padding. One step, saved: the checkpoint
    holds the 4 real layers (the format of any pp), equal to the run's own, and loads without pp; the
    padding stayed exactly zero (its gradients are); the run resumes on pp 3 to the state it saved; its
    evaluation under pp is the plain model's loss of the real layers."""
    from helpers import tiny_lm_config, write_corpus

    from meshlm.io.model_io import load_model
    from meshlm.parallel.placement import to_host
    from meshlm.train.loop import _one_step, save
    from meshlm.train.run import build_run

    corpus = write_corpus((tmp_path / "corpus").mkdir() or tmp_path / "corpus")
    tcfg = tiny_lm_config(corpus, tmp_path / "run", config="cpu", steps=1, batch_size=3, seq_len=16, pp=3)
    run = build_run(tcfg, Layout(pp=3, microbatches=3))
    slots = stage_slots.slots_of(run.cfg, run.layout)
    assert slots is not None and run.params["layers/attn"]["wq"].shape[0] == slots.total == 6
    loss = float(_one_step(run)["loss"])
    save(run)
    run.ckpt.close()
    state = jax.tree.map(to_host, (run.params, run.opt_state))
    # saved from the canonical stack, pp off its layer dimension (cpu's dimensions: none divides by 3)
    assert stage_slots.canonical_abstract(run.params, slots)["layers/attn"]["wq"].sharding.spec[0] is None
    again = build_run(tcfg, Layout(pp=3, microbatches=3))  # resumed: the real layers padded again
    again.ckpt.close()
    resumed = jax.tree.map(to_host, (again.params, again.opt_state))
    assert again.step == 1 and all(jax.tree.leaves(jax.tree.map(np.array_equal, resumed, state)))
    assert np.isfinite(loss)
    padded = jax.tree.map(to_host, run.params)
    padding = np.ones(slots.total, bool)
    padding[list(slots.real)] = False
    assert all(not np.any(a[padding]) for a in jax.tree.leaves(padded["layers/attn"]))  # still zero
    cfg, loaded, step = load_model(tmp_path / "run", Layout())
    assert step == 1 and loaded["layers/attn"]["wq"].shape[0] == cfg.n_layers == 4
    same = jax.tree.map(np.array_equal, jax.tree.map(to_host, loaded), slots.unpad(padded))
    assert all(jax.tree.leaves(same))
    # the run's evaluation under pp reads the real layers of the padded stack: the plain model's loss
    from meshlm.sharding.pipelined import pipelined_loss

    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16), dtype=np.int32)
    batch = {"inputs": ids, "targets": np.roll(ids, -1, axis=1)}
    got = jax.jit(pipelined_loss(run.cfg, None, run.layout))(run.params, batch)
    want = jax.jit(pipelined_loss(run.cfg))(jax.device_get(loaded), batch)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)


def test_plan_holds_the_padded_stack_and_counts_the_real_layers():
    """``meshlm plan`` of uneven stages (docs/models.md's deepseek-v3 on --pp 4, on cpu's 4 layers on pp
    3): the step compiles on the padded stack; the unsharded total counts the real layers."""
    from meshlm.perf.plan import state_bytes
    from meshlm.perf.plan_search import plan
    from meshlm.perf.plan_settings import PlanSettings

    cfg, run = get_config("cpu"), PlanSettings(batch_size=3, seq_len=16)
    report = plan(cfg, "cpu", Layout(pp=3, microbatches=3), run)
    assert report["unsharded"]["params"] == state_bytes(cfg, Layout(), run)["params_total"]
    compiled, state = report["plan"]["compiled"], state_bytes(cfg, Layout(pp=3), run)
    assert compiled["params"] == state["params_per_device"] > state["params_total"] // 3
