"""Context parallelism (``--cp``): the cp-sharded loss and every gradient equal the unsharded model's in
float64 for both strategies, each planted cp fault is caught by that comparison, training resumes
bit-for-bit under --cp and its checkpoints restore onto another cp, and bad combinations are one-line
errors. (``meshlm verify --cp`` itself, with the communication check: docs/proof.md.)"""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_cli, tiny_lm_config, train_rows, write_corpus

from meshlm.errors import ConfigError, ShardingError
from meshlm.model.config import get_config
from meshlm.model.transformer import local_logits, loss_fn
from meshlm.parallel.context import Parallel
from meshlm.parallel.cp import chunk_positions, local_chunks, shard_order
from meshlm.parallel.layout import Layout
from meshlm.proof import cp_controls
from meshlm.sharding.rules import model_specs
from meshlm.sharding.spmd import reference_value_and_grad, sharded_value_and_grad

TOL = 1e-12


def test_each_shard_holds_chunks_i_and_its_mirror():
    x = jnp.arange(16)[None]  # T = 16, cp = 4: chunks of 2
    got = [np.asarray(local_chunks(x, i, 4))[0].tolist() for i in range(4)]
    assert got == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert [np.asarray(chunk_positions(i, 4, 4)).tolist() for i in range(4)] == got
    assert shard_order(4) == [0, 7, 1, 6, 2, 5, 3, 4]


@pytest.fixture(scope="module")
def problem():
    """tiny-gqa (8 query heads on 2 KV heads: with mp = 2 one KV head per shard; one layer) in float64,
    2 x 16 tokens, its parameters and the reference's loss and gradients."""
    cfg = get_config("tiny-gqa").replace(vocab_multiple=1, attn_block=4, n_layers=1)
    with jax.enable_x64(True):
        r = np.random.default_rng(0)
        batch = {k: jnp.asarray(r.integers(0, 64, (2, 16)), jnp.int32) for k in ("inputs", "targets")}
        params = jax.jit(hk.transform(loss_fn(cfg, Parallel())).init)(jax.random.PRNGKey(0), batch)
        params = jax.tree.map(lambda p: p.astype(jnp.float64), params)
        want = jax.jit(reference_value_and_grad(lambda par: loss_fn(cfg, par)))(params, batch)
    return cfg, batch, params, want


def worst_error(problem, layout, par_cls=Parallel, attention="blockwise"):
    cfg, batch, params, want = problem
    cfg = cfg.replace(attention=attention)
    with jax.enable_x64(True):
        specs = model_specs(cfg, params, layout)
        fn = sharded_value_and_grad(lambda par: loss_fn(cfg, par), layout, specs, par_cls)
        got = jax.jit(fn)(params, batch)
        err = lambda a, b: float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
        return max(jax.tree.leaves(jax.tree.map(err, got, want)))


LAYOUTS = {
    "ring cp4 (plain attention elsewhere: the ring runs the blockwise pieces)": (
        Layout(cp=4, cp_strategy="ring"),
        "plain",
    ),
    # --sp splits each cp shard's two chunks further over mp between blocks: positions and chunk order
    # must survive the all-gather before attention; --fsdp's weights are gathered over dp inside.
    "allgather cp2 x dp2 x mp2, fsdp + sp, blockwise": (
        Layout(dp=2, mp=2, cp=2, cp_strategy="allgather", fsdp=True, sp=True),
        "blockwise",
    ),
    "ring cp2 x dp2 x mp2, fsdp + sp": (Layout(dp=2, mp=2, cp=2, fsdp=True, sp=True), "plain"),
}


