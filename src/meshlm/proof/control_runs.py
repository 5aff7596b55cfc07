"""Running one planted fault, and deciding honestly whether it was detected.

A control is *detected* when some leaf differs from the reference beyond tolerance, when the
communication check fails (for faults that only waste communication), or when JAX's varying-axis
type check (``shard_map(check_vma=True)``) rejects the faulty program: that rejection is JAX proving
the program wrong. Any other exception is not a detection: it means the control or the verifier is
broken, and it is raised as ``VerifierError`` (exit code 3), never counted as a success.

Each value control also reports its *margin*: the worst leaf's error in units of its tolerance
(``LeafResult.tol_ratio``). A control detected at 2x tolerance would be a fault the proof barely
sees; the controls are designed to move the result by orders of magnitude on any model verify
accepts, and ``tests/test_controls_margin.py`` holds them to at least 100x in float32.
"""

from __future__ import annotations

from contextlib import nullcontext

import jax
import numpy as np

from meshlm.errors import VerifierError
from meshlm.proof.adam_drift import AdamDrift
from meshlm.proof.communication import collectives_step, communication_checks, step_collectives
from meshlm.proof.controls import Control
from meshlm.proof.report import LeafResult, compare_into, leaf_label, skipped_row, worst
from meshlm.proof.rule_errors import VMA_REJECTIONS, is_vma_rejection  # noqa: F401 - re-exported
from meshlm.proof.runs import Runs, default_optim, put_batch, reference_grad_norm, step_batches

REJECTED = "rejected by the type system"  # how a control refused by JAX's varying-axis check is detected


def run_control(control: Control, runs: Runs, ocfg, rtol, atol) -> dict:
    """{"name", "detected", "how", "margin", "by"} for one planted fault run sharded against the
    reference. ``margin``: the worst leaf's error in tolerances (None where values do not decide:
    a type-check rejection, the communication check, or non-finite values; ``by`` says which)."""
    try:
        if control.by_collectives:
            return _by_collectives(control, runs)
        if control.by_int8_block:
            return _by_int8_block(control, runs)
        results = _control_results(control, runs, ocfg, rtol, atol)
    except Exception as e:
        if not is_vma_rejection(e):
            raise crash_error(control.name, e) from e
        how = f"rejected by JAX's check_vma: {_first_line(e)}"
        return {"name": control.name, "detected": True, "how": how, "margin": None, "by": REJECTED}
    bad = [r.path for r in results if not r.ok]
    if not bad and (frozen := frozen_reach(control, runs, rtol, atol)):
        return skipped_row(control.name, f"{FROZEN_ONLY} ({', '.join(frozen)})")
    margin = worst(*(r.tol_ratio for r in results))
    how = f"{len(bad)} leaves differ, e.g. {bad[0]}" if bad else "no difference"
    finite = bool(np.isfinite(margin))
    return {
        "name": control.name,
        "detected": bool(bad),
        "how": how,
        "margin": margin if finite else None,
        "by": "values" if finite else "non-finite values",
    }


FROZEN_ONLY = (
    "its fault reaches only frozen weights' gradients, which nothing trained here reads: with every weight "
    "trainable it changes those and no loss or trained gradient"
)


def frozen_reach(control: Control, runs: Runs, rtol, atol) -> list[str]:
    """Where the model has frozen weights (LoRA's base): the frozen leaves whose gradient alone
    ``control`` changes once every weight is trainable (``lora.thawed``), the loss and the trained
    gradients unchanged -- a fault nothing the proof compares can show (at a fresh init's uniform q/k
    norm weights, the norm commutes with the rotary, and the order of the two shows in the weights'
    own gradient only). [] without frozen weights, for a training-step control, or where it changes
    the loss, a trained gradient or nothing at all (a no-op: not detected, a failure)."""
    cfg = runs.problem.cfg
    if cfg is None or not cfg.lora_rank or control.per_shard_clip or control.train_step:
        return []
    from meshlm.model.lora import is_adapter

    results: dict[str, LeafResult] = {}
    (ls, gs), (lr, gr) = _thawed_values(control, runs, runs)
    compare_into(results, {"loss": {"value": ls}, **gs}, {"loss": {"value": lr}, **gr}, rtol, atol)
    bad = [r.path for r in results.values() if not r.ok]
    return [] if not bad or any(p == "loss/value" or is_adapter(p) for p in bad) else bad


