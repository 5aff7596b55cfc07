"""No inert control: each control that claims to apply must change the program it plants into.

A control whose ``applies`` names a configuration its fault cannot reach (the plant replaces a function
that configuration never calls: a plain-softmax fault under the cp ring, which runs the blockwise
kernel) changes nothing, is "not detected", and fails a correct model's proof. So before any
run, ``verify`` traces (``jit(...).trace``: no compile, no execution) each chosen control's sharded
program, planted, beside the same kind of program unplanted, and requires them to differ: in the jaxpr's
text (its equations, collectives and shapes), in the constants and literals the text does not show, or
in the parameters the control runs at (``params_change``). An identical one cannot detect anything
here: it is skipped with that reason (``inert_skips``; a row of the report, not a failure of a correct
model's proof). That an ``applies`` names only configurations its plant reaches is a test's to hold
(``tests/test_every_control.py`` traces every control on every configuration verify accepts).

What tracing cannot see: a fault whose program differs but whose values cannot on these inputs (a
tie-breaking rule where the parameters carry no tie). ``applies`` must say so itself (``planted_tie``).
"""

from __future__ import annotations

import hashlib
from functools import partial

import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from meshlm.parallel.context import Parallel
from meshlm.proof.control_record import Control
from meshlm.proof.control_runs import crash_error, trace_control, unchanged_values
from meshlm.proof.pipeline_verify import _under_pp, pipeline_control_fn, trace_model_control
from meshlm.proof.rule_errors import is_vma_rejection


def fingerprint(program) -> str:
    """A digest of a traced program (a ``Traced`` or a ``ClosedJaxpr``): its jaxpr's text and every
    constant and literal value in it, sub-programs included (the text shows neither a constant's value
    nor an array literal's)."""
    closed = getattr(program, "jaxpr", program)
    digest = hashlib.sha256(str(closed).encode())
    for value in _values(closed):
        a = np.asarray(value)
        digest.update(f"{a.dtype}{a.shape}".encode())
        digest.update(np.ascontiguousarray(a).tobytes())
    return digest.hexdigest()


def _values(jaxpr):
    """The constants and literals of ``jaxpr`` (a ``ClosedJaxpr`` or ``Jaxpr``) and its sub-jaxprs."""
    if isinstance(jaxpr, ClosedJaxpr):
        yield from jaxpr.consts
        jaxpr = jaxpr.jaxpr
    for eqn in jaxpr.eqns:
        yield from (v.val for v in eqn.invars if isinstance(v, Literal))
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                if isinstance(sub, ClosedJaxpr | Jaxpr):
                    yield from _values(sub)
                elif isinstance(sub, np.ndarray):
                    yield sub
    yield from (v.val for v in jaxpr.outvars if isinstance(v, Literal))


def _kind(control) -> tuple[bool, bool]:
    """Which program a control runs: the loss and gradients (a pipeline control's too), the training
    step (the clipping fault), or the communication check's step."""
    if isinstance(control, str):
        return (False, False)
    return (control.per_shard_clip or control.train_step, control.by_collectives)


def _unplanted(kind: tuple[bool, bool]) -> Control:
    """The program of ``kind`` with no fault in it."""
    clip, by_collectives = kind
    return Control(
        name="none", applies=bool, par_cls=Parallel, per_shard_clip=clip, by_collectives=by_collectives
    )


def _trace(control, runs, ocfg, fault: bool = True):
    """The program ``run_control`` (or under pp ``run_model_control``, or for a pipeline control's name
    ``pipeline_controls``) runs for ``control``, traced."""
    if isinstance(control, str):  # kept for its run (``Runs.run_traced``)
        traced = pipeline_control_fn(runs, control).trace(runs.params, runs.batch)
        runs.traced[f"pipeline: {control}"] = (traced, runs.params)
        return traced
    trace = partial(trace_control, ocfg=ocfg, fault=fault)
    if runs.layout.pipelined:
        return trace_model_control(control, runs, trace)
    return trace(control, runs)


def _changes_params(control, runs) -> bool:
    if isinstance(control, str) or control.params_change is None:
        return False
    planted = control.params_change(runs.problem.cfg, runs.params)
    same = lambda a, b: a is b or np.array_equal(np.asarray(a), np.asarray(b))
    return not all(same(planted[m][n], x) for m, leaves in runs.params.items() for n, x in leaves.items())


def inert_controls(controls, runs, ocfg=None) -> list[str]:
    """The names of those of ``controls`` (``Control``s, or pipeline controls' names) whose planted
    program and parameters equal the unplanted ones on ``runs``' configuration. A control JAX's
    varying-axis check rejects at trace time changed the program (a detection); any other exception
    is the crash ``run_control`` would report, raised now."""
    bases: dict[tuple, str] = {}
    inert = []
    for control in controls:
        name, kind = control if isinstance(control, str) else control.name, _kind(control)
        if kind not in bases:  # first: the problem's own errors (a wrong rule) are not the control's
            bases[kind] = fingerprint(_trace(_unplanted(kind), runs, ocfg, fault=False))
        try:
            planted = fingerprint(_trace(control, runs, ocfg))
        except Exception as e:
            if is_vma_rejection(e):
                continue
            raise crash_error(name, e) from e
        if planted == bases[kind] and not _changes_params(control, runs):
            inert.append(name)
    return inert


INERT = (
    "its plant changes nothing in the program this configuration runs (traced planted and unplanted: "
    "identical)"
)


def inert_skips(controls, runs, ocfg=None) -> dict[str, str]:
    """{name: reason} of those of ``controls`` that are inert here (``inert_controls``): each is skipped
    with its reason, never run and never a failure of a correct model's proof (``tests/test_every_control.py``
    holds every control's ``applies`` to configurations where it changes the program)."""
    return dict.fromkeys(inert_controls(controls, runs, ocfg), INERT)


MISJUDGED = "inertness judgement"  # the check row of a control judged inert whose planted run changed values


def confirmed_skips(
    skips: dict[str, str], controls, runs, ocfg=None
) -> tuple[dict[str, str], dict[str, str]]:
    """(the skips that stand, {name: what changed} of those that do not). Each skip of ``skips``
    (``inert_skips``: a judgement from traces and fingerprints, which a bug in the judgement can get
    wrong) is run once: it stands only where its planted run's values are bitwise the unplanted run's
    with every weight trainable, at the same parameters, from the same lowered program
    (``control_runs.unchanged_values``: the judgement's own claim, checked by other means than the
    fingerprint). One that changes a value is live, one that changes the program or the parameters and
    no value a no-op: either is run as every other control, and verify fails its check row
    ``MISJUDGED`` (a broken judgement is loud, never a silent skip). A pipeline control's name (its
    engine's own fault) and, under pp, a communication control stand on their trace alone."""
    by_name = {c.name: c for c in controls if not isinstance(c, str)}
    stand, live = {}, {}
    for name, why in skips.items():
        control, planted = by_name.get(name), runs
        if control is not None and runs.layout.pipelined:  # as ``run_model_control`` runs it
            control, planted = (None, runs) if control.by_collectives else _under_pp(control, runs)
        changed = "" if control is None else unchanged_values(control, planted, ocfg, plain=runs)
        if changed:
            live[name] = changed
        else:
            stand[name] = why
    return stand, live
