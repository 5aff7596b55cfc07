"""The mixture-of-experts layer (``model.moe``) apart from the proof: the routing's tie rule, the two
load-balancing conventions against their definitions, the refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.errors import ConfigError, ShardingError
from meshlm.model import moe
from meshlm.model.config import get_config
from meshlm.model.routers import Router
from meshlm.parallel.layout import Layout
from meshlm.sharding.pipelined import check_pipelined

CFG = get_config("tiny-mixtral")


def test_ties_go_to_the_lowest_expert_id():
    logits = jnp.array([[0.0, 1.0, 1.0, 2.0], [3.0, 3.0, 3.0, 0.0]])
    _, weights, ids = moe.route(logits, 2, Router(renormalise=True))
    assert ids.tolist() == [[3, 1], [0, 1]]
    np.testing.assert_allclose(np.sum(weights, -1), 1.0, rtol=1e-6)
    _, raw, _ = moe.route(logits, 2, Router(renormalise=False))  # not renormalised: the softmax's own values
    np.testing.assert_allclose(
        raw, np.take_along_axis(np.asarray(jax.nn.softmax(logits)), np.asarray(ids), -1)
    )


def _stats(cfg, layers):
    """Per-layer statistics of random router logits [L, N, E], and the logits."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(layers, 12, cfg.n_experts)))
    rows = []
    for lg in logits:
        probs, _, ids = moe.route(lg, cfg.experts_per_token, Router.of(cfg))
        rows.append(moe.statistics(lg, probs, ids, cfg.n_experts))
    return jnp.stack(rows), logits


def test_balance_losses_are_their_definitions():
    stats, logits = _stats(CFG, 2)
    e, k = CFG.n_experts, CFG.experts_per_token
    probs = jax.nn.softmax(logits, -1)  # [L, N, E]
    chosen = jax.nn.one_hot(jax.lax.top_k(probs, k)[1], e).sum(-2)  # [L, N, E]
    pooled = e * jnp.sum(chosen.mean((0, 1)) * probs.mean((0, 1)))  # transformers': pooled over layers
    assert float(moe.balance_loss(CFG, stats)) == pytest.approx(float(pooled), rel=1e-12)
    per_layer = jnp.mean(e * jnp.sum(chosen.mean(1) / k * probs.mean(1), -1))  # Megatron's
    got = moe.balance_loss(CFG.replace(moe_aux_loss="per-layer"), stats)
    assert float(got) == pytest.approx(float(per_layer), rel=1e-12)
    z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, -1)))
    assert float(moe.z_loss(CFG, stats)) == pytest.approx(float(z), rel=1e-12)


def test_refusals_name_the_field():
    with pytest.raises(ConfigError, match="moe_aux_loss"):
        CFG.replace(moe_aux_loss="megatron")
    with pytest.raises(ConfigError, match="experts_per_token"):
        CFG.replace(experts_per_token=5)
    with pytest.raises(ConfigError, match="dense feed-forward"):
        get_config("tiny-llama").replace(n_experts=4)
    check_pipelined(CFG, Layout(pp=2))  # accepted: the statistics leave the stages (parallel.pipeline_stats)
    with pytest.raises(ConfigError, match="--pp with moe_capacity_factor"):
        check_pipelined(CFG.replace(moe_capacity_factor=1.0), Layout(pp=2))
    with pytest.raises(ConfigError, match="moe_capacity_factor"):
        CFG.replace(moe_capacity_factor=-0.5)


