"""The planner's report as text: one device's memory, analytic next to compiled, and the candidates."""

from __future__ import annotations

from meshlm.units import format_bytes

gib = format_bytes  # bytes in GiB, or MiB / KiB when smaller (tiny test models)


def flags(settings: dict) -> str:
    """The command-line options that select ``settings`` (a PlanSettings as a dict)."""
    out = [f"--{name}" for name in ("fsdp", "sp") if settings[name]]
    out += [f"--remat {settings['remat']}"] if settings["remat"] != "none" else []
    out += [f"--accum-steps {settings['accum_steps']}"] if settings["accum_steps"] > 1 else []
    return " ".join(out) or "(as given)"


def _header(report: dict) -> list[str]:
    s, mesh = report["plan"]["settings"], report["mesh"]
    total = report["unsharded"]
    pp = f"pp{mesh['pp']}x" if "pp" in mesh else ""
    cp = f", cp={mesh['cp']}" if "cp" in mesh else ""  # the context axis, where there is one
    cp += f", ep={mesh['ep']}: the experts split over ep of the dp data shards" if "ep" in mesh else ""
    return [
        f"meshlm plan: {report['config']} on mesh {pp}{mesh['dp']}x{mesh['mp']} (dp={mesh['dp']}, "
        f"mp={mesh['mp']}{cp}), batch {s['batch_size']} x {s['seq_len']}, accum {s['accum_steps']}, "
        f"{s['compute_dtype']} compute, options: {report['plan']['label']}",
        f"unsharded: parameters {gib(total['params'])} {_stored(total)}, AdamW moments "
        f"{gib(total['opt_state'])}",
        compiler_line(report["compiler"]),
        *_pipeline(report.get("pipeline")),
    ]


def compiler_line(c: dict) -> str:
    """Which compiler planned, for which chip, and the correction the verdicts use."""
    chip = f" for {c['chip']}" if c["chip"] else ""
    fix = c["correction"]
    fix = (
        f"{fix['name']}: {fix['rule']}; {fix['error']}" if fix else "none (the compiled figures as they are)"
    )
    return f"compiler{chip}: {c['compiler']}; correction: {fix}"


def _stored(total: dict) -> str:
    """How the parameters are stored: float32 (their count), or a LoRA base in bf16 (``--base-dtype``)."""
    if total.get("base_dtype", "float32") == "bf16":
        return "(the frozen base in bf16, the adapters float32)"
    return f"float32 ({total['params'] // 4:,})"


def _pipeline(p: dict | None) -> list[str]:
    """The schedule's line: every stage runs the same SPMD program, so the compiled figures below are
    each stage's (the largest: the first stage's, whose 1F1B stash is deepest)."""
    if p is None:
        return []
    v = f", V={p['virtual_stages']}" if p["virtual_stages"] > 1 else ""
    return [
        f"pipeline: {p['pp_schedule']} over pp={p['pp']}, M={p['microbatches']}{v}: ideal bubble "
        f"{p['bubble_fraction']:.1%}, {p['ticks']} ticks, {p['permutes_per_step']} collective-permutes "
        f"per step, the residuals of at most {p['stashed_inputs']} micro-batches kept per stage (what "
        "--remat keeps of each); figures per stage"
    ]


