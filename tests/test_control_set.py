"""One control set: under ``--pp`` verify runs every control that applies to the model and options
without pp (SP, FSDP, tied head, q/k/v bias, ...) plus the pipeline's own, and each is detected."""

from collections import Counter

import jax
import jax.numpy as jnp
import pytest

from meshlm.model.config import get_config
from meshlm.parallel.layout import Layout
from meshlm.proof import model_problem
from meshlm.proof.pipeline_proof import applicable_controls
from meshlm.proof.prover import control_set, where_of

# tiny-qwen2 (q/k/v biases, tied head) with one layer per stage; FSDP over dp 2, SP over mp 2.
CFG = get_config("tiny-qwen2").replace(n_layers=2)
PP = Layout(dp=2, mp=2, fsdp=True, sp=True, pp=2, microbatches=4)
FLAT = Layout(dp=2, mp=2, fsdp=True, sp=True)


def _problem(layout: Layout, batch: int):
    return model_problem(CFG, "tiny-qwen2", 2, batch, 8, dp=2, fsdp=True, sp=True, pp=layout.pp)


def test_the_count_under_pp_is_the_count_without_plus_the_pipelines_own():
    names = lambda layout: Counter(c.name for c in control_set(where_of(_problem(layout, 8), layout, False)))
    flat, piped = names(FLAT), names(PP)
    assert piped == flat and len(flat) >= 12
    for family in ("q/k/v bias not sliced with its heads", "tied head reads another shard's vocab slice"):
        assert family in piped
    assert {"SP norm gradients not summed over mp", "FSDP all-gather in the wrong order"} <= set(piped)
    assert len(applicable_controls(PP.pipeline)) == 4  # no virtual stages: 4 of the pipeline's 5


# slow: the model's controls traced and run through the pipeline (its cost); the pipeline's own controls are
# quick in tests/test_pp_verify.py, and an inert control is named by
# (test_every_control.py::test_an_inert_control_is_skipped_with_its_reason)
@pytest.mark.slow
def test_the_controls_with_a_path_of_their_own_under_pp_are_detected():
    """float64, the tiniest shapes (8 rows of 8 tokens in 4 micro-batches), no training step: the three
    controls that needed their own way under pp, each detected by values: the data-parallel mean's
    fault in the engine, a config change through the pipeline's pieces (rotary), and the tied head's
    other slice (a permute there deadlocked under the head's cond). The whole set, pipeline's own
    included: ``meshlm verify --config tiny-qwen2 --mesh 2x2 --pp 2 --fsdp --sp`` (docs/proof.md)."""
    from meshlm.proof.control_runs import run_control
    from meshlm.proof.runs import Runs

    names = (
        "missing data-parallel mean",
        "wrong rotary convention",
        "tied head reads another shard's vocab slice",
    )
    problem = _problem(PP, 8)
    chosen = [c for c in control_set(where_of(problem, PP, False)) if c.name in names]
    assert [c.name for c in chosen] == list(names)
    with jax.enable_x64(True):
        runs = Runs(problem, PP, jnp.float64, 0)
        rows = [run_control(c, runs, None, 1e-12, 1e-15) for c in chosen]
    assert all(r["detected"] and r["by"] == "values" and r["margin"] > 1e6 for r in rows), rows
