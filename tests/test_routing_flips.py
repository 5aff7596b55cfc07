"""Routing flips (``meshlm.proof.routing``): tokens whose top-k experts differ between the sharded and
the unsharded run are counted, reported, and fail the proof -- never absorbed by a tolerance."""

import jax
import jax.numpy as jnp
import pytest
from helpers import run_cli

from meshlm.model.config import get_config
from meshlm.parallel.cp import held_positions
from meshlm.parallel.layout import Layout
from meshlm.parallel.mesh import make_mesh
from meshlm.proof import model_problem
from meshlm.proof.moe_controls import ties_to_higher_id
from meshlm.proof.routing import count_flips, reference_routing, routing_row, sharded_routing
from meshlm.proof.runs import Runs


def test_a_tie_broken_otherwise_in_the_sharded_run_is_counted_and_fails():
    """The proof's planted router tie (experts 0 and 1 equal in every layer) broken by the higher id
    in the sharded run only: the tokens where the tie is for the k-th place flip, and are counted;
    the row fails in float64 always, in float32 unless allowed (which never loosens the tolerance)."""
    cfg = get_config("tiny-mixtral")
    problem = model_problem(cfg, "tiny-mixtral", 2, 2, 8)
    with jax.enable_x64(True):
        runs = Runs(problem, Layout.of(make_mesh(1, 2)), jnp.float64, 0)
        reference = reference_routing(runs, problem.reference_cfg)
        assert count_flips(sharded_routing(runs), reference)[0] == 0  # the same rule: identical
        with ties_to_higher_id():
            flips, total, margin = count_flips(sharded_routing(runs), reference)
    assert 0 < flips < total == cfg.n_layers * 2 * 8 and margin == 0.0  # the planted tie: margin 0
    for dtype, allow in (("float64", False), ("float64", True), ("float32", False)):
        row = routing_row(flips, total, margin, dtype, allow)
        assert not row["ok"] and f"{flips} of {total} token-choices routed differently" in row["detail"]
    allowed = routing_row(flips, total, margin, "float32", True)
    assert allowed["ok"] and f"{flips} of {total}" in allowed["detail"]
    assert "tolerance is unchanged" in allowed["detail"]


def test_cp_chunk_order():
    """cp shard i holds chunks i and 2cp-1-i of the 2cp chunks: the reference's tokens in that order."""
    assert held_positions(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert held_positions(4, 1).tolist() == [0, 1, 2, 3]
    assert held_positions(5, 1).tolist() == [0, 1, 2, 3, 4]  # without cp any length, in order


def test_allowance_refused_in_float64(capsys):
    assert run_cli("verify", "--config", "tiny-mixtral", "--x64", "--allow-routing-flips") == 2
    assert "(in float64 a flip is a bug)" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--allow-routing-flips"])
def test_allowance_is_a_verify_flag(flag, capsys):
    with pytest.raises(SystemExit):
        run_cli("verify", "--help")
    assert flag in capsys.readouterr().out
