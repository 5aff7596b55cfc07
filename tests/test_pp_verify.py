"""``meshlm verify --pp`` as a library call: the model through the pipeline equals the unsharded model in
float64 (loss, gradients, and after a step parameters and AdamW state), the pipeline's planted faults are
each detected with a margin (or non-finite values), and the communication check counts the schedule's
collective-permutes. The stages run sequence parallelism over mp (activations [mb, T/mp, D] per shard
between the stages, the embedding's reduce-scatter on the first stage, the head's all-gather on the
last), and the model's embeddings are tied (tiny-llama3: the last stage's head projects onto the table
too, whose gradient is the first stage's plus the last stage's). (Meshes with dp and FSDP:
``test_pipeline_model``; the CLI acceptance runs are in docs/pipeline.md.)"""

import jax
import jax.numpy as jnp
import pytest

from meshlm.model.config import get_config
from meshlm.parallel.layout import Layout
from meshlm.proof import model_problem, verify
from meshlm.proof.pipeline_proof import applicable_controls


def _prove(faults=None):
    """The proof of tiny-llama3 on pp2x1x2 with SP (1F1B, M = 2): one step, the communication check, and the
    pipeline's own controls ``faults`` (None: every one that applies)."""
    layout = Layout(pp=2, mp=2, sp=True, microbatches=2, pp_schedule="1f1b")
    cfg = get_config("tiny-llama3")
    problem = model_problem(cfg, "tiny-llama3", 2, 4, 8, pp=2, sp=True)
    with jax.enable_x64(True):
        # the pipeline's own controls only (``controls=()``): the model's under pp are test_control_set's
        report = verify(
            problem, layout, steps=1, dtype=jnp.float64, collectives=True, controls=(), pipeline_faults=faults
        )
    assert report.ok and report.loss_ok
    assert max(p.max_rel_err for p in report.params) <= 1e-12
    assert report.extra["mesh"] == "pp2x1x2 + SP (1f1b, M=2)"
    assert all(c["detected"] and (c["margin"] is None or c["margin"] > 1e6) for c in report.controls)
    row = [c for c in report.checks if c["name"] == "pipeline communication"]
    assert row and row[0]["ok"] and row[0]["detail"].startswith("6 collective-permutes per step")
    return layout, {c["name"] for c in report.controls}


# The quick tier: the proof with the two faults of the schedule's own paths, the send to the next stage
# and the sum over micro-batches (each other control recompiles the pipeline's program, ~6 CPU-s; a
# bubble's NaN is held in every bubble of tests/test_pipeline.py's quick schedules, whose results must stay
# finite)
QUICK_FAULTS = ("activations sent to the wrong stage", "one micro-batch's gradient dropped")


def test_verify_pp_proves_the_pipeline_and_detects_its_send_and_microbatch_faults():
    _, names = _prove(QUICK_FAULTS)
    assert names == {f"pipeline: {n}" for n in QUICK_FAULTS}


# slow: the same proof with every fault that applies (the loss not divided by M, a bubble's NaN let
# through too): its cost is its scale; the pipeline's bug class (its send, its sum over micro-batches) is
# caught quick by test_verify_pp_proves_the_pipeline_and_detects_its_send_and_microbatch_faults
@pytest.mark.slow
def test_verify_pp_proves_the_pipeline_and_detects_its_faults():
    layout, names = _prove()
    assert names == {f"pipeline: {n}" for n in applicable_controls(layout.pipeline)} and len(names) == 4
