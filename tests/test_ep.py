"""The dispatches (``parallel.grouped``'s sorted ones, ``parallel.ep``'s gathered one under ep) equal
the all-local reference (every expert on every token), value and gradients, in float64, on random
routing and on routing that sends every token to one shard's experts, dropless and with dropped
choices in capacity slots. (``meshlm verify`` proves the whole model: docs/parallelism.md.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from meshlm.errors import ConfigError
from meshlm.model.moe import Experts
from meshlm.parallel.axes import EP
from meshlm.parallel.context import Parallel
from meshlm.parallel.experts import ExpertParallel
from meshlm.parallel.layout import Layout

E, K, N, D, H = 8, 2, 6, 3, 5  # experts, choices per token, tokens per batch shard, width, hidden


def routing(rng, n, one_shard: bool, cap: int):
    """[n, K] distinct global expert ids per token; with ``one_shard`` all among experts 0 and 1; with a
    capacity ``cap`` each expert's choices after its first ``cap`` (in token order) dropped (-1:
    ``model.moe``'s capacity on the whole batch; the buffers are [E, cap, D])."""
    pool = 2 if one_shard else E
    ids = np.stack([rng.choice(pool, K, replace=False) for _ in range(n)]).astype(np.int32)
    if cap:
        flat = ids.reshape(-1)
        seen = [np.sum(flat[:i] == e) for i, e in enumerate(flat)]
        ids = np.where(np.asarray(seen) < cap, flat, -1).reshape(ids.shape).astype(np.int32)
    return ids


def local(x, ids, cw, weights):
    """The all-local reference (``ExpertParallel.dense_experts``: every expert on every token)."""
    return ExpertParallel().experts(x, ids, cw, Experts(*weights[:3], "dense", 0, *weights[3:]))


CASES = [  # (dispatch, ep, dp, one_shard, capacity, expert biases): ep 1 is the all-local sorted dispatch
    ("blocks", 1, 4, False, 0, False),
    ("blocks", 1, 4, False, 0, True),
    ("ragged_dot", 1, 4, True, 3, True),
    ("dense", 2, 4, False, 0, False),
    ("blocks", 2, 4, False, 0, False),
    ("blocks", 4, 4, True, 0, True),
    ("ragged_dot", 2, 4, False, 0, False),
    ("gmm", 1, 4, False, 0, False),  # float64: the kernel's reference path (tests/test_gmm.py: the kernel)
    ("gmm", 2, 4, True, 0, True),  # one ep shard's experts take every row: the other's groups all empty
    ("ragged_dot", 2, 4, False, 0, True),
    ("blocks", 2, 4, False, 5, True),
]


@pytest.mark.parametrize("dispatch,ep,dp,one_shard,cap,biased", CASES)
def test_dispatch_equals_all_local(dispatch, ep, dp, one_shard, cap, biased):
    """With ``biased`` gpt-oss's gate and up biases [E, H] too: each row's expert's added in the grouped
    matmuls, their gradients summed per expert (the padding rows' weight 0 adds none)."""
    layout = Layout(dp=dp, ep=ep) if ep > 1 else Layout(dp=dp)
    par = Parallel.on(layout)
    rng = np.random.default_rng(ep + 10 * one_shard + cap)
    with jax.enable_x64(True):
        x = jnp.asarray(rng.normal(size=(dp * N, D)))
        ids = jnp.asarray(routing(rng, dp * N, one_shard, cap))
        cw = jnp.asarray(rng.uniform(size=(dp * N, K)))
        shapes = ((E, D, H), (E, D, H), (E, H, D)) + (((E, H), (E, H)) if biased else ())
        weights = [jnp.asarray(rng.normal(size=s)) for s in shapes]
        cot = jnp.asarray(rng.normal(size=(dp * N, D)))

        def body(x, ids, cw, *weights):
            out = par.experts(x, ids, cw, Experts(*weights[:3], dispatch, cap, *weights[3:]))
            assert par.local_experts(E) == weights[0].shape[0] == E // ep
            return out

        rows, experts = P(layout.rows), P(EP) if ep > 1 else P()
        specs = (rows, rows, rows) + (experts,) * len(weights)
        sharded = jax.shard_map(body, mesh=layout.mesh, in_specs=specs, out_specs=rows)
        loss = lambda f: lambda x, cw, *w: jnp.sum(f(x, ids, cw, *w) * cot)
        argnums = tuple(range(2 + len(weights)))
        got = jax.jit(jax.value_and_grad(loss(sharded), argnums=argnums))(x, cw, *weights)
        want = jax.value_and_grad(lambda x, cw, *w: jnp.sum(local(x, ids, cw, w) * cot), argnums=argnums)(
            x, cw, *weights
        )
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert float(jnp.max(jnp.abs(a - b))) <= 1e-12 * max(1.0, float(jnp.max(jnp.abs(b))))


