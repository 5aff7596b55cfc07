"""meshlm plan's compiler and chip: the fit rule against XLA's memory analysis, which compiler planned
and the correction it used (report and text), --chip's memory, and the chip's own compiler from a CPU
host where libtpu is installed (skipped where it is not: CI; docs/memory.md, "Planning for a chip")."""

import importlib.util
import json
import math

import jax
import jax.numpy as jnp
import pytest
from helpers import run_cli

from meshlm.errors import ConfigError
from meshlm.model.config import get_config
from meshlm.parallel.layout import Layout
from meshlm.perf.plan import abstract_step, refused
from meshlm.perf.plan_calibration import CORRECTIONS, Correction, fit, parse_case
from meshlm.perf.plan_report import format_plan
from meshlm.perf.plan_search import plan
from meshlm.perf.plan_settings import PlanSettings
from meshlm.perf.plan_target import CHIPS, Target, slice_shape

TINY = get_config("tiny-llama")
RUN = PlanSettings(batch_size=8, seq_len=64)  # the activations outweigh the state's temporaries


def test_the_fit_rule_is_argument_plus_output_minus_alias_plus_temporaries():
    """The planner's peak, which every verdict uses, is XLA's four figures combined so: the donated
    parameters and AdamW state are outputs aliased to arguments, counted once (dropping the alias term
    counts them twice; dropping the output term loses the new batch-independent outputs)."""
    step, params, opt_state, batch = abstract_step(TINY, Layout(), RUN)
    m = step.lower(params, opt_state, batch).compile().memory_analysis()
    expected = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    expected += m.temp_size_in_bytes
    assert m.alias_size_in_bytes > 0 and m.output_size_in_bytes > m.alias_size_in_bytes  # both terms count
    report = plan(TINY, "tiny-llama", Layout(), RUN, device_bytes=expected)
    row = report["plan"]
    assert row["peak"] == row["compiled"]["peak"] == expected
    assert row["fits"] is True and row["margin"] == 0  # exactly full fits ...
    assert plan(TINY, "tiny-llama", Layout(), RUN, device_bytes=expected - 1)["plan"]["fits"] is False


def test_a_correction_is_what_the_verdict_uses_and_the_report_says_so():
    """Off the chip without its compiler, the temporaries are corrected and the verdict, the search
    and the recommendation use the corrected peak; the report names the compiler and the correction."""
    halve = Correction("v5e", "cpu", {"none": 0.5}, {"none": 0.0}, "test", "test error")
    target = Target(CHIPS["v5e"], "host", "cpu", "XLA:CPU for this host's devices", correction=halve)
    row = plan(TINY, "tiny-llama", Layout(), RUN)["plan"]
    raw, a = row["compiled"], row["analytic"]
    state = a["gradients"] + a["moment_copies"] + a["gathered"]  # not scaled: the state's bytes
    assert raw["temp"] > state
    corrected = raw["argument"] + raw["output"] - raw["alias"] + state + (raw["temp"] - state) / 2
    device = (corrected + raw["peak"]) // 2  # fits the corrected peak, not the host's
    report = plan(TINY, "tiny-llama", Layout(), RUN, device_bytes=device, target=target)
    row = report["plan"]
    assert row["peak"] == math.ceil(corrected) and row["compiled"] == raw and row["fits"] is True
    assert (
        report["compiler"]["how"] == "host" and report["compiler"]["correction"]["name"] == "v5e from XLA:CPU"
    )
    text = format_plan(report)
    assert "compiler for v5e: XLA:CPU for this host's devices; correction: v5e from XLA:CPU" in text
    assert "peak, corrected" in text and "corrected for v5e" in text
    uncorrected = plan(TINY, "tiny-llama", Layout(), RUN, device_bytes=device)
    assert uncorrected["plan"]["fits"] is False and "correction: none" in format_plan(uncorrected)


def test_chip_sets_the_memory_and_plans_with_the_v5e_correction(capsys):
    """--chip v5e --compiler host: the v5e's usable memory and its calibrated correction of XLA:CPU."""
    argv = "plan --config tiny-llama --mesh 1x1 --batch-size 4 --seq-len 32 --remat full --chip v5e --json"
    argv += " --compiler host"  # XLA:CPU and the correction, with libtpu installed or not
    assert run_cli(*argv.split()) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device_memory"] == CHIPS["v5e"].usable_bytes
    assert report["compiler"]["correction"] == CORRECTIONS["v5e"].describe()
    row, fix = report["plan"], CORRECTIONS["v5e"]
    c, a = row["compiled"], row["analytic"]
    state = a["gradients"] + a["moment_copies"] + a["gathered"]
    temp = state + fix.scale["full"] * max(c["temp"] - state, 0) + fix.offset["full"]
    assert (
        row["peak"] == row["corrected"]["peak"] == math.ceil(c["argument"] + c["output"] - c["alias"] + temp)
    )


def test_compiler_without_chip_is_one_line(capsys):
    assert run_cli(*"plan --config tiny-llama --mesh 1x1 --compiler host".split()) == 2
    assert (
        "--compiler host chooses a chip's compiler or the host's: add --chip v5e" in capsys.readouterr().err
    )


