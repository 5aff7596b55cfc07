"""AdamW's element-wise division and the proof's comparison (``proof.adam_drift``): a gradient element
near zero whose rounding differs at the leaf's scale moves its parameter by a difference far beyond a
normwise 1e-12, its moments within 1e-15; the drift excuses exactly that, and not a fault in the step."""

import jax
import numpy as np
import optax
import pytest

from meshlm.proof.adam_drift import AdamDrift, adam_moments
from meshlm.proof.report import compare_into, leaf_label
from meshlm.train.optim import OptimConfig, adamw

OCFG = OptimConfig(lr=1e-2, warmup_steps=0, total_steps=3, weight_decay=0.1, clip_norm=0.0)
RTOL, ATOL = 1e-12, 1e-15


@pytest.fixture(scope="module", autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def _run(grads, lr_scale=1.0):
    """Two AdamW steps of a [4] leaf at the embedding's scale from ``grads`` (one per step);
    ``lr_scale`` != 1 plants a fault in the step itself (the moments untouched)."""
    params = {"embed": {"embeddings": np.full(4, 0.05)}}
    opt = adamw(OCFG, params)
    state, out = opt.init(params), []
    for g in grads:
        updates, state = opt.update({"embed": {"embeddings": g}}, state, params)
        params = optax.apply_updates(params, jax.tree.map(lambda u: u * lr_scale, updates))
        out.append((jax.tree.map(np.asarray, params), state))
    return out


def _compare(sharded, reference, with_drift=True):
    results, drift = {}, AdamDrift(OCFG, leaf_label)
    for (ps, ss), (pr, sr) in zip(sharded, reference, strict=True):
        compare_into(results, ps, pr, RTOL, ATOL, drift.step(ss, sr) if with_drift else None)
        compare_into(results, ss, sr, RTOL, ATOL)
    return results["embed/embeddings"]


# The last element's gradient has cancelled to 1e-12; the other run's differs by 1e-19 (a rounding
# error at the 1e-3 scale of the terms it summed): 1e-16 of the leaf's scale, 1e-7 of its own.
G = [np.array([1e-3, -1e-3, 5e-4, 1e-12]), np.array([1e-3, 1e-3, -5e-4, -2e-12])]
G_OTHER = [g + np.array([0, 0, 0, 1e-19]) for g in G]


def test_rounding_near_zero_is_beyond_the_normwise_tolerance_and_excused():
    reference, sharded = _run(G), _run(G_OTHER)
    moments = adam_moments(sharded[-1][1])
    assert moments is not None and moments.mu["embed"]["embeddings"].shape == (4,)
    plain = _compare(sharded, reference, with_drift=False)
    assert not plain.ok and plain.max_rel_err > 1e-12, plain  # the normwise comparison fails
    excused = _compare(sharded, reference)
    assert excused.ok and excused.adam_drift > 0.5 * excused.max_abs_err, excused
    assert excused.max_abs_err == plain.max_abs_err  # the error reported as measured


def test_a_fault_in_the_step_is_not_excused():
    """The learning rate 1e-6 off in the sharded step: the moments equal, the parameters not."""
    reference, sharded = _run(G), _run(G_OTHER, lr_scale=1 + 1e-6)
    result = _compare(sharded, reference)
    assert not result.ok and result.tol_ratio > 10, result


def test_a_relative_error_above_rtol_passed_by_the_absolute_floor_is_marked():
    """Issue 59: proofs printed OK with a worst relative error of 1.4e-12 – 2.4e-12 against the README's
    1e-12: AdamW's second moments (max|r| ~1e-4, (1 - b2) g^2) compared within 1e-15 + 1e-12 max|r|, where
    the absolute 1e-15 decides. Such a row reads PASS+ with a footnote (its relative error and scale); a
    leaf of scale 1 with the same relative error fails; one within rtol reads PASS."""
    from meshlm.proof.report import LeafResult, Report, format_report

    rows = {}
    for path, scale in (("small/nu", 1e-4), ("large/w", 1.0), ("exact/w", 1e-4)):
        rows[path] = LeafResult(path=path, shape=(2,), spec="P()")
        rel = 0.5e-12 if path == "exact/w" else 2e-12
        rows[path].update(np.array([scale, scale * (1 + rel)]), np.array([scale, scale]), RTOL, ATOL)
    assert rows["small/nu"].ok and rows["small/nu"].floor_rel_err == pytest.approx(2e-12, rel=1e-3)
    assert not rows["large/w"].ok and rows["exact/w"].ok and rows["exact/w"].floor_rel_err == 0
    report = Report(config="c", dp=1, mp=2, steps=2, dtype="float64", rtol=RTOL, atol=ATOL)
    report.params = [rows["small/nu"], rows["exact/w"]]
    text = format_report(report)
    marks = {line.split()[0]: line.split()[-1] for line in text.splitlines() if line[:2] in ("sm", "ex")}
    assert marks == {"small/nu": "PASS+", "exact/w": "PASS"}, text
    assert "+ small/nu: relative error 2.00e-12 where max|r| is 1.0e-04, within the tolerance's" in text
    assert "(1e-12 + 1e-15/max|r| = 1.10e-11 relative there" in text
    assert report.to_json()["params"][0]["floor_rel_err"] == rows["small/nu"].floor_rel_err