def test_dense_layers_among_moe_layers():
    """dense_layers: one-line refusals; the stack's runs of same-kind layers; a --pp that cannot split
    the MoE layers after the dense prefix (run with the embedding) refused in one line naming the pp
    that works; the two stacks' parameters; the gradient under remat with a rolled scan traces."""
    import haiku as hk

    from meshlm.model.layer_kinds import runs
    from meshlm.model.params import flat_params
    from meshlm.model.transformer import loss_fn
    from meshlm.parallel.context import Parallel

    cfg = get_config("tiny-qwen2-moe")
    for bad, match in (([3], "beyond n_layers=3"), ([0, 1, 2], "every layer dense"), ([1, 1], "distinct")):
        with pytest.raises(ConfigError, match=match):
            cfg.replace(dense_layers=bad)
    with pytest.raises(ConfigError, match="dense_layers"):
        get_config("tiny-llama").replace(dense_layers=[0])
    assert runs(cfg.replace(n_layers=5, dense_layers=[0, 2, 3])) == [
        ("dense_layers", 0, 0, 1), ("layers", 1, 0, 1), ("dense_layers", 2, 1, 3), ("layers", 4, 1, 2)
    ]  # fmt: skip
    with pytest.raises(
        ShardingError, match="after the 1 dense layers .* 2 layers do not split .*; use --pp 2$"
    ):
        check_pipelined(cfg, Layout(pp=3))  # the dense prefix with the embedding, the MoE layers over pp
    cfg = cfg.replace(n_layers=2)  # dense layer 0, MoE layer 1
    batch = {k: jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 8))) for k in ("inputs", "targets")}
    params = jax.eval_shape(hk.transform(loss_fn(cfg, Parallel())).init, jax.random.PRNGKey(0), batch)
    assert flat_params(params)["dense_layers/mlp/w_gate"].shape == (1, 64, 64)
    remat = cfg.replace(remat="full", unroll=1)  # each run's scan rolled, its layers recomputed
    grad = jax.grad(hk.transform(loss_fn(remat, Parallel())).apply)
    assert jax.tree.map(jnp.shape, jax.jit(grad).trace(params, None, batch).out_info) == jax.tree.map(
        jnp.shape, params
    )


def _prove_moe(controls):
    """A MoE model with every part (tiny-qwen2-moe's dense layer 0 and a MoE layer with a shared expert,
    its top-k renormalised) on 2x2 in float64: loss and every gradient (router, experts, shared expert
    and its gate, the dense layer) equal the unsharded model's, no routing flip, and each of ``controls``
    that applies detected (on the planted tie). The names of the controls run."""
    from helpers import verify_preset

    from meshlm.proof import format_report

    cfg = get_config("tiny-qwen2-moe").replace(n_layers=2, norm_topk_prob=True)
    with jax.enable_x64(True):
        report = verify_preset(
            "tiny-qwen2-moe", 2, 2, batch=2, seq=8, dtype=jnp.float64, cfg=cfg, controls=controls
        )
    assert report.ok and max(p.max_rel_err for p in report.params) <= 1e-12, format_report(report)
    assert all(c["detected"] for c in report.controls), report.controls
    (flips,) = [c for c in report.checks if c["name"] == "routing flips"]  # proof.routing
    assert flips["ok"] and flips["detail"].startswith("0 of 16 token-choices routed differently"), flips
    return {c["name"] for c in report.controls}


# The quick tier: the two faults of the layer's sharding, a sum over mp and one over the data shards
# missing (each other control recompiles the train step)
QUICK_MOE = (
    "MoE combine weights' gradient not summed over mp",
    "MoE aux-loss statistics not summed over the data shards",
)


def test_moe_proven_sharded_with_its_sharding_controls_detected():
    from meshlm.proof.moe_controls import MOE_CONTROLS

    assert _prove_moe(tuple(c for c in MOE_CONTROLS if c.name in QUICK_MOE)) == set(QUICK_MOE)


# slow: the same proof with every MoE control (the renormalisation, the tie, the shared expert's, the
# dispatch's): its cost is its scale; the layer's sharding bug class is caught quick by
# test_moe_proven_sharded_with_its_sharding_controls_detected
@pytest.mark.slow
def test_moe_proven_sharded_with_its_controls_detected():
    from meshlm.proof.moe_controls import MOE_CONTROLS

    # all but the capacity's (dropless here), the one of norm_topk_prob off (OLMoE), gmm's (its offsets),
    # the scatter-add combine's padding leak and the gathers' choice with no row here (no ep, no drops)
    assert len(_prove_moe(MOE_CONTROLS)) == len(MOE_CONTROLS) - 5