def test_slices_are_near_square():
    assert [slice_shape(n) for n in (1, 2, 4, 8, 16, 256)] == [
        (1, 1),
        (1, 2),
        (2, 2),
        (2, 4),
        (4, 4),
        (16, 16),
    ]


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu not installed (pip install -e '.[tpu-plan]'): the chip's compiler; CI plans with the "
    "correction (test_chip_sets_the_memory_and_plans_with_the_v5e_correction)",
)
def test_the_chips_own_compiler_from_a_cpu_host(capsys):
    """With libtpu, --chip v5e compiles for compile-only v5e devices (2x2 here), the flash kernel as
    Mosaic: the TPU's own buffer plan, no correction."""
    argv = (
        "plan --config tiny-llama --mesh 2x2 --batch-size 4 --seq-len 128 --chip v5e --attention flash --json"
    )
    assert run_cli(*argv.split()) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["compiler"]["platform"] == "tpu" and report["compiler"]["how"] == "chip"
    assert report["compiler"]["correction"] is None and "libtpu" in report["compiler"]["compiler"]
    c = report["plan"]["compiled"]
    # judged by the compiler's own heap (``plan_search.verdict_peak``): here above the summed peak
    # (tiles' padding: 6.9 against 5.9 MB), at the real sizes 0.5-2.7 GiB below it
    assert report["plan"]["peak"] == c["compiler_peak"] > 0
    assert report["plan"]["peak_source"] == "the chip compiler's heap"
    assert c["peak"] == c["argument"] + c["output"] - c["alias"] + c["temp"]


def test_the_fitted_correction_bounds_every_calibration_case_from_above():
    """``plan_calibration.fit``: per remat, the chip's temporaries from the host's, never below the chip's."""
    fixed = dict(argument=100, output=100, alias=90, state_temp=100)
    host = [{"case": f"m/full/b{b}", "temp": 100 + 1000 * b, **fixed} for b in (1, 2, 4)]
    chip = [{"case": f"m/full/b{b}", "temp": 100 + 500 * b + (30 if b == 2 else 0)} for b in (1, 2, 4)]
    chip.append({"case": "m/full/b8", "temp": 10**6, "refused": "RESOURCE_EXHAUSTED"})  # no plan: left out
    host.append({"case": "m/full/b8", "temp": 8100, **fixed})
    correction = fit(host + [{"case": "m/none/b1", "skipped": "compile over 60 s"}], chip, "v5e")
    assert set(correction.scale) == {"full"} and correction.scale["full"] == pytest.approx(0.5, abs=0.02)
    for h, c in zip(host[:3], chip, strict=False):
        assert correction.apply(h, "full", 100)["temp"] >= c["temp"]
    assert "on its 3 calibration cases" in correction.error and "+0.0%" in correction.error  # one exact
    with pytest.raises(ConfigError, match="not calibrated for --remat none"):
        correction.apply(host[0], "none", 100)
    # a held-out case (another model, bf16 moments) is not fitted on; its own error is stated apart
    other = {"case": "n/full/b2/bf16", "temp": 100 + 2000, **fixed}
    assert parse_case(other["case"]) == ("n", "full", 2, 1, "bf16")
    apart = fit(host + [other], chip + [{**other, "temp": 100 + 600}], "v5e", held_out=("n/",))
    assert apart.scale == correction.scale and "n/full/b2/bf16" not in apart.fitted
    assert "held out of the fit: n/full/b2/bf16 +" in apart.error


def test_a_refused_step_peaks_at_the_figure_the_chips_compiler_names():
    """XLA:TPU's refusal names the whole heap, arguments included ("HLO temporaries" though it says):
    the planner's peak is that figure, not the arguments on top of it (``perf.plan.refused``)."""
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32, sharding=one)}  # 4 MiB
    batch = {"inputs": jax.ShapeDtypeStruct((2, 8), jnp.int32, sharding=one)}
    message = "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
    message += "temporaries (1.5G) exceeds available HBM (15.75G)."
    row = refused(RuntimeError(message), params, params, batch, 1.0)
    argument = 2 * 4 * 2**20 + 64
    assert row["peak"] == int(1.5 * 2**30) and row["argument"] == argument
    assert row["temp"] == row["peak"] - argument and row["refused"] == message


def test_the_verdict_uses_the_chip_compilers_heap_where_it_planned():
    from meshlm.perf.plan_search import verdict_peak

    host = {"compiled": {"peak": 18_400}}
    chip = {"compiled": {"peak": 18_400, "compiler_peak": 14_870}}  # selective b4: summed vs held
    corrected = {"compiled": {"peak": 9_000}, "corrected": {"peak": 12_000}}
    assert verdict_peak(host) == (18_400, "argument + output + temp - alias")
    assert verdict_peak(chip) == (14_870, "the chip compiler's heap")
    assert verdict_peak(corrected) == (12_000, "host plan, corrected for the chip")