def unchanged_values(control: Control, runs: Runs, ocfg, plain: Runs | None = None) -> str:
    """The evidence for a control judged inert (``proof.inertness``), which a broken judgement cannot
    fake: "" where its planted sharded run gives, bitwise, the unplanted run's values -- the loss and every
    parameter's gradient with every weight trainable (``lora.thawed``: a fault reaching only a frozen
    weight's gradient counts too), a training step's parameters and state, or the step's compiled
    collectives; else the first thing that differs (the control is live: the judgement was wrong).
    ``plain``: the runs whose own problem is the unplanted one (under pp a config change is made the
    problem's model: ``pipeline_verify._under_pp``), default ``runs``."""
    plain = plain or runs
    if control.by_collectives:
        p = runs.problem
        honest = step_collectives(p.build_loss, runs.layout, runs.specs, runs.params, runs.batch)
        got = step_collectives(
            p.build_loss, runs.layout, runs.specs, runs.params, runs.batch, control.par_cls
        )
        return "" if honest == got else "the step's compiled collectives"
    if control.per_shard_clip or control.train_step:
        ocfg = ocfg or default_optim(1, reference_grad_norm(runs))
        batches = step_batches(runs.problem, 1, ocfg.accum_steps, 0)
        planted = next(runs.train(ocfg, batches, control.per_shard_clip, control.par_cls))[0][:2]
        plain = next(runs.train(ocfg, batches))[0][:2]
        return _first_difference(planted, plain)
    return _first_difference(*_thawed_values(control, runs, plain))


def _thawed_values(control: Control, runs: Runs, plain: Runs):
    """(planted, unplanted): the loss and every gradient of ``runs``' sharded program with ``control``
    planted and of ``plain``'s without it, every weight trainable (``lora.thawed``); the unplanted
    values computed once per proof."""
    from meshlm.proof.lora import thawed

    with thawed():
        if not hasattr(plain, "_thawed"):
            plain._thawed = plain.sharded_fn(plain.problem.build_loss)(plain.params, plain.batch)
        fn, params = _planted_fn(control, runs)
        with _plant(control):
            planted = fn(params, runs.batch)
    return planted, plain._thawed


def _first_difference(a, b) -> str:
    """ "" where trees ``a`` and ``b`` are bitwise equal (NaN equal to NaN), else the first leaf's path."""
    for (kp, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b), strict=True):
        if not np.array_equal(np.asarray(jax.device_get(x)), np.asarray(jax.device_get(y)), equal_nan=True):
            return leaf_label(kp) if len(kp) >= 2 else "the loss"
    return ""


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [""])[0]


def crash_error(name: str, e: BaseException) -> VerifierError:
    """The verifier error of control ``name`` crashing with ``e`` (not a detection)."""
    return VerifierError(
        f"control {name!r} crashed ({type(e).__name__}: {_first_line(e)}); "
        "a crash is not a detection: the control or the verifier is broken"
    )


def _control_results(control: Control, runs: Runs, ocfg, rtol, atol) -> list[LeafResult]:
    problem = runs.problem
    results: dict[str, LeafResult] = {}
    if control.per_shard_clip or control.train_step:
        ocfg = ocfg or default_optim(1, reference_grad_norm(runs), problem.opt_dtype)
        batches = step_batches(problem, 1, ocfg.accum_steps, 0)
        drift = AdamDrift(ocfg, leaf_label)  # as the proof's own steps (``prover``)
        for (ps, ss, _), (pr, sr, _) in runs.train(ocfg, batches, control.per_shard_clip, control.par_cls):
            compare_into(results, ps, pr, rtol, atol, drift.step(ss, sr))
            compare_into(results, ss, sr, rtol, atol)
    else:
        lr, gr = runs.reference_grads()  # outside the plant: the reference never runs the fault
        fn, params = _planted_fn(control, runs)
        with _plant(control):
            ls, gs = runs.run_traced(control.name, fn, params)
        compare_into(results, {"loss": {"value": ls}, **gs}, {"loss": {"value": lr}, **gr}, rtol, atol)
    return list(results.values())


def _plant(control: Control):
    return control.plant() if control.plant is not None else nullcontext()


def _planted_fn(control: Control, runs: Runs):
    """The control's sharded loss and gradients (jitted, not yet traced) and the parameters to run
    it at."""
    problem = runs.problem
    build, cfg = problem.build_loss, None
    if control.cfg_change is not None:
        cfg = control.cfg_change(problem.cfg)
        build = problem.rebuild(cfg)
    params = runs.params if control.params_change is None else control.params_change(problem.cfg, runs.params)
    pipe_cls = None if control.pipe_cls is None else control.pipe_cls(runs.layout)
    return runs.sharded_fn(build, control.par_cls, pipe_cls, cfg), params