@pytest.mark.parametrize("case", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_loss_and_every_gradient_equal_the_unsharded_model(problem, case):
    layout, attention = case
    assert worst_error(problem, layout, attention=attention) <= TOL


FAULTS = {
    "rotary positions restart in every chunk": cp_controls.RotaryRestartsPerChunk,
    "a future chunk is visible": cp_controls.FutureChunkVisible,
    "the ring stops one step short": cp_controls.RingOneStepShort,
    "chunk order undone on the way out": cp_controls.ChunkOrderUndone,
}


@pytest.mark.parametrize("fault", FAULTS.values(), ids=FAULTS.keys())
def test_planted_cp_faults_are_detected(problem, fault):
    assert worst_error(problem, Layout(cp=2, cp_strategy="ring"), fault) > 1e-3


def test_communication_under_cp_with_fsdp_is_within_the_minimum():
    """With --fsdp the DP-split gradients are summed over cp alone after their reduce-scatter (other
    replica groups than the norms' sum over dp x cp), and the clip's partial sums may travel per leaf
    and axis: the compiled step's all-reduces stay within the minimum stated for it."""
    from meshlm.proof import model_problem
    from meshlm.proof.communication import step_collectives
    from meshlm.proof.control_runs import communication_rows
    from meshlm.proof.runs import Runs

    cfg = get_config("tiny-gqa").replace(vocab_multiple=1, n_layers=1)
    layout = Layout(dp=2, mp=2, cp=2, fsdp=True)
    problem = model_problem(cfg, "tiny-gqa", 2, 4, 16, dp=2, fsdp=True)
    runs = Runs(problem, layout, jnp.float32, 0)
    rows = communication_rows(
        runs, step_collectives(problem.build_loss, layout, runs.specs, runs.params, runs.batch)
    )
    assert all(r["ok"] for r in rows), rows


def test_bad_combinations_are_one_line_errors():
    with pytest.raises(ShardingError, match=r"--cp 4 splits the sequence into 2 x cp = 8 .* --seq-len 40"):
        Layout(cp=4).check_seq_len(36)
    with pytest.raises(ShardingError, match=r"--sp splits the sequence over cp x mp = 8.* --seq-len 16"):
        Layout(mp=4, sp=True, cp=2).check_seq_len(12)
    with pytest.raises(ConfigError, match="--cp-strategy 'star' is not one of ring, allgather"):
        Layout(cp=2, cp_strategy="star")
    cfg = get_config("tiny-llama").replace(doc_mask=0)
    forward = hk.transform(lambda tokens: local_logits(cfg, Parallel(Layout(cp=2), sharded=True), tokens))
    with pytest.raises(ConfigError, match="--cp does not support --doc-mask"):
        forward.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))


CLI_ERRORS = {
    "verify": ("verify --config tiny-llama --mesh 1x1 --cp 4 --seq-len 36", "--seq-len 36 is not divisible"),
    "train": ("train --config tiny-llama --mesh 1x4 --cp 2 --sp --seq-len 20", "over cp x mp = 8"),
    "plan": ("plan --config tiny-llama --mesh 1x1 --cp 4 --seq-len 20", "--seq-len 20 is not divisible by 8"),
}


@pytest.mark.parametrize("case", CLI_ERRORS.values(), ids=CLI_ERRORS.keys())
def test_cli_refuses_a_sequence_cp_cannot_split_in_one_line(case, monkeypatch, capsys):
    argv, message = case
    monkeypatch.setattr("meshlm.cli.common._setup", lambda *a, **k: pytest.fail("refused before devices"))
    assert run_cli(*argv.split()) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


# slow: a training run under cp, its resume and a restore (its cost); the exact resume: tests/test_resume.py's
# quick cell; cp's values: the quick proofs above
@pytest.mark.slow
def test_train_under_cp_resumes_bitwise_and_restores_onto_another_cp(corpus, tmp_path):
    """tiny-lm with blockwise attention (blocks of 8) under --cp 2 (ring): 4 steps in one go, and 2 steps
    then a resume to 4, log the same losses bit for bit; the checkpoint then restores onto cp = 1."""
    from meshlm.parallel.mesh import make_mesh
    from meshlm.train.loop import train
    from meshlm.train.run import build_run

    tcfg = lambda out, steps, cp: tiny_lm_config(
        corpus, out, steps=steps, cp=cp, attention="blockwise", attn_block=8, save_every=2
    )
    train(tcfg(tmp_path / "ref", 4, 2), make_mesh(1, 1))
    train(tcfg(tmp_path / "cut", 2, 2), make_mesh(1, 1))
    train(tcfg(tmp_path / "cut", 4, 2), make_mesh(1, 1))  # resumes at step 2
    losses = lambda out: [(r["step"], r["loss"]) for r in train_rows(out)]
    assert [s for s, _ in losses(tmp_path / "cut")] == [1, 2, 3, 4]
    assert losses(tmp_path / "cut") == losses(tmp_path / "ref")  # bitwise
    other = build_run(tcfg(tmp_path / "cut", 4, 1), make_mesh(1, 2))  # the checkpoint onto cp = 1
    assert other.step == 4 and other.layout.cp == 1
    other.release()


def test_a_ring_turning_the_wrong_way_is_detected_on_three_shards(problem):
    """Issue 36: on cp = 2 a reversed ring is the same permutation (nothing can detect it there); the
    control *the ring turns the wrong way* applies from cp = 3 and moves the result."""
    from meshlm.proof.control_record import Where

    cfg, batch, params, want = problem
    b6 = {k: jnp.concatenate([v, v[:, :8]], axis=1) for k, v in batch.items()}  # 24 tokens: 6 chunks
    with jax.enable_x64(True):
        want6 = jax.jit(reference_value_and_grad(lambda par: loss_fn(cfg, par)))(params, b6)
    ring = [c for c in cp_controls.CP_CONTROLS if c.name == "the ring turns the wrong way"][0]
    where = dict(cfg=cfg, has_row_bias=False)
    assert not ring.applies(Where(**where, layout=Layout(cp=2))) and ring.applies(
        Where(**where, layout=Layout(cp=3))
    )
    assert worst_error((cfg, b6, params, want6), Layout(cp=3), ring.par_cls) > 1e-3
