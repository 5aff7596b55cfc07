"""The proof's result: per-leaf errors, the report, and its table.

Error measure per leaf: max_abs_err = max|s - r|; max_rel_err = max|s - r| / max|r| (normwise).
A leaf passes when max_abs_err <= atol + rtol * max|r|; ``tol_ratio`` is max_abs_err in units of that
bound (a control's margin: how far its fault moved the result, in tolerances).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import jax
import numpy as np

from meshlm.parallel.placement import to_host


@dataclass(kw_only=True)
class LeafResult:
    path: str
    shape: tuple
    spec: str
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    tol_ratio: float = 0.0  # max_abs_err / (atol + rtol * max|r|), worst over updates
    ok: bool = True
    adam_drift: float = 0.0  # the most a parameter's error went beyond tolerance, excused as AdamW drift
    # The worst relative error above rtol that the tolerance's absolute part passed (it allows
    # rtol + atol / max|r| relative: 2e-12 at max|r| = 1e-3 in float64, AdamW's second moments' scale on
    # the tiny models), and that comparison's max|r|
    floor_rel_err: float = 0.0
    floor_scale: float = 0.0

    def update(self, s, r, rtol, atol, drift=None) -> float:
        """Fold in one comparison of ``s`` (sharded) with ``r`` (reference); returns its max|s - r|.
        ``drift``: element-wise, the part of a parameter's difference after training steps that AdamW's
        division makes of its moments' measured difference (``proof.adam_drift``): excused on top of
        the tolerance, element by element, and reported."""
        s, r = np.asarray(s, np.float64), np.asarray(r, np.float64)
        diff = np.abs(s - r)
        err = float(np.max(diff)) if r.size else 0.0  # NaN where any element is NaN
        scale = float(np.max(np.abs(r))) if r.size else 0.0
        rel = err / scale if scale or np.isnan(err) else (0.0 if err == 0 else float("inf"))
        self.max_abs_err = worst(self.max_abs_err, err)
        self.max_rel_err = worst(self.max_rel_err, rel)
        bound = atol + rtol * scale
        if rtol * scale < err <= bound and rel > self.floor_rel_err:  # passed by atol's part alone
            self.floor_rel_err, self.floor_scale = rel, scale
        beyond = err
        if drift is not None and r.size and np.isfinite(err) and err > bound:
            beyond = float(np.max(diff - drift))
            self.adam_drift = max(self.adam_drift, err - bound)
        ratio = max(beyond, 0.0) / bound if np.isfinite(err) else float("inf")
        self.tol_ratio = max(self.tol_ratio, ratio)
        self.ok = self.ok and bool(np.isfinite(err)) and beyond <= bound
        return err


def worst(*errors: float) -> float:
    """The largest error, NaN if any is NaN (Python's ``max`` drops a NaN that is not first: a NaN
    gradient row would read as error 0.0)."""
    return float(np.max(errors)) if errors else 0.0


@dataclass(kw_only=True)
class Report:
    config: str
    dp: int
    mp: int
    steps: int
    dtype: str
    rtol: float
    atol: float
    loss_sharded: float = 0.0
    loss_reference: float = 0.0
    loss_ok: bool = True
    params: list[LeafResult] = field(default_factory=list)
    controls: list[dict] = field(default_factory=list)
    checks: list[dict] = field(default_factory=list)  # {"name", "ok", "detail"}: beyond the values
    extra: dict = field(default_factory=dict)
    halted: str = ""  # why the proof stopped before the values and controls (a failing check says how)

    @property
    def ok(self) -> bool:
        values = self.loss_ok and all(p.ok for p in self.params)
        controls = all(c["detected"] or c.get("skipped") for c in self.controls)  # a skip says why
        return values and all(c["ok"] for c in self.checks) and controls

    def to_json(self) -> dict:
        return {
            "ok": self.ok,
            "config": self.config,
            "mesh": {"dp": self.dp, "mp": self.mp},
            "steps": self.steps,
            "dtype": self.dtype,
            "tolerance": {"rtol": self.rtol, "atol": self.atol},
            "loss": {"sharded": self.loss_sharded, "reference": self.loss_reference},
            "params": [
                {
                    "path": p.path,
                    "shape": list(p.shape),
                    "spec": p.spec,
                    "max_abs_err": p.max_abs_err,
                    "max_rel_err": p.max_rel_err,
                    "adam_drift": p.adam_drift,
                    "floor_rel_err": p.floor_rel_err,
                    "ok": p.ok,
                }
                for p in self.params
            ],
            "controls": self.controls,
            "checks": self.checks,
            **self.extra,
        }


def check_row(name: str, ok: bool, detail: str) -> dict:
    """One row of ``Report.checks``: a property of the proof beyond the values (independence,
    communication, data pipeline, sharding rules)."""
    return {"name": name, "ok": bool(ok), "detail": detail}


def leaf_label(keypath) -> str:
    keys = [k.key for k in keypath if isinstance(k, jax.tree_util.DictKey)]
    if len(keys) >= 2:
        return f"{keys[-2]}/{keys[-1]}".replace("/~/", "/")
    return "opt_state" + jax.tree_util.keystr(keypath)  # e.g. the step counters


def compare_into(results: dict, sharded, reference, rtol, atol, drift=None) -> tuple[int, int]:
    """Fold the leaf-wise errors of two same-structure trees into ``results`` (by parameter path);
    returns (leaves that differ at all, leaves compared). ``drift``: {leaf label: element-wise bound}
    (``LeafResult.update``), for a tree of parameters after training steps."""
    s_leaves = jax.tree_util.tree_flatten_with_path(sharded)[0]
    r_leaves = jax.tree.leaves(reference)
    differ = 0
    for (kp, s), r in zip(s_leaves, r_leaves, strict=True):
        label = leaf_label(kp)
        if label not in results:
            results[label] = LeafResult(path=label, shape=tuple(np.shape(r)), spec="P()")
        d = (drift or {}).get(label)
        d = d if d is not None and np.shape(d) == np.shape(r) else None
        differ += results[label].update(to_host(s), to_host(r), rtol, atol, d) != 0
    return differ, len(r_leaves)


def format_report(r: Report) -> str:
    """The human-readable proof: one row per parameter, then the loss, the controls and a verdict."""
    rows = [
        f"meshlm verify: config={r.config} mesh={r.extra.get('mesh', f'{r.dp}x{r.mp}')} dtype={r.dtype} "
        f"steps={r.steps} "
        f"tolerance: max|s-r| <= {r.atol:g} + {r.rtol:.3g}*max|r| (normwise)"
        + (f" (rtol x {f:.3g}: the adapters' kappa)" if (f := r.extra.get("lora_tolerance_factor")) else ""),
        "",
    ]
    head = f"{'parameter':<28} {'global shape':<18} {'spec':<28} {'max abs err':>11} {'max rel err':>11}  ok"
    rows += [head, "-" * len(head)]
    for p in r.params:
        rows.append(
            f"{p.path:<28} {str(tuple(p.shape)):<18} {p.spec:<28} {p.max_abs_err:>11.3e} "
            f"{p.max_rel_err:>11.3e}  {_mark(p, r.rtol)}"
        )
    rows += [
        f"* {p.path}: {p.adam_drift:.1e} beyond the tolerance, within what AdamW's division makes of the "
        "moments' measured difference (proof.adam_drift)"
        for p in r.params
        if p.ok and p.adam_drift
    ]
    rows += [
        f"+ {p.path}: relative error {p.floor_rel_err:.2e} where max|r| is {p.floor_scale:.1e}, within the "
        f"tolerance's absolute {r.atol:g} ({r.rtol:g} + {r.atol:g}/max|r| = "
        f"{r.rtol + r.atol / p.floor_scale:.2e} relative there; AdamW's moments are in their parameter's row)"
        for p in r.params
        if p.ok and p.floor_rel_err > r.rtol
    ]
    rows += [
        "",
        f"loss: sharded {r.loss_sharded:.10g}  reference {r.loss_reference:.10g}  "
        f"{'PASS' if r.loss_ok else 'FAIL'}",
        f"worst relative error: {worst(*(p.max_rel_err for p in r.params)):.3e}",
        "",
    ]
    for c in r.checks:
        rows.append(f"check {c['name']:<44} {'PASS' if c['ok'] else 'FAIL'}  ({c['detail']})")
    rows.append("")
    if r.halted:
        rows.append(f"controls: not run ({r.halted})")
    elif not r.controls:
        rows.append("controls: none apply on this mesh (collective faults need mp > 1, dp faults dp > 1)")
    for c in r.controls:
        if c.get("skipped"):
            rows.append(f"control {c['name']:<42} skipped: {c['skipped']}")
            continue
        verdict = "detected" if c["detected"] else "NOT DETECTED (verifier failure)"
        verdict = f"{verdict}: {margin_text(c)}"
        rows.append(f"control {c['name']:<42} {verdict}  ({c['how']})")
    rows += ["", "OK: sharded == unsharded" if r.ok else "FAILED"]
    return "\n".join(rows)


def _mark(p: LeafResult, rtol: float) -> str:
    """A row's verdict: PASS, FAIL, PASS* (AdamW's drift excused) or PASS+ (a relative error above rtol
    that the tolerance's absolute part passed); a footnote says how much."""
    if not p.ok:
        return "FAIL"
    return "PASS*" if p.adam_drift else "PASS+" if p.floor_rel_err > rtol else "PASS"


def skipped_row(name: str, reason: str) -> dict:
    """A control that cannot change anything the proof compares on this configuration: not run, not a
    failure; ``reason`` says why (``proof.inertness``)."""
    return {"name": name, "detected": None, "skipped": reason, "how": reason, "margin": None, "by": "skipped"}


def margin_text(control: dict) -> str:
    """How far a detected control moved the result: ``3.1e5 x tolerance`` (values), or how else it
    was detected (the type check, communication, non-finite values)."""
    margin = control.get("margin")
    if margin is None:
        return control.get("by", "values")
    mantissa, exponent = f"{margin:.1e}".split("e")
    return f"{mantissa}e{int(exponent)} x tolerance"


def cell_row(row: dict, report, start: float) -> dict:
    """A proven cell's row: ``row`` (what it is) with the report's verdict, worst error, checks and
    controls, and the seconds since ``start`` (``time.perf_counter``)."""
    detected = sum(bool(c["detected"]) for c in report.controls)
    run = sum(not c.get("skipped") for c in report.controls)  # a skipped control is not counted
    return {
        **row,
        "ok": report.ok,
        "worst_rel_err": worst(*(p.max_rel_err for p in report.params)),
        "checks": f"{sum(c['ok'] for c in report.checks)}/{len(report.checks)}",
        "controls": f"{detected}/{run}",
        "seconds": round(time.perf_counter() - start, 1),
    }
