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
from functools import partial

import jax
import numpy as np

from meshlm.errors import VerifierError
from meshlm.parallel.context import Parallel
from meshlm.perf.hlo import collectives_per_step
from meshlm.proof.adam_drift import AdamDrift
from meshlm.proof.ahead import Compiler, failure
from meshlm.proof.communication import collectives_step, communication_checks
from meshlm.proof.controls import Control
from meshlm.proof.report import LeafResult, compare_into, leaf_label, skipped_row, worst
from meshlm.proof.rule_errors import VMA_REJECTIONS, is_vma_rejection  # noqa: F401 - re-exported
from meshlm.proof.runs import Runs, default_optim, initial_state, put_batch, reference_grad_norm, step_batches

REJECTED = "rejected by the type system"  # how a control refused by JAX's varying-axis check is detected


def run_control(control: Control, runs: Runs, ocfg, rtol, atol, prepared=None) -> dict:
    """{"name", "detected", "how", "margin", "by"} for one planted fault run sharded against the
    reference. ``margin``: the worst leaf's error in tolerances (None where values do not decide:
    a type-check rejection, the communication check, or non-finite values; ``by`` says which).
    ``prepared``: its program as ``prepare_control`` left it compiling ahead (default: prepared now)."""
    try:
        prepared = prepared or prepare_control(control, runs, INLINE)
        if control.by_collectives:
            return _by_collectives(control, runs, prepared)
        if control.by_int8_block:
            return _by_int8_block(control, runs)
        results = _control_results(control, runs, ocfg, rtol, atol, prepared)
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


INLINE = Compiler(0)  # compiles where it is asked to: the sequential proof


def prepare_control(control: Control, runs: Runs, compiler: Compiler) -> tuple:
    """(the executable's future, the parameters it runs at) of the program ``run_control`` runs for
    ``control``: traced here (or taken from the trace the inertness check kept, ``Runs.traced``) and
    lowered under its plant, on the calling thread, then compiled on ``compiler``'s pool
    (``proof.ahead``). An exception on the way is kept in the future: the run raises it, as it would
    have raised it itself. (None, None) for a training step's or the int8 block's control: its run
    builds its programs."""
    if not compiles_ahead(control):
        return None, None
    try:
        if control.by_collectives:
            return compiler.submit(collectives_lowered(runs, control).compile), None
        fn, params = _planted_fn(control, runs)
        with _plant(control):
            traced, params = runs.traced.pop(control.name, None) or (fn.trace(params, runs.batch), params)
            lowered = traced.lower()
    except Exception as e:
        return failure(e), None
    return compiler.submit(lowered.compile), params


def compiles_ahead(control: Control) -> bool:
    """Whether ``prepare_control`` compiles ``control``'s program (its run builds its own: a training
    step's, needing the proof's optimizer config, or the int8 block's)."""
    return not (control.per_shard_clip or control.train_step or control.by_int8_block)


HONEST_STEP = "the communication check's step"  # ``Runs.traced``' key of its unplanted trace


def collectives_lowered(runs: Runs, control: Control | None = None):
    """The communication check's train step (``communication.collectives_step``) of the problem's loss,
    with ``control``'s fault (None: the honest step), lowered: from the trace the inertness check kept
    where there is one, its initial optimizer state made once per proof (``runs.initial_state``)."""
    kept = runs.traced.get(HONEST_STEP) if control is None else runs.traced.pop(control.name, None)
    if kept is not None:  # (the honest step's kept: the check and a skip's evidence both lower it)
        return kept[0].lower()
    p, par_cls = runs.problem, Parallel if control is None else control.par_cls
    step, state = collectives_step(
        p.build_loss, runs.layout, runs.specs, runs.params, par_cls, partial(initial_state, runs)
    )
    return step.lower(runs.params, state, runs.batch)


