"""The proof: a sharded computation equals the unsharded one, parameter by parameter.

``verify`` runs one Haiku loss (written with meshlm layers) twice on the same inputs and initial
parameters: sharded with ``shard_map`` on a (DP, MP) mesh, and unsharded under ``jit`` on one device.
It compares the loss and every parameter's gradient, and with ``steps=K`` every parameter and
optimizer-state leaf after each of K training steps. Beside the values it checks that the reference
is independent of the sharded program (``independence``), optionally that the compiled step
communicates no more than the Megatron minimum (``communication``) and that the data pipeline's
per-device rows assemble to the one-device batch (``data_pipeline``). Then it runs planted faults
(``controls``) and requires each one to be detected, so a passing proof is known to be able to fail.

Error measure per leaf: max_abs_err = max|s - r|; max_rel_err = max|s - r| / max|r| (normwise).
A leaf passes when max_abs_err <= atol + rtol * max|r|; a parameter after training steps, when
|s - r| <= atol + rtol * max|r| + the part AdamW's element-wise division makes of its moments'
measured difference (``adam_drift``: the moments are compared normwise like any leaf).
"""

from __future__ import annotations

import jax.numpy as jnp

from meshlm.data.tokens import check_batch
from meshlm.model.params import flat_params
from meshlm.parallel import watchdog
from meshlm.parallel.layout import Layout
from meshlm.parallel.placement import bytes_per_device, to_host, total_bytes
from meshlm.proof.adam_drift import AdamDrift
from meshlm.proof.ahead import Ahead, Compiler
from meshlm.proof.control_runs import (
    communication_rows,
    compiles_ahead,
    honest_collectives,
    prepare_control,
    run_control,
)
from meshlm.proof.controls import CONTROLS, Control, Where
from meshlm.proof.cp_controls import CP_CONTROLS
from meshlm.proof.data_pipeline import data_checks
from meshlm.proof.ep_controls import EP_CONTROLS
from meshlm.proof.independence import exactness_check, reference_checks, sharded_check
from meshlm.proof.inertness import MISJUDGED, confirmed_skips, inert_skips
from meshlm.proof.lora import lora_rows, tolerance_factor
from meshlm.proof.padding import padding_rows
from meshlm.proof.pipeline_proof import applicable_controls
from meshlm.proof.pipeline_verify import permute_controls, permute_rows, pipeline_controls, run_model_control
from meshlm.proof.problem import Problem
from meshlm.proof.quant_exact import int8_experts, int8_rows
from meshlm.proof.report import LeafResult, Report, check_row, compare_into, leaf_label, skipped_row
from meshlm.proof.routing import routing_rows
from meshlm.proof.rule_errors import rule_mismatch, vma_error
from meshlm.proof.runs import Runs, default_optim, reference_grad_norm, step_batches
from meshlm.sharding.strategy import strategy
from meshlm.train.optim import OptimConfig

# (rtol, atol), normwise. float32: summation order differs between layouts and Adam's division by
# sqrt(v) amplifies rounding in near-zero gradients over steps; float64 shows the result is exact.
TOLERANCE = {"float32": (2e-4, 1e-6), "float64": (1e-12, 1e-15)}


