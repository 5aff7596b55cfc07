"""A control that cannot change anything the proof compares is skipped with its reason, never a failure
of a correct model's proof; a control that changes the compared values is still run and detected, and a
no-op is still "not detected" (issue 59).

The case found: ``verify --config tiny-qwen3 --lora-rank 4`` failed on "q/k norm applied after rotary",
NOT DETECTED. Under LoRA the q/k norm's weight is frozen at its init, uniform over each head's dims;
RMSNorm then commutes with the rotary (a rotation keeps a head's norm, a uniform weight commutes with
it), so the order of the two shows only in that weight's own gradient, which LoRA never computes.
``control_runs.frozen_reach`` finds it by value: with every weight trainable the planted program
changes the q/k norm weights' gradients and nothing else."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.model.config import get_config
from meshlm.parallel.context import Parallel
from meshlm.parallel.layout import Layout
from meshlm.proof import format_report, model_problem, verify
from meshlm.proof.control_record import Control
from meshlm.proof.control_runs import FROZEN_ONLY, LOOSE_BOUNDS
from meshlm.proof.controls import CONTROLS
from meshlm.proof.inertness import INERT
from meshlm.proof.lora import lora_problem

QK_AFTER_ROTARY = next(c for c in CONTROLS if c.name == "q/k norm applied after rotary")
LAYOUT = Layout(mp=2)


class _Silent(Parallel):
    """Changes the program (one more multiply) and no value, anywhere: a no-op."""

    def row_out(self, partial, bias=None):
        return super().row_out(partial, bias) * 1.0


NOOP = Control(name="no-op", applies=lambda w: True, par_cls=_Silent)
INERT_CONTROL = Control(name="plants nothing", applies=lambda w: True)  # the unplanted program itself


def _lora_qwen3(prepare=None):
    cfg = get_config("tiny-qwen3").replace(lora_rank=2, lora_alpha=4.0, lora_targets="q,v")
    problem = lora_problem(model_problem(cfg, "tiny-qwen3", LAYOUT, 1, 8))
    if prepare is not None:
        problem = dataclasses.replace(
            problem, prepare_params=lambda p, before=problem.prepare_params: prepare(before(p))
        )
    return problem


def _uneven_qk_norms(params):
    """The q/k norm weights as a trained model's: not uniform over a head's dims."""
    rng = np.random.default_rng(0)
    out = {m: dict(leaves) for m, leaves in params.items()}
    for module in [m for m in out if m.endswith(("q_norm", "k_norm"))]:
        w = out[module]["scale"]
        out[module]["scale"] = jax.device_put(w + 0.5 * rng.standard_normal(w.shape), w.sharding).astype(
            w.dtype
        )
    return out


def _rows(report) -> dict:
    return {c["name"]: c for c in report.controls}


def test_a_fault_only_frozen_weights_show_and_an_inert_one_are_skipped_with_their_reasons():
    """float64, LoRA on tiny-qwen3 at its init: the q/k norm order is skipped, naming the frozen leaves
    it reaches; a plant that changes nothing in the program is skipped as inert; the proof passes."""
    with jax.enable_x64(True):
        report = verify(_lora_qwen3(), LAYOUT, dtype=jnp.float64, controls=(QK_AFTER_ROTARY, INERT_CONTROL))
    rows = _rows(report)
    qk = rows[QK_AFTER_ROTARY.name]
    assert qk["detected"] is None and qk["skipped"].startswith(FROZEN_ONLY), qk
    assert "q_norm/scale" in qk["skipped"] and "k_norm/scale" in qk["skipped"] and "lora" not in qk["skipped"]
    assert rows[INERT_CONTROL.name]["skipped"] == INERT
    text = format_report(report)
    assert report.ok, text
    assert f"control {QK_AFTER_ROTARY.name:<42} skipped: {FROZEN_ONLY}" in text and "NOT DETECTED" not in text


# slow: its cost (a second LoRA proof, its control run with every weight trainable too); a no-op passing
# without adapters: tests/test_prover.py::test_a_no_op_control_is_not_detected_and_fails_the_proof, quick
@pytest.mark.slow
def test_a_no_op_under_lora_is_still_not_detected():
    """The frozen-reach check skips only a fault that changes frozen weights' gradients: a no-op (a
    different program, no value changed anywhere, thawed or not) is not detected, and fails."""
    with jax.enable_x64(True):
        noop = verify(_lora_qwen3(), LAYOUT, dtype=jnp.float64, controls=(NOOP,))
    (row,) = noop.controls
    assert row["detected"] is False and "skipped" not in row and row["how"] == "no difference"
    assert not noop.ok and "NOT DETECTED" in format_report(noop)


def test_the_same_fault_is_detected_where_the_frozen_weights_carry_it():
    """The check skips only what cannot show: with q/k norm weights that are not uniform (a trained or
    converted base's), the same control changes the adapters' gradients and is detected."""
    with jax.enable_x64(True):
        report = verify(_lora_qwen3(_uneven_qk_norms), LAYOUT, dtype=jnp.float64, controls=(QK_AFTER_ROTARY,))
    (row,) = report.controls
    assert row["detected"] is True and "skipped" not in row, row
    assert row["margin"] > 1e6 and "lora_" in row["how"], row
    assert report.ok, format_report(report)


EXTRA_ALL_REDUCE = next(c for c in CONTROLS if c.name == "extra all-reduce after each row-parallel one")


# slow: its cost (an FSDP + SP step compiled three times: the check, the fault, the honest count); the
# skip's mechanism on values: test_a_fault_only_frozen_weights_show_and_an_inert_one_..., quick
@pytest.mark.slow
def test_extra_collectives_within_full_trainings_bounds_are_skipped_under_lora():
    """Seen on ``verify --config tiny-qwen3 --fsdp --sp --objective sft --lora-rank 2`` (2x2): a LoRA
    step reduces no base gradient (6 all-reduces against full training's bound of 27), so the fault's
    extra all-reduces stay within the bounds, NOT DETECTED. Skipped, naming the collectives it added (a
    fault that adds none is not skipped: ``_more_than_honest`` is empty for it)."""
    layout = Layout(dp=2, mp=2, fsdp=True, sp=True)
    cfg = get_config("tiny-qwen3").replace(lora_rank=2, lora_alpha=4.0, lora_targets="q,v")
    problem = lora_problem(model_problem(cfg, "tiny-qwen3", layout.mp, 2, 8, dp=2, fsdp=True, sp=True))
    report = verify(problem, layout, controls=(EXTRA_ALL_REDUCE,), collectives=True)
    (row,) = report.controls
    assert row["detected"] is None and row["skipped"].startswith(LOOSE_BOUNDS), row
    assert " -> " in row["skipped"] and report.ok, format_report(report)


EMBED_TWICE = next(c for c in CONTROLS if c.name == "embedding scale applied twice")


def test_a_broken_inertness_judgement_cannot_skip_a_live_control(monkeypatch):
    """Issue 66: the judgement planted wrong twice -- the fingerprint hashing a constant's ndim, not its
    bytes, and ``_changes_params`` negated -- judged tiny-gemma2's "embedding scale applied twice" (a
    change of the parameters, not of the program) inert, and verify skipped it and passed. A skip now
    stands only on its planted run's values equal to the unplanted run's (``confirmed_skips``): the
    control runs, is detected, and the check row of the judgement fails the proof."""
    import hashlib

    import meshlm.proof.inertness as inertness
    from meshlm.proof.inertness import MISJUDGED

    def by_ndim(program):
        closed = getattr(program, "jaxpr", program)
        digest = hashlib.sha256(str(closed).encode())
        for value in inertness._values(closed):
            digest.update(str(np.ndim(value)).encode())
        return digest.hexdigest()

    real = inertness._changes_params
    monkeypatch.setattr(inertness, "fingerprint", by_ndim)
    monkeypatch.setattr(inertness, "_changes_params", lambda c, r: not real(c, r))
    problem = model_problem(get_config("tiny-gemma2"), "tiny-gemma2", LAYOUT, 1, 8)
    report = verify(problem, LAYOUT, dtype=jnp.float32, controls=(EMBED_TWICE,))
    (row,) = report.controls
    assert row["detected"] is True and "skipped" not in row, row
    (judged,) = [c for c in report.checks if c["name"] == MISJUDGED]
    assert not judged["ok"] and "changes the loss" in judged["detail"], judged
    assert not report.ok, format_report(report)


def test_a_judgement_calling_every_program_the_same_cannot_skip_a_no_op(monkeypatch):
    """A no-op control (its program changes, no value does) is NOT DETECTED: a failure. A judgement
    planted wrong -- its fingerprint a constant, so every control is judged inert -- used to turn it
    into a skip that stood, its values being bitwise the unplanted run's, and verify passed. The
    evidence compares the planted and unplanted lowered programs too: the judgement's check row fails,
    the no-op runs and fails, and a control that truly plants nothing is still skipped."""
    import meshlm.proof.inertness as inertness
    from meshlm.proof.inertness import MISJUDGED

    monkeypatch.setattr(inertness, "fingerprint", lambda program: "every program the same")
    problem = model_problem(get_config("tiny-gemma2"), "tiny-gemma2", LAYOUT, 1, 8)
    report = verify(problem, LAYOUT, dtype=jnp.float32, controls=(NOOP, INERT_CONTROL))
    rows = _rows(report)
    assert rows[NOOP.name]["detected"] is False and "skipped" not in rows[NOOP.name], rows
    assert rows[INERT_CONTROL.name]["skipped"] == INERT, rows
    (judged,) = [c for c in report.checks if c["name"] == MISJUDGED]
    assert not judged["ok"] and "its program" in judged["detail"] and NOOP.name in judged["detail"], judged
    assert not report.ok, format_report(report)
