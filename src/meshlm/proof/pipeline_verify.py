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

import copy
import dataclasses

import jax
import numpy as np

from meshlm.model.moe import moe_losses
from meshlm.parallel.axes import CP, PP
from meshlm.parallel.context import Parallel
from meshlm.parallel.pipeline import Pipeline
from meshlm.parallel.pipeline_schedule import schedule_facts
from meshlm.parallel.pipeline_stats import stats_pass_permutes
from meshlm.proof.cp_controls import CP_CONTROLS
from meshlm.proof.pipeline_proof import CONTROLS
from meshlm.proof.report import LeafResult, check_row, compare_into, worst


def engine_sums_over_dp(layout) -> type[Pipeline]:
    """The data-parallel mean's fault under pp, where the engine (not ``Parallel.batch_mean``) takes it:
    the loss and gradients summed over the dp shards instead of averaged (the scale of each micro-batch
    times dp)."""

    class EngineSumsOverDp(Pipeline):
        def loss_scale(self):
            return layout.dp * super().loss_scale()

    return EngineSumsOverDp


def pipeline_controls(runs, rtol: float, atol: float, names: list[str]) -> list[dict]:
    """One row per pipeline control of ``names`` (those that can show a difference on this schedule:
    ``applicable_controls``)."""
    rows = []
    (lr, gr) = runs.reference_grads()
    for name in names:
        ls, gs = runs.run_traced(f"pipeline: {name}", pipeline_control_fn(runs, name), runs.params)
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


def count_permutes(jaxpr, times: int = 1, axis: str = PP) -> int:
    """``ppermute``s over ``axis`` a program executes: each scan body's count times its length (both
    branches of a ``cond`` counted: the pipeline's run every tick on every device, masked)."""
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "ppermute":
            names = eqn.params["axis_name"]
            n += times * (axis in (names if isinstance(names, tuple) else (names,)))
        reps = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    n += count_permutes(inner, times * reps, axis)
    return n


def permute_rows(runs, pipe_cls=None, par_cls=Parallel) -> list[dict]:
    """The communication check under pp: the step's ppermutes over pp equal the schedule's; with the
    cp ring also those over cp (``cp_ring_permutes``)."""
    fn = runs.value_and_grad(runs.problem.build_loss, par_cls=par_cls, pipe_cls=pipe_cls)
    jaxpr = jax.make_jaxpr(fn)(runs.params, runs.batch).jaxpr
    got = count_permutes(jaxpr)
    cfg, model = runs.layout.pipeline, runs.problem.cfg
    want = schedule_facts(cfg).permutes_per_step
    detail = (
        f"{got} collective-permutes per step; the {cfg.schedule} schedule needs 2 (V M + pp - 1) = {want} "
        f"(pp={cfg.pp}, M={cfg.microbatches}, V={cfg.virtual_stages})"
    )
    if model is not None and moe_losses(model) and stats_pass_permutes(cfg):
        want += stats_pass_permutes(cfg)
        detail += f", + V M + pp - 1 = {stats_pass_permutes(cfg)} of the routing statistics' pass = {want}"
    rows = [check_row("pipeline communication", got == want, detail)]
    if runs.layout.cp_ring and model is not None and model.arch.attention:
        got, want = count_permutes(jaxpr, axis=CP), cp_ring_permutes(model, runs.layout)
        detail = (
            f"{got} collective-permutes over cp per step; the ring needs (V M + pp - 1) ticks x "
            f"{model.n_layers // cfg.chunks} layers a chunk x (cp - 1 forward + 2 cp - 1 backward) = {want}"
        )
        rows.append(check_row("context-parallel ring communication", got == want, detail))
    return rows


def cp_ring_permutes(cfg, layout) -> int:
    """The ring's collective-permutes per pipelined step: every device runs its chunk in every tick
    (bubbles masked, not skipped), so each of the V M + pp - 1 forward ticks runs a chunk's ring
    forward, cp - 1 permutes a layer, and each backward tick its backward, 2 cp - 1 a layer (the K/V
    chunk around again, its gradient accumulator around and home), as without pp
    (``perf.memory_collectives``). A recomputed forward (remat) runs inside the backward's VJP, whose
    ring permutes the rebuilt backward counts again."""
    p = layout.pipeline
    ticks = p.virtual_stages * p.microbatches + p.pp - 1
    per_layer = (layout.cp - 1) * (2 if cfg.remat != "none" else 1) + 2 * layout.cp - 1
    return ticks * (cfg.n_layers // p.chunks) * per_layer


def permute_controls(controls, where, collectives: bool) -> list:
    """Under pp the communication check counts permutes (``permute_rows``), not all-reduces, so the
    controls a collectives count detects run only where a permute count sees them: context
    parallelism's (the ring's extra permute), with the check on."""
    if not collectives:
        return []
    where = dataclasses.replace(where, collectives=True)
    return [c for c in controls if c in CP_CONTROLS and c.by_collectives and c.applies(where)]


def _under_pp(control, runs):
    """(control, runs) as run under pp: a config change (the mask off) made the problem's model (the
    pipeline runs ``runs.problem.cfg``'s pieces, not a loss); the runs share the reference's results."""
    if control.cfg_change is None:
        return control, runs
    runs = copy.copy(runs)
    cfg = control.cfg_change(runs.problem.cfg)
    runs.problem = dataclasses.replace(runs.problem, cfg=cfg, build_loss=runs.problem.rebuild(cfg))
    return dataclasses.replace(control, cfg_change=None), runs


def trace_model_control(control, runs, trace_control):
    """Trace (no compile) the program ``run_model_control`` runs for ``control``."""
    if control.by_collectives:
        fn = runs.value_and_grad(runs.problem.build_loss, par_cls=control.par_cls)
        return jax.make_jaxpr(fn)(runs.params, runs.batch)
    return trace_control(*_under_pp(control, runs))


def run_model_control(control, runs, run_control, *args) -> dict:
    """``run_control`` of ``control`` under pp: a config change (the mask off) becomes the problem's
    model (the pipeline runs ``runs.problem.cfg``'s pieces, not a loss); the ring's extra permutes are
    detected by the cp ring's permute count."""
    if control.by_collectives:
        failed = [r for r in permute_rows(runs, par_cls=control.par_cls) if not r["ok"]]
        how = f"{failed[0]['name']}: {failed[0]['detail']}" if failed else "communication as the schedule's"
        row = {"name": control.name, "detected": bool(failed), "how": how}
        return {**row, "margin": None, "by": "communication"}
    return run_control(*_under_pp(control, runs), *args)