def verify(
    problem: Problem,
    where,
    *,
    steps: int = 0,
    dtype=jnp.float32,
    seed: int = 0,
    ocfg: OptimConfig | None = None,
    controls: tuple[Control, ...] = CONTROLS + CP_CONTROLS + EP_CONTROLS,
    collectives: bool = False,
    data_steps: int = 0,
    allow_routing_flips: bool = False,
    pipeline_faults: tuple[str, ...] | None = None,
    compile_workers: int | None = None,
) -> Report:
    """Prove ``problem`` sharded on ``where`` (a jax Mesh or a Layout, with the problem's memory
    options) equals it unsharded; see the module docstring.

    ``collectives`` adds the communication check (needs ``problem.cfg``); ``data_steps`` > 0 adds
    the data-pipeline check over that many steps. A mixture of experts' routing flips are counted
    and decide a check row (``proof.routing``); ``allow_routing_flips`` passes that row in float32
    (never in float64), the tolerance unchanged. Under pp ``pipeline_faults`` names the pipeline's own
    controls to run (None: every one that applies; () none: a test of a model feature under pp runs
    those its feature touches, the schedule's faults being proven on every schedule by
    tests/test_pp_verify.py). ``compile_workers``: threads compiling the controls' programs ahead
    (``proof.ahead``; default the idle cores less one, ``idle_workers``; 0 none)."""
    dname = jnp.dtype(dtype).name
    rtol, atol = TOLERANCE[dname]
    layout = Layout.of(where, fsdp=problem.fsdp, sp=problem.sp)
    if problem.cfg is not None:  # what the strategy cannot run (e.g. MTP under pp): one line, before any work
        check_batch(problem.batch, problem.cfg.vocab_size)
        strategy(layout).check(problem.cfg, layout)
    dp, mp = layout.dp, layout.mp
    report = Report(config=problem.name, dp=dp, mp=mp, steps=steps, dtype=dname, rtol=rtol, atol=atol)
    if layout.extra_axes:  # the header names the pipeline ("pp2x1x2 (1f1b, M=4)") or cp
        report.extra["mesh"] = layout.label()  # ("1x2 + CP2 ring")
    runs = Runs(problem, layout, dtype, seed)  # first: its specs refuse a mesh the model cannot use
    if (factor := tolerance_factor(problem.cfg, runs.ref_params)) != 1:  # adapters: their conditioning
        rtol = report.rtol = rtol * factor
        report.extra["lora_tolerance_factor"] = factor
    collectives = collectives and problem.cfg is not None
    where = where_of(problem, layout, collectives)
    chosen, pipeline = control_set(where, controls), []
    engine_faults = strategy(layout).engine_faults
    if engine_faults:  # every control through the pipeline, and its own faults (``pipeline_verify``)
        chosen += permute_controls(controls, where, collectives)
        pipeline = applicable_controls(layout.pipeline)
        if pipeline_faults is not None:
            if unknown := set(pipeline_faults) - set(pipeline):
                raise ValueError(
                    f"pipeline controls {sorted(unknown)} do not apply here; these do: {pipeline}"
                )
            pipeline = [n for n in pipeline if n in pipeline_faults]
    with Compiler(compile_workers) as compiler:
        try:  # before any run: a control that changes nothing here is skipped, saying so (``inertness``)
            skips = inert_skips(chosen + pipeline, runs, ocfg)
            skipped, misjudged = confirmed_skips(skips, chosen, runs, ocfg)
            chosen = [c for c in chosen if c.name not in skipped]
            pipeline = [n for n in pipeline if n not in skipped]
            ahead = None if engine_faults else _ahead(chosen, runs, compiler)  # compiling from here on
            sharded = runs.proven_grads()
        except ValueError as e:  # a wrong rule or a varying-axis type error: a failing row, not a traceback
            for name, explain in (("sharding rules", rule_mismatch), ("varying-axis types", vma_error)):
                if (found := explain(e, runs.params, runs.specs)) is not None:
                    report.params, report.loss_ok = [found[0]], False
                    report.checks = [check_row(name, False, found[1])]
                    report.halted = "the sharded program could not be traced"
                    return report
            raise
        ocfg = _compare_values(report, runs, sharded, steps, ocfg, seed)
        report.checks = _checks(runs, steps, ocfg, collectives, data_steps, seed) + report.checks
        report.checks += padding_rows(problem, sharded[1])
        report.checks += lora_rows(runs, sharded[1], rtol)  # with adapters: frozen base, merged forward
        report.checks += routing_rows(runs, dname, allow_routing_flips)
        if problem.cfg is not None and problem.cfg.quant == "int8":  # the int8 matmuls bit for bit
            report.checks += int8_rows(layout, dtype, seed, moe_dispatch=int8_experts(problem.cfg))
        report.checks += [_misjudged_row(name, what) for name, what in misjudged.items()]
        report.controls = [skipped_row(name, why) for name, why in skipped.items()]
        report.extra["param_bytes_per_device"] = bytes_per_device(runs.params)
        report.extra["param_bytes_total"] = total_bytes(runs.params)
        if engine_faults:
            report.controls += [run_model_control(c, runs, run_control, ocfg, rtol, atol) for c in chosen]
            report.controls += pipeline_controls(runs, rtol, atol, pipeline)
            return report
        report.controls += _control_rows(chosen, ahead, runs, ocfg, rtol, atol)
    return report


def _ahead(chosen: list[Control], runs: Runs, compiler: Compiler) -> Ahead | None:
    """(index, control) of the controls whose programs compile ahead on ``compiler``'s pool
    (``proof.ahead``: at most ``AHEAD_PER_WORKER`` per worker, at least ``AHEAD_MIN``, prepared before
    the one that runs); None without workers (each compiled in its run)."""
    if not compiler.workers:
        return None
    items = [(i, c) for i, c in enumerate(chosen) if compiles_ahead(c)]
    window = max(AHEAD_MIN, AHEAD_PER_WORKER * compiler.workers)
    return Ahead(items, lambda item: prepare_control(item[1], runs, compiler), window)


AHEAD_PER_WORKER, AHEAD_MIN = 2, 8  # controls' programs held compiled ahead (each its module and executable)


def _control_rows(chosen: list[Control], ahead: Ahead | None, runs: Runs, ocfg, rtol, atol) -> list[dict]:
    """Each control's row (``run_control``), in ``chosen``'s order. With ``ahead``: first, on this
    thread, those whose run builds its own programs (a training step's), while the pool compiles the
    others', then those; each row is what the control's run gives whatever runs before it."""
    mesh = runs.layout.label()

    def run(c: Control, prepared=None) -> dict:
        with watchdog.program(f"verify's control {c.name!r}", mesh):
            return run_control(c, runs, ocfg, rtol, atol, prepared)

    rows = {i: run(c) for i, c in enumerate(chosen) if ahead is None or not compiles_ahead(c)}
    for (i, c), prepared in ahead or ():
        rows[i] = run(c, prepared)
    return [rows[i] for i in range(len(chosen))]