def test_capacity_drops_by_gshards_rule_on_the_whole_batch():
    """Every token's first choice before any second one, then the tokens in (row, position) order;
    each expert keeps its first ceil(C x N x k / E) choices (here 3 of 10 tokens x 2 choices)."""
    import collections

    from meshlm.parallel.context import Parallel

    cfg = CFG.replace(moe_capacity_factor=0.5)
    rng = np.random.default_rng(0)
    ids = np.stack([rng.permutation(cfg.n_experts)[:2] for _ in range(10)])  # [N, k]
    keep = np.asarray(moe.capacity_keep(cfg, Parallel(), jnp.asarray(ids.reshape(2, 5, 2), jnp.int32)))
    cap, seen, want = moe.capacity(cfg, 10), collections.Counter(), np.zeros(ids.shape, bool)
    for j in range(2):
        for n in range(10):
            want[n, j], seen[ids[n, j]] = seen[ids[n, j]] < cap, seen[ids[n, j]] + 1
    assert cap == 3 and (keep.reshape(10, 2) == want).all() and not want.all()
    # C read as written: 1.1 x 200 x 2 / 8 is 55 (the float product 55.00000000000001 would give 56)
    assert moe.capacity(CFG.replace(n_experts=8, moe_capacity_factor=1.1), 200) == 55


@pytest.mark.parametrize("factor", [1e8, 1e30, 1.7e308])
def test_a_huge_capacity_factor_keeps_every_choice_without_overflow(factor):
    """Issue 47: ceil(C x N x k / E) past int32 raised an OverflowError in ``capacity_keep`` (any C above
    ~8,600 on a real batch). The capacity is at most N (an expert is among a token's k choices at most
    once), so a factor >= E / k keeps every choice, exactly as a dropless layer computes."""
    from meshlm.parallel.context import Parallel

    cfg = CFG.replace(moe_capacity_factor=factor)
    ids = jnp.asarray(np.stack([np.random.default_rng(n).permutation(cfg.n_experts)[:2] for n in range(10)]))
    keep = jax.jit(lambda i: moe.capacity_keep(cfg, Parallel(), i))(ids.reshape(2, 5, 2).astype(jnp.int32))
    assert moe.capacity(cfg, 10) == 10 and np.asarray(keep).all()
    at_bound = CFG.replace(moe_capacity_factor=cfg.n_experts / cfg.experts_per_token)
    assert moe.capacity(at_bound, 10) == 10  # C = E / k: every choice kept


def test_the_per_shard_capacity_control_is_not_run_where_nothing_can_drop():
    """From C = E / k on, a shard's own capacity keeps all its tokens as the batch's does: ranking per
    shard changes nothing, so `verify --moe-capacity-factor 1e30` would fail a correct model with the
    control "not detected"; below it the control runs."""
    from meshlm.proof import model_problem
    from meshlm.proof.moe_controls import MOE_CONTROLS
    from meshlm.proof.prover import control_set, where_of

    name = "MoE capacity computed per shard"
    for factor, runs in ((0.5, True), (1.99, True), (2.0, False), (1e30, False)):
        cfg = CFG.replace(moe_capacity_factor=factor)  # E / k = 4 / 2
        problem = model_problem(cfg, "tiny-mixtral", 1, 2, 8, dp=2)
        names = {c.name for c in control_set(where_of(problem, Layout(dp=2), False), MOE_CONTROLS)}
        assert (name in names) == runs, factor


@pytest.mark.slow
def test_capacity_proven_under_sp_with_its_control_detected():
    """tiny-mixtral with tokens dropped on 2x2 + FSDP + SP in float64: equal to the unsharded model, and
    the capacity computed per shard (each shard ranking its own tokens) detected."""
    from meshlm.proof import format_report, model_problem, verify
    from meshlm.proof.moe_controls import MOE_CONTROLS

    cfg = CFG.replace(moe_capacity_factor=0.5)
    control = [c for c in MOE_CONTROLS if c.name == "MoE capacity computed per shard"]
    layout = Layout(dp=2, mp=2, fsdp=True, sp=True)
    with jax.enable_x64(True):
        problem = model_problem(cfg, "tiny-mixtral", 2, 2, 8, dp=2, fsdp=True, sp=True)
        report = verify(problem, layout, dtype=jnp.float64, controls=tuple(control), collectives=False)
    assert report.ok and max(p.max_rel_err for p in report.params) <= 1e-12, format_report(report)
    assert len(report.controls) == 1 and report.controls[0]["detected"], format_report(report)