def _breakdown(row: dict, platform: str) -> list[str]:
    a, c = row["analytic"], row["compiled"]
    inside, accum = "(in temporaries)", row["settings"]["accum_steps"] > 1
    lines = [
        ("parameters", gib(a["params"]), gib(c["params"])),
        ("optimizer state (AdamW)", gib(a["opt_state"]), gib(c["opt_state"])),
        ("  arguments (+ batch)", gib(a["params"] + a["opt_state"]), gib(c["argument"])),
        ("gradients" + (" (+ accum. sum)" if accum else ""), gib(a["gradients"]), inside),
        (_activations_label(a["activations"]), gib(a["activations"]["layers"]), inside),
        ("logits", gib(a["activations"]["logits"]), inside),
        ("temporaries", gib(a["temp"]), gib(c["temp"])),
        ("peak", gib(a["peak"]), gib(c["peak"])),
    ]
    if row["settings"]["fsdp"]:
        lines.insert(4, ("one layer's gathered weights", gib(a["gathered"]), inside))
    if "compiler_peak" in c:  # XLA:TPU's own heap: what the verdict uses (``plan_search.verdict_peak``)
        lines += [("peak, the compiler's heap", "", gib(c["compiler_peak"]))]
    if "corrected" in row:  # the host's plan corrected for the chip: what the verdict uses
        lines += [("temporaries, corrected", "", gib(row["corrected"]["temp"]))]
        lines += [("peak, corrected", "", gib(row["corrected"]["peak"]))]
    out = [f"  {'per device':<28}{'analytic':>14}{f'compiled (XLA:{platform.upper()})':>20}"]
    out += [f"  {name:<28}{left:>14}{right:>20}" for name, left, right in lines]
    frac = row["state_fraction"]
    out.append(
        f"  parameters + optimizer state: {frac:.1%} of the unsharded total (1/{1 / frac:.1f}); "
        f"compiled in {c['compile_s']:.1f} s"
    )
    return out


def _activations_label(acts: dict) -> str:
    """The activations' line: the table's, and with MoE layers their dispatch buffers."""
    return "activations (Korthikanti" + (" + experts)" if acts.get("moe_layers") else ")")


def _verdict(row: dict) -> str:
    if "error" in row:
        return f"not planned: {row['error']}"
    margin = row["margin"]
    if row["compiled"].get("refused"):  # the chip's compiler checks its plan against the chip's memory
        return f"does NOT fit ({gib(-margin)} over; the chip's compiler refused it: out of memory)"
    if margin < 0:
        return f"does NOT fit ({gib(-margin)} over)"
    return f"fits, tight ({gib(margin)} free)" if row["tight"] else f"fits ({gib(margin)} free)"


def _candidates(report: dict) -> list[str]:
    dp = report["mesh"]["dp"]
    peak = "corrected peak" if report["compiler"]["correction"] else "compiled peak"
    if any("compiler_peak" in r.get("compiled", {}) for r in report["candidates"]):
        peak = "compiler heap"
    head = f"  {'options':<34}{'rows/device':>12}{'analytic peak':>15}{peak:>16}  verdict"
    out = ["candidates (each one compiled):", head]
    for row in report["candidates"]:
        s = row["settings"]
        micro = s["batch_size"] // (dp * s["accum_steps"])
        analytic = gib(row["analytic"]["peak"]) if "analytic" in row else "-"
        compiled = gib(row["peak"]) if "peak" in row else "-"
        out.append(f"  {flags(s):<34}{micro:>12}{analytic:>15}{compiled:>16}  {_verdict(row)}")
    return out


def format_plan(report: dict) -> str:
    row, device = report["plan"], report["device_memory"]
    lines = _header(report) + _breakdown(row, report["compiler"]["platform"])
    if device is not None:
        source = f" ({report['device_memory_from']})" if report.get("device_memory_from") else ""
        lines.append(f"device memory {gib(device)}{source}: {_verdict(row)}")
    if report["candidates"]:
        lines += _candidates(report)
        if report["compiles"] >= report["max_compiles"]:
            lines.append(f"  (stopped at --max-compiles {report['max_compiles']})")
    if device is not None and not row["fits"]:
        best = [r for r in report["candidates"] if r["label"] == report["recommended"]]
        lines.append(
            f"recommended: {flags(best[0]['settings'])}" if best else "no candidate tried fits this device"
        )
    if report.get("schedule_png"):
        lines.append(f"schedule picture: {report['schedule_png']}")
    lines.append(f"note: {report['analytic_note']}")
    if report["note"]:
        lines.append(f"note: {report['note']}")
    return "\n".join(lines)
