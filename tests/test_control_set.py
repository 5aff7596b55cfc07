"""One control set: under ``--pp`` verify runs every control that applies to the model and options
without pp (SP, FSDP, tied head, q/k/v bias, ...) plus the pipeline's own, and each is detected."""

from collections import Counter

import jax
import jax.numpy as jnp

from meshlm.model.config import get_config
from meshlm.parallel.layout import Layout
from meshlm.proof import model_problem
from meshlm.proof.pipeline_proof import applicable_controls
from meshlm.proof.prover import control_set, verify, where_of

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


def test_every_control_under_pp_is_detected():
    """float64, the tiniest shapes (8 rows of 8 tokens over 4 micro-batches): each of the controls of
    the test above, and the pipeline's own, detected; the proof itself passes."""
    with jax.enable_x64(True):
        report = verify(_problem(PP, 8), PP, dtype=jnp.float64)
    assert report.ok, [c for c in report.controls if not c["detected"]]
    assert len(report.controls) == sum(names := Counter(c["name"] for c in report.controls).values())
    assert sum(n.startswith("pipeline: ") for n in names) == 4