def trace_control(control: Control, runs: Runs, ocfg=None, fault: bool = True):
    """Trace, without compiling or running, the sharded program ``run_control`` runs for ``control``
    (its plant in place): a control out of step with the code it plants into (a ``TypeError`` from a
    replaced function's signature) raises here, at the cost of a trace. JAX's varying-axis type check
    rejects a program at trace time too (``is_vma_rejection``: a detection, not a crash). ``fault``
    False: the clipping fault's training step with the right clip (``proof.inertness``' twin)."""
    problem = runs.problem
    if control.per_shard_clip or control.train_step:
        ocfg = ocfg or default_optim(1, 1.0, problem.opt_dtype)  # the clip norm's value: the same program
        step, state = runs.train_step(ocfg, fault and control.per_shard_clip, control.par_cls)
        batch = step_batches(problem, 1, ocfg.accum_steps, 0)[0]
        return step.trace(*state, put_batch(batch, runs.layout, ocfg.accum_steps > 1))
    if control.by_collectives:  # the train step whose compiled collectives ``_by_collectives`` counts
        step, opt_state = collectives_step(
            problem.build_loss, runs.layout, runs.specs, runs.params, control.par_cls
        )
        return step.trace(runs.params, opt_state, runs.batch)
    fn, params = _planted_fn(control, runs)
    with _plant(control):
        traced = fn.trace(params, runs.batch)
    if fault:  # the very program ``run_control`` runs: it lowers this trace (``Runs.run_traced``)
        runs.traced[control.name] = (traced, params)
    return traced


def _by_collectives(control: Control, runs: Runs) -> dict:
    got = step_collectives(
        runs.problem.build_loss, runs.layout, runs.specs, runs.params, runs.batch, control.par_cls
    )
    rows = communication_rows(runs, got)
    failed = [r for r in rows if not r["ok"]]
    if not failed and (more := _more_than_honest(runs, got)):
        return skipped_row(control.name, f"{LOOSE_BOUNDS} ({more})")
    how = f"{failed[0]['name']}: {failed[0]['detail']}" if failed else "communication within the minimum"
    return {"name": control.name, "detected": bool(failed), "how": how, "margin": None, "by": "communication"}


def _by_int8_block(control: Control, runs: Runs) -> dict:
    """The int8 block's bit-for-bit check (``proof.quant_exact``) with the control's fault planted."""
    from meshlm.proof.quant_exact import int8_experts, int8_rows

    dtype = jax.tree.leaves(runs.params)[0].dtype
    experts = int8_experts(runs.problem.cfg)
    rows = int8_rows(runs.layout, dtype, 0, control.par_cls, lambda: _plant(control), experts)
    failed = [r for r in rows if not r["ok"]]
    how = f"{failed[0]['name']}: {failed[0]['detail']}" if failed else "the int8 block unchanged"
    return {
        "name": control.name,
        "detected": bool(failed),
        "how": how,
        "margin": None,
        "by": "int8 exactness",
    }


LOOSE_BOUNDS = (
    "with frozen weights the communication check's bounds are full training's (every weight's gradient "
    "reduced), which this step undercuts: the fault's extra collectives stay within them"
)


def _more_than_honest(runs: Runs, got: dict) -> str:
    """Where the model has frozen weights (LoRA's base, no gradient reduced): the collectives by which a
    planted step ``got`` exceeds the honest step ("all-reduce 6 -> 14"), "" if none (a no-op: not
    detected, a failure). The check's bounds are full training's, so such a fault can stay within them."""
    cfg = runs.problem.cfg
    if cfg is None or not cfg.lora_rank:
        return ""
    p = runs.problem
    honest = step_collectives(p.build_loss, runs.layout, runs.specs, runs.params, runs.batch)
    more = [
        f"{kind} {honest[kind]['count']} -> {got[kind]['count']}"
        for kind in honest
        if isinstance(honest[kind], dict) and got[kind].get("count", 0) > honest[kind].get("count", 0)
    ]
    return ", ".join(more)


def communication_rows(runs: Runs, got: dict) -> list[dict]:
    """The communication check's rows for this run's model, mesh and batch."""
    p = runs.problem
    # Activations and the loss are computed at least in float32 (float64 in the x64 proof), in the
    # widest parameter's dtype (a LoRA base stored in bf16: its adapters')
    itemsize = max(4, *(x.dtype.itemsize for x in jax.tree.leaves(runs.params)))
    return communication_checks(
        p.cfg, runs.layout, got, batch_shape=p.batch["inputs"].shape, itemsize=itemsize, params=runs.params
    )