def _misjudged_row(name: str, what: str) -> dict:
    """The failing row of control ``name``, judged inert, whose planted run changed ``what``."""
    detail = f"{name!r} was judged inert, yet its planted run changes {what}: the judgement is broken"
    return check_row(MISJUDGED, False, detail + " (the control ran as every other)")


def control_set(
    where: Where, controls: tuple[Control, ...] = CONTROLS + CP_CONTROLS + EP_CONTROLS
) -> list[Control]:
    """The controls that apply to the model and options on ``where``'s layout, under pp and cp as
    without them (the pipeline's own come on top under pp: ``pipeline_verify``)."""
    return [c for c in controls if c.applies(where)]


def where_of(problem: Problem, layout: Layout, collectives: bool) -> Where:
    """What the controls' applicability is decided on: the problem's model on this layout. Under pp the
    communication check counts the pipeline's permutes (``pipeline_verify.permute_rows``), not the
    all-reduces the communication controls add: those do not run there."""
    return Where(
        cfg=problem.cfg,
        layout=layout,
        has_row_bias=problem.has_row_bias,
        collectives=collectives and strategy(layout).proof_collectives == "all-reduces",
        seq_len=int(jnp.shape(problem.batch.get("inputs", ()))[-1]),
        planted_tie=problem.load_params is None and problem.prepare_params is not None,
    )


def _compare_values(report: Report, runs: Runs, sharded, steps: int, ocfg, seed: int):
    """Loss and gradients, then (with ``steps``) the state after each training step; returns the
    optimizer config the steps used (the controls reuse it)."""
    rtol, atol = report.rtol, report.atol
    (ls, gs), (lr, gr) = sharded, runs.reference_grads()
    mesh = runs.layout.label()
    with watchdog.program("verify's sharded loss and gradients", mesh):
        report.loss_sharded, report.loss_reference = float(to_host(ls)), float(to_host(lr))
    loss_check = LeafResult(path="loss", shape=(), spec="P()")
    results: dict[str, LeafResult] = {}
    differ, total = compare_into(results, gs, gr, rtol, atol)
    counts = {"loss and gradients": (differ + (loss_check.update(ls, lr, rtol, atol) != 0), total + 1)}
    if steps:
        ocfg = ocfg or default_optim(steps, reference_grad_norm(runs), runs.problem.opt_dtype)
        batches = step_batches(runs.problem, steps, ocfg.accum_steps, seed)
        differ = total = 0
        drift = AdamDrift(ocfg, leaf_label)  # what AdamW's division makes of the moments' difference
        for (ps, ss, ms), (pr, sr, mr) in runs.train(ocfg, batches, seed=seed):
            with watchdog.program("verify's sharded train step", mesh):  # its outputs' first read
                d, n = compare_into(results, ps, pr, rtol, atol, drift.step(ss, sr))
            d2, n2 = compare_into(results, ss, sr, rtol, atol)
            d, n = d + d2, n + n2
            d += loss_check.update(to_host(ms["loss"]), to_host(mr["loss"]), rtol, atol) != 0
            differ, total = differ + d, total + n + 1
        counts["training steps"] = (differ, total)
        runs.trained = ps  # the sharded parameters after the last step (``lora_rows``: the base kept)
    report.loss_ok = loss_check.ok
    for path, spec in flat_params(runs.specs).items():
        if path in results:
            results[path].spec = str(spec)
    report.params = list(results.values())
    # A check row: a comparison whose every leaf is bitwise equal is suspicious (``independence``).
    report.checks = exactness_check(counts, report.dtype, runs.mesh.size)
    return ocfg


def _all_reduce_rows(runs: Runs) -> list[dict]:
    """The communication check of a sharded step: its compiled collectives against the expected."""
    return communication_rows(runs, honest_collectives(runs))


COMMUNICATION = {"all-reduces": _all_reduce_rows, "permutes": permute_rows}  # ``Sharded.proof_collectives``


def _checks(runs: Runs, steps: int, ocfg, collectives: bool, data_steps: int, seed: int) -> list[dict]:
    """Independence of the reference, and optionally communication and the data pipeline."""
    outputs = [runs.reference_grads()]
    if steps:
        outputs.append(runs.reference_train(ocfg, step_batches(runs.problem, steps, ocfg.accum_steps, seed)))
    rows = reference_checks(runs.checked, outputs)
    rows.append(sharded_check(runs.sharded_hlo, runs.mesh.size))
    if collectives:  # what the strategy's step communicates by: all-reduces, or the pipeline's permutes
        rows += COMMUNICATION[strategy(runs.layout).proof_collectives](runs)
    if data_steps:
        t = runs.problem.batch["inputs"].shape[1]  # its own batch: >= 3 rows per shard per micro-batch
        rows += data_checks(runs.layout, seq_len=t, steps=data_steps, seed=seed)
    return rows