def test_ep_layout_errors():
    with pytest.raises(ConfigError, match="must divide dp"):
        Layout(dp=3, ep=2)
    assert Layout(dp=2, ep=2, pp=2).mesh_shape == {"pp": 2, "dp": 1, "ep": 2, "mp": 1}  # ep under pp
    layout = Layout(dp=4, mp=2, ep=2, fsdp=True)
    assert layout.label() == "4x2 + EP2 + FSDP"
    assert layout.mesh_shape == {"dp": 2, "ep": 2, "mp": 2} and layout.devices == 8
    assert Layout.from_dict(layout.to_dict()) == layout
    assert Layout.of(layout.mesh, fsdp=True) == layout


def test_ep_refused_without_experts():
    import haiku as hk

    from meshlm.model.config import get_config
    from meshlm.model.transformer import loss_fn
    from meshlm.sharding.rules import model_specs

    cfg = get_config("tiny")
    batch = {k: jnp.zeros((2, 8), jnp.int32) for k in ("inputs", "targets")}
    abstract = jax.eval_shape(hk.transform(loss_fn(cfg, Parallel())).init, jax.random.PRNGKey(0), batch)
    with pytest.raises(ConfigError, match="has none"):
        model_specs(cfg, abstract, Layout(dp=2, ep=2))


def _reference(cfg):
    """``cfg`` in float64 on 4 x 8 tokens: (cfg, batch, parameters, the one-device model's loss and
    gradients with the "dense" dispatch, every expert on every token: the proof's reference)."""
    import haiku as hk

    from meshlm.model.transformer import loss_fn
    from meshlm.sharding.spmd import reference_value_and_grad

    with jax.enable_x64(True):
        r = np.random.default_rng(0)
        batch = {k: jnp.asarray(r.integers(0, 64, (4, 8)), jnp.int32) for k in ("inputs", "targets")}
        params = jax.jit(hk.transform(loss_fn(cfg, Parallel())).init)(jax.random.PRNGKey(0), batch)
        params = jax.tree.map(lambda p: p.astype(jnp.float64), params)
        dense = cfg.replace(moe_dispatch="dense")
        want = jax.jit(reference_value_and_grad(lambda par: loss_fn(dense, par)))(params, batch)
    return cfg, batch, params, want


@pytest.fixture(scope="module")
def mixtral():
    """tiny-mixtral with one layer (the aux and z losses on: their statistics are summed over ep too)."""
    from meshlm.model.config import get_config

    return _reference(get_config("tiny-mixtral").replace(n_layers=1, router_z_loss_coef=1e-3))


def _worst(mixtral, layout, par_cls=Parallel):
    """The worst relative error of the loss and every gradient on ``layout`` against the reference."""
    from meshlm.sharding.rules import model_specs
    from meshlm.sharding.strategy import strategy

    cfg, batch, params, want = mixtral
    with jax.enable_x64(True):
        specs = model_specs(cfg, params, layout)
        got = jax.jit(strategy(layout).value_and_grad(cfg, layout, specs, par_cls=par_cls))(params, batch)
        err = lambda a, b: float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
        return max(jax.tree.leaves(jax.tree.map(err, got, want)))


EP_FSDP_SP = Layout(dp=4, mp=2, ep=2, fsdp=True, sp=True)


def test_ep_with_fsdp_and_sp_equals_the_unsharded_model_and_its_faults_show(mixtral):
    """ep 2 of dp 4 (the mesh (2, 2, 2)), FSDP over the rest of dp, SP: loss and every gradient equal
    the one-device model's in float64; tokens sent to the neighbouring ep shard, and expert gradients
    kept from one data shard outside ep, each move them by far more."""
    from meshlm.proof.ep_controls import ExpertGradOneDataShard, TokensToNeighbour

    assert _worst(mixtral, EP_FSDP_SP) <= 1e-12
    assert _worst(mixtral, EP_FSDP_SP, TokensToNeighbour) > 1e-3
    assert _worst(mixtral, EP_FSDP_SP, ExpertGradOneDataShard) > 1e-3


# slow: the third fault on the same layout (its cost: its program compiled); ep's bug class (the tokens'
# dispatch, the experts' gradients) is caught quick by test_ep_with_fsdp_and_sp_equals_the_unsharded_...
@pytest.mark.slow
def test_ep_routing_statistics_not_summed_over_ep_show(mixtral):
    """Routing statistics not summed over ep move the loss and gradients (the aux losses' small share)."""
    from meshlm.proof.ep_controls import StatisticsNotSummedOverEp

    assert _worst(mixtral, EP_FSDP_SP, StatisticsNotSummedOverEp) > 1e-8


# slow: ep 4 and ep x cp, ep under pp: the ep proof on more layouts (their cost is their scale); ep with FSDP
# and SP and its faults: quick, above
@pytest.mark.slow
def test_ep4_and_ep_with_cp_equal_the_unsharded_model(mixtral):
    """The sorted dispatch (blocks, dropless) on ep 4 (one batch row and one expert per shard) and on
    ep 2 x cp 2 (each shard routes its two sequence chunks' tokens; the group gathers them): loss and
    every gradient equal the one-device model's in float64."""
    assert _worst(mixtral, Layout(dp=4, ep=4)) <= 1e-12
    assert _worst(mixtral, Layout(dp=2, ep=2, cp=2)) <= 1e-12