def honest_collectives(runs: Runs) -> dict:
    """``communication.step_collectives`` of the problem's own step: compiled once per proof (the check,
    and the controls' evidence against it)."""
    if not hasattr(runs, "_honest_collectives"):
        runs._honest_collectives = collectives_per_step(collectives_lowered(runs).compile().as_text())
    return runs._honest_collectives


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
    collectives -- at the same parameters, from the same program (the lowered modules' text: a plant
    that changes the program and no value, a no-op, is a control that fails, never a skip); else the
    first thing that differs (the control is live, or a no-op: the judgement was wrong either way).
    ``plain``: the runs whose own problem is the unplanted one (under pp a config change is made the
    problem's model: ``pipeline_verify._under_pp``), default ``runs``."""
    plain = plain or runs
    if control.by_collectives:
        planted = collectives_lowered(runs, control)
        if collectives_per_step(planted.compile().as_text()) != honest_collectives(runs):
            return "the step's compiled collectives"
        return _program_difference(planted, collectives_lowered(runs))
    if control.per_shard_clip or control.train_step:
        ocfg = ocfg or default_optim(1, reference_grad_norm(runs))
        batches = step_batches(runs.problem, 1, ocfg.accum_steps, 0)
        planted = next(runs.train(ocfg, batches, control.per_shard_clip, control.par_cls))[0][:2]
        unplanted = next(runs.train(ocfg, batches))[0][:2]
        programs = (_step_lowered(runs, ocfg, batches[0], c) for c in (control, None))
        return _first_difference(planted, unplanted) or _program_difference(*programs)
    (program, params, values), (plain_program, plain_values) = _thawed_runs(control, runs, plain)
    if changed := _first_difference(values, plain_values):
        return changed
    if jax.tree.structure(params) != jax.tree.structure(plain.params):
        return "the parameters' structure"
    changed = _first_difference(params, plain.params)
    return f"the parameters ({changed})" if changed else _program_difference(program, plain_program)


def _program_difference(planted, unplanted) -> str:
    """ "" where two lowered programs' modules read the same, else "its program"."""
    return "" if planted.as_text() == unplanted.as_text() else "its program (the lowered module)"


def _step_lowered(runs: Runs, ocfg, batch, control: Control | None):
    """The training step ``runs.train`` runs with ``control``'s fault (None: none), lowered."""
    clip, par_cls = (False, Parallel) if control is None else (control.per_shard_clip, control.par_cls)
    step, state = runs.train_step(ocfg, clip, par_cls)
    return step.lower(*state, put_batch(batch, runs.layout, ocfg.accum_steps > 1))


def _thawed_values(control: Control, runs: Runs, plain: Runs):
    """(planted, unplanted): the loss and every gradient of ``runs``' sharded program with ``control``
    planted and of ``plain``'s without it, every weight trainable (``lora.thawed``)."""
    planted, unplanted = _thawed_runs(control, runs, plain)
    return planted[2], unplanted[1]


def _thawed_runs(control: Control, runs: Runs, plain: Runs):
    """((lowered program, parameters, values) planted, (lowered program, values) unplanted) of
    ``_thawed_values``; the unplanted computed once per proof."""
    from meshlm.proof.lora import thawed

    with thawed():
        if not hasattr(plain, "_thawed"):
            lowered = plain.sharded_fn(plain.problem.build_loss).lower(plain.params, plain.batch)
            plain._thawed = lowered, lowered.compile()(plain.params, plain.batch)
        fn, params = _planted_fn(control, runs)
        with _plant(control):
            lowered = fn.lower(params, runs.batch)
            planted = lowered, params, lowered.compile()(params, runs.batch)
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


def _control_results(control: Control, runs: Runs, ocfg, rtol, atol, prepared) -> list[LeafResult]:
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
        compiled, params = prepared
        ls, gs = compiled.result()(params, runs.batch)
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
        step, state = collectives_step(
            problem.build_loss,
            runs.layout,
            runs.specs,
            runs.params,
            control.par_cls,
            partial(initial_state, runs),
        )
        traced = step.trace(runs.params, state, runs.batch)
        if fault or control.par_cls is Parallel:  # kept for its compile (``collectives_lowered``)
            runs.traced[control.name if fault else HONEST_STEP] = (traced, runs.params)
        return traced
    fn, params = _planted_fn(control, runs)
    with _plant(control):
        traced = fn.trace(params, runs.batch)
    if fault:  # the very program ``run_control`` runs: it lowers this trace (``Runs.run_traced``)
        runs.traced[control.name] = (traced, params)
    return traced


def _by_collectives(control: Control, runs: Runs, prepared) -> dict:
    got = collectives_per_step(prepared[0].result().as_text())
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
    honest = honest_collectives(runs)
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