def test_routing_metrics_of_the_statistics():
    from meshlm.train.routing import routing_row

    stats, _ = _stats(CFG, 2)  # 12 tokens, k = 2, dropless
    row = routing_row(CFG.replace(moe_aux_loss="per-layer"), stats)
    assert sum(row["expert_load"]) == 12 * CFG.experts_per_token and row["moe_dropped"] == 0
    load = np.asarray(row["expert_load"])
    assert row["expert_load_cv"] == pytest.approx(load.std() / load.mean())
    assert row["expert_load_min"] == load.min() and "moe_aux_loss_per_layer" in row


def test_accumulation_sums_the_aux_and_keeps_loss_and_grads():
    from meshlm.train.optim import accumulate

    def grad_fn(params, batch):
        loss = jnp.sum(params["w"] * batch)
        return (loss, jnp.sum(batch)[None]), {"w": batch}

    params, batch = {"w": jnp.ones(3)}, jnp.arange(6.0).reshape(2, 3)
    (loss, aux), grads = accumulate(grad_fn, params, batch, 2)
    assert float(loss) == 7.5 and float(aux[0]) == 15.0 and grads["w"].tolist() == [1.5, 2.5, 3.5]


def test_train_moe_settings_reach_the_model_and_must_match_on_resume():
    from meshlm.train.config import TrainConfig, resume_must_match, with_moe_settings

    tcfg = TrainConfig(config="tiny-mixtral", moe_aux_loss="per-layer", moe_capacity_factor=1.25)
    cfg = with_moe_settings(tcfg, CFG)
    assert cfg.moe_aux_loss == "per-layer" and cfg.moe_capacity_factor == 1.25
    assert with_moe_settings(TrainConfig(), CFG) == CFG  # not given: the model's own
    assert {"moe_aux_loss", "moe_capacity_factor"} <= set(resume_must_match())
    with pytest.raises(ConfigError, match="moe_capacity_factor"):
        TrainConfig(moe_capacity_factor=-1.0)
    with pytest.raises(ConfigError, match="--moe-capacity-factor"):
        with_moe_settings(TrainConfig(moe_capacity_factor=1.0), get_config("tiny-llama"))


def test_train_step_returns_the_routing_statistics():
    """The sharded train step of tiny-mixtral (2 data shards, 2 micro-batches, tokens dropped) returns
    the step's routing statistics summed over the global batch and both micro-batches (the loss is
    ``loss_fn``'s own, its statistics under stop_gradient: nothing else changes)."""
    from meshlm.train.optim import OptimConfig
    from meshlm.train.step import init_model, sharded_step

    cfg, layout = CFG.replace(moe_capacity_factor=0.5, n_layers=1), Layout(dp=2)
    params, specs = init_model(cfg, layout, 0)
    rng = np.random.default_rng(0)
    batch = {k: jnp.asarray(rng.integers(0, 64, (2, 2, 8)), jnp.int32) for k in ("inputs", "targets")}
    step, opt = sharded_step(cfg, OptimConfig(accum_steps=2), layout, specs, params)
    _, _, metrics = step(params, opt.init(params), batch)
    stats = metrics["routing"]  # [L, 2E + 3]
    assert bool(metrics["ok"]) and float(moe.split_stats(cfg, stats)[3][0]) == 2 * 2 * 8  # every token
    assert float(jnp.sum(moe.split_stats(cfg, stats)[0])) == 2 * 2 * 8 * cfg.experts_per_token
    assert float(moe.dropped_choices(cfg, stats)[0]) > 0