# slow: capacity through the sorted dispatch (its cost); the dispatches equal the all-local reference quick
# above (test_dispatch_equals_all_local), the capacity rule in tests/test_moe.py
@pytest.mark.slow
def test_ep_with_capacity_through_the_sorted_dispatch(monkeypatch):
    """Tokens dropped (C = 0.5 of E / k = 2) on ep 2 of dp 4: the kept choices in the [E/ep, capacity, D]
    slots equal the one-device model's (the capacity decided on the whole batch); the choices with no
    slot here (dropped, or another shard's experts) reading slot 0 move the result by far more. The same
    with the scatter-add combine (``MESHLM_MOE_COMBINE=scatter``), where the empty slots' rows leaking
    into the output is the fault that shows."""
    from meshlm.model.config import get_config
    from meshlm.proof.moe_controls import AbsentChoicesReadRowZero, PaddingRowsLeak

    problem = _reference(get_config("tiny-mixtral").replace(n_layers=1, moe_capacity_factor=0.5))
    layout = Layout(dp=4, ep=2)
    assert _worst(problem, layout) <= 1e-12
    assert _worst(problem, layout, AbsentChoicesReadRowZero) > 1e-3
    monkeypatch.setenv("MESHLM_MOE_COMBINE", "scatter")
    assert _worst(problem, layout) <= 1e-12
    assert _worst(problem, layout, PaddingRowsLeak) > 1e-3


@pytest.mark.slow
def test_ep_under_pp_equals_the_unsharded_model():
    """tiny-mixtral's 2 layers on pp 2 (one a stage) x ep 2, 1F1B on 2 micro-batches: the loss with its
    aux and z losses (the routing statistics summed over micro-batches, stages and ep before they are
    formed: ``parallel.pipeline_stats``; each chunk's backward seeded with their gradient from a
    statistics pass) and every gradient equal the one-device model's in float64. (GPipe, which
    differentiates its forward scan: ``meshlm verify --pp-schedule gpipe``, docs/proof.md.)"""
    import haiku as hk

    from meshlm.model.config import get_config
    from meshlm.model.transformer import loss_fn
    from meshlm.sharding.rules import model_specs
    from meshlm.sharding.spmd import reference_value_and_grad
    from meshlm.sharding.strategy import strategy

    cfg = get_config("tiny-mixtral")
    layout = Layout(dp=2, ep=2, pp=2, microbatches=2, pp_schedule="1f1b")
    with jax.enable_x64(True):
        r = np.random.default_rng(1)
        batch = {k: jnp.asarray(r.integers(0, 64, (4, 8)), jnp.int32) for k in ("inputs", "targets")}
        params = jax.jit(hk.transform(loss_fn(cfg, Parallel())).init)(jax.random.PRNGKey(0), batch)
        params = jax.tree.map(lambda p: p.astype(jnp.float64), params)
        dense = cfg.replace(moe_dispatch="dense")  # the reference: every expert on every token
        want = jax.jit(reference_value_and_grad(lambda par: loss_fn(dense, par)))(params, batch)
        specs = model_specs(cfg, params, layout)
        fn = strategy(layout).value_and_grad(cfg, layout, specs, fill=float("nan"))  # NaN in the bubbles
        got = jax.jit(fn)(params, batch)
        err = lambda a, b: float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
        assert max(jax.tree.leaves(jax.tree.map(err, got, want))) <= 1e-12


def test_fsdp_with_ep_splits_dense_weights_over_every_data_shard():
    """--fsdp with ep: a dense weight over (dp, ep), all the data shards, even where dp = ep (the mesh's
    dp axis of size 1 alone would split nothing); an expert weight (its experts over ep) over the data
    shards outside ep where there are any, else whole on its ep shard."""
    import haiku as hk

    from meshlm.model.config import get_config
    from meshlm.model.transformer import loss_fn
    from meshlm.sharding.rules import model_specs

    cfg = get_config("tiny-mixtral")
    batch = {k: jnp.zeros((4, 8), jnp.int32) for k in ("inputs", "targets")}
    abstract = jax.eval_shape(hk.transform(loss_fn(cfg, Parallel())).init, jax.random.PRNGKey(0), batch)
    dense = lambda s: (s["layers/attn"]["wq"], s["embed"]["embeddings"], s["layers/moe/router"]["w"])
    experts = lambda s: s["layers/moe/experts"]["w_gate"]
    both = model_specs(cfg, abstract, Layout(dp=2, ep=2, fsdp=True))
    every = ("dp", "ep")
    assert dense(both) == (P(None, every, "mp", None), P("mp", every), P(None, every, None))
    assert experts(both) == P(None, "ep", None, "mp")
    outside = model_specs(cfg, abstract, Layout(dp=4, mp=2, ep=2, fsdp=True))
    assert dense(outside)[0] == P(None, every, "mp", None)
    assert experts(outside) == P(None, "ep", "dp", "mp")
