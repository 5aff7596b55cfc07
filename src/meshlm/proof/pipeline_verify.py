"""``meshlm verify --pp``: the pipeline's planted faults as the proof's controls, and its communication.

Under ``--pp`` the sharded run is the model through the pipeline (``sharding.pipelined``) with NaN in
every bubble; the proof compares it with the unsharded model as always (loss, gradients, and with
``--steps`` parameters and AdamW state). The controls are the engine's faults
(``proof.pipeline_proof.CONTROLS``: activations to the wrong stage, a micro-batch's gradient dropped, the
loss not divided by M, chunks on the wrong virtual stage, a bubble's NaN let through), each an engine
with one hook broken, run on the real model and required to differ from the reference; their rows have
the other controls' columns (detected, how, margin in tolerances). The communication check counts the
``ppermute``s the step executes (each scan body's count times its length) against the schedule's
``schedule_facts(...).permutes_per_step``.
"""

from __future__ import annotations

import jax
import numpy as np

from meshlm.parallel.pipeline import Pipeline
from meshlm.parallel.pipeline_schedule import schedule_facts
from meshlm.proof.pipeline_proof import CONTROLS, applicable_controls
from meshlm.proof.report import LeafResult, check_row, compare_into, worst


def engine_sums_over_dp(layout) -> type[Pipeline]:
    """The data-parallel mean's fault under pp, where the engine (not ``Parallel.batch_mean``) takes it:
    the loss and gradients summed over the dp shards instead of averaged (the scale of each micro-batch
    times dp)."""

    class EngineSumsOverDp(Pipeline):
        def loss_scale(self):
            return layout.dp * super().loss_scale()

    return EngineSumsOverDp


def pipeline_controls(runs, rtol: float, atol: float) -> list[dict]:
    """One row per pipeline control that can show a difference on this schedule."""
    rows = []
    (lr, gr) = runs.reference_grads()
    for name in applicable_controls(runs.layout.pipeline):
        ls, gs = pipeline_control_fn(runs, name)(runs.params, runs.batch)
        results: dict[str, LeafResult] = {}
        compare_into(results, {"loss": {"value": ls}, **gs}, {"loss": {"value": lr}, **gr}, rtol, atol)
        rows.append(control_row(name, list(results.values())))
    return rows


def pipeline_control_fn(runs, name: str):
    """The sharded loss and gradients (jitted, not yet traced) through the engine with fault ``name``."""
    return runs.sharded_fn(runs.problem.build_loss, pipe_cls=CONTROLS[name])


def control_row(name: str, results: list[LeafResult]) -> dict:
    """A control's row, as ``control_runs.run_control`` words it."""
    bad = [r.path for r in results if not r.ok]
    margin = worst(*(r.tol_ratio for r in results))
    finite = bool(np.isfinite(margin))
    return {
        "name": f"pipeline: {name}",
        "detected": bool(bad),
        "how": f"{len(bad)} leaves differ, e.g. {bad[0]}" if bad else "no difference",
        "margin": margin if finite else None,
        "by": "values" if finite else "non-finite values",
    }


def count_permutes(jaxpr, times: int = 1) -> int:
    """``ppermute``s a program executes: each scan body's count times its length."""
    n = 0
    for eqn in jaxpr.eqns:
        n += times * (eqn.primitive.name == "ppermute")
        reps = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    n += count_permutes(inner, times * reps)
    return n


def permute_rows(runs, pipe_cls=None) -> list[dict]:
    """The communication check under pp: the step's ppermutes equal the schedule's."""
    fn = runs.value_and_grad(runs.problem.build_loss, pipe_cls=pipe_cls)
    got = count_permutes(jax.make_jaxpr(fn)(runs.params, runs.batch).jaxpr)
    cfg = runs.layout.pipeline
    want = schedule_facts(cfg).permutes_per_step
    detail = (
        f"{got} collective-permutes per step; the {cfg.schedule} schedule needs 2 (V M + pp - 1) = {want} "
        f"(pp={cfg.pp}, M={cfg.microbatches}, V={cfg.virtual_stages})"
    )
    return [check_row("pipeline communication", got == want, detail)]