# slow: the routing statistics through the pipeline and capacity under SP (their cost); the statistics of a
# step: test_train_step_returns_the_routing_statistics, the drop rule:
# test_capacity_drops_by_gshards_rule_on_the_whole_batch, both quick
@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "coef"), [("1f1b", None), ("gpipe", 0.0)])
def test_pipelined_train_step_returns_the_routing_statistics(schedule, coef):
    """Issue 47: under --pp an MoE run's metrics.jsonl rows had no expert_load / moe_dropped /
    moe_aux_loss_*: the step returned no statistics. The pipeline's (summed over micro-batches, stages
    and data shards by the engine) equal the sharded step's on the same batch, under 1F1B with the
    preset's losses and under GPipe with none (the statistics then computed for the metrics alone)."""
    from meshlm.train.optim import OptimConfig
    from meshlm.train.step import init_model, sharded_step

    cfg = CFG if coef is None else CFG.replace(router_aux_loss_coef=coef, router_z_loss_coef=coef)
    rng = np.random.default_rng(0)
    batch = {k: jnp.asarray(rng.integers(0, 64, (4, 8)), jnp.int32) for k in ("inputs", "targets")}
    got = {}
    for name, layout in [
        ("pp", Layout(dp=2, pp=2, microbatches=2, pp_schedule=schedule)),
        ("sharded", Layout(dp=2)),
    ]:
        params, specs = init_model(cfg, layout, 0)
        step, opt = sharded_step(cfg, OptimConfig(), layout, specs, params)
        got[name] = np.asarray(step(params, opt.init(params), batch)[2]["routing"], np.float64)
    counts, probs, z, tokens = moe.split_stats(cfg, got["pp"])
    assert got["pp"].shape == (cfg.n_layers, 2 * cfg.n_experts + 3) and (tokens == 4 * 8).all()
    assert (counts.sum(axis=1) == 4 * 8 * cfg.experts_per_token).all()
    np.testing.assert_allclose(got["pp"], got["sharded"], rtol=1e-5, atol=1e-5)


def test_tie_control_only_where_the_proof_planted_the_tie():
    """The proof's own parameters carry the router tie, so its tie-breaking control applies; a
    checkpoint's parameters (``load_params``) do not, so there the control has nothing to detect and is
    not run (it failed every MoE ``verify --checkpoint`` as "NOT DETECTED")."""
    from dataclasses import replace

    from meshlm.proof import model_problem
    from meshlm.proof.moe_controls import MOE_CONTROLS
    from meshlm.proof.prover import control_set, where_of

    problem = model_problem(CFG, "tiny-mixtral", 1, 2, 8, dp=2)
    tie = "MoE top-k ties broken by the higher expert id"
    names = lambda p: {c.name for c in control_set(where_of(p, Layout(dp=2), False), MOE_CONTROLS)}
    assert tie in names(problem)
    assert tie not in names(replace(problem, load_params=lambda layout: None))
    # its twin over ep (``proof.ep_controls``) alike: it lacked the condition (issue 47)
    from meshlm.proof.ep_controls import EP_CONTROLS

    problem, ep = model_problem(CFG, "tiny-mixtral", 1, 2, 8, dp=2, ep=2), Layout(dp=2, ep=2)
    ties = lambda p: {c.name for c in control_set(where_of(p, ep, False), EP_CONTROLS) if "ties" in c.name}
    assert ties(problem) == {"top-k ties broken by shard-local index"}
    assert ties(replace(problem, load_params=lambda layout: None)) == set()


def test_the_rows_control_moves_rows_where_they_are_one_block():
    """ragged_dot's rows are exactly the choices (16 on the proof's 2x2 shard): a roll by one block
    (``BLOCK``, 16) moved none there and its control went undetected; it moves them on any length."""
    from meshlm.parallel.grouped import BLOCK
    from meshlm.proof.moe_controls import RowsToWrongExpert

    for r in (8, BLOCK, 2 * BLOCK, 20):
        rows = jnp.arange(r)
        moved = RowsToWrongExpert().moe_rows(rows)
        assert sorted(moved.tolist()) == rows.tolist() and bool((moved != rows).all()), r
    assert RowsToWrongExpert().moe_rows(jnp.arange(64))[BLOCK] == 0  # the block scan's: one block
