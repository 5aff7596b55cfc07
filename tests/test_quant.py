"""--quant int8 (model.quant): the int8 matmuls lower to s8 x s8 -> s32 dots, approximate the float
matmul and its gradients, and are exact under sharding (proof.quant_exact): the sharded int8 block equals
the unsharded one bit for bit, and the planted faults are caught."""

import re
from contextlib import nullcontext

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_cli

from meshlm.errors import ConfigError
from meshlm.model.config import get_config
from meshlm.model.quant import int8_dense
from meshlm.parallel.context import Parallel
from meshlm.parallel.layout import Layout
from meshlm.proof.quant_controls import QUANT_CONTROLS
from meshlm.proof.quant_exact import int8_rows


def _value_and_grads(fn, x, w, ct):
    out, vjp = jax.vjp(fn, x, w)
    return (out, *vjp(ct))


def _jitted_value_and_grads(fn, x, w, ct):
    """``_value_and_grads`` as one compiled program, as the step runs it (not one per operation)."""
    return jax.jit(lambda x, w, ct: _value_and_grads(fn, x, w, ct))(x, w, ct)


def _random(shapes, seed=0):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes, strict=True)]


def test_int8_lowers_to_s8_dots_with_s32_accumulators():
    """Forward, dx and dw: three dots of s8 operands into s32 in the HLO the step hands XLA, which the
    TPU runs on its int8 unit (XLA:CPU then fuses two into YNNPACK's int8 kernels and widens one)."""
    x, w, ct = _random([(4, 8, 32), (32, 16), (4, 8, 16)])
    fn = jax.jit(
        lambda x, w, ct: _value_and_grads(lambda x, w: int8_dense(Parallel(), "col", x, w), x, w, ct)
    )
    text = fn.lower(x, w, ct).as_text()  # StableHLO: each dot_general with its operand and result types
    dots = [line for line in text.splitlines() if "dot_general" in line]
    int8 = r"\(tensor<[0-9x]+xi8>, tensor<[0-9x]+xi8>\) -> tensor<[0-9x]+xi32>"
    assert len(dots) == 3 and all(re.search(int8, line) for line in dots), dots


def test_int8_approximates_the_float_matmul_and_its_gradients():
    x, w, ct = _random([(4, 8, 64), (64, 32), (4, 8, 32)], seed=1)
    got = _jitted_value_and_grads(lambda x, w: int8_dense(Parallel(), "row", x, w), x, w, ct)
    want = _jitted_value_and_grads(jnp.matmul, x, w, ct)
    for name, a, b in zip(("y", "dx", "dw"), got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        rel = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
        assert 1e-4 < rel < 0.02, (name, rel)  # quantized (not the float path), and close to it


def test_int8_of_zeros_is_zero_and_bfloat16_keeps_its_dtype():
    x, w = jnp.zeros((3, 8), jnp.bfloat16), jnp.ones((8, 4), jnp.bfloat16)
    y, dx, dw = _jitted_value_and_grads(
        lambda x, w: int8_dense(Parallel(), "col", x, w), x, w, jnp.ones((3, 4), jnp.bfloat16)
    )
    assert y.dtype == dx.dtype == dw.dtype == jnp.bfloat16
    assert not np.any(np.asarray(y, np.float32)) and not np.any(np.asarray(dw, np.float32))


@pytest.mark.parametrize(
    "layout",
    [Layout(mp=2), Layout(dp=2, mp=2), Layout(mp=2, sp=True), Layout(dp=2, cp=2, mp=2)],
    ids=lambda lay: lay.label(),
)
def test_int8_block_sharded_equals_unsharded_bit_for_bit(layout):
    rows = int8_rows(layout, jnp.float32)
    assert all(r["ok"] for r in rows), rows
    bitwise = [r for r in rows if "bit for bit" in r["detail"]]
    assert len(bitwise) == (4 if layout.dp * layout.cp == 1 else 2), rows


def test_quant_refuses_what_it_does_not_cover():
    """A mixture of experts is covered (tests/test_quant_experts.py), and pp (its micro-batches' scales,
    proven against the reference of the same micro-batches), but not the two together."""
    from meshlm.model.quant_fields import check_quant

    pp = Layout(dp=2, pp=2, microbatches=2)
    check_quant(get_config("tiny-llama").replace(quant="int8"), pp)
    with pytest.raises(ConfigError, match="--pp 2 on a mixture of experts: not proven"):
        check_quant(_moe().replace(quant="int8"), pp)
    with pytest.raises(ConfigError, match="quant must be one of"):
        get_config("cpu").replace(quant="int4")


def _moe():
    from meshlm.model.config import PRESETS

    return get_config(next(n for n in PRESETS if get_config(n).arch.moe))


BLOCK_CONTROLS = [c for c in QUANT_CONTROLS if c.by_int8_block and "expert" not in c.name]


@pytest.mark.parametrize("control", BLOCK_CONTROLS, ids=lambda c: c.name)
def test_each_int8_control_fails_the_bit_for_bit_check(control):
    """mp=2 with one data shard: every row is bitwise unplanted (the test above), so any failing row is
    the fault's."""
    rows = int8_rows(Layout(mp=2), jnp.float32, 0, control.par_cls, control.plant or nullcontext)
    assert not all(r["ok"] for r in rows), rows
    assert control.applies(_where(Layout(mp=2))) and not control.applies(_where(Layout(mp=2), "none"))


def _where(layout, quant="int8"):
    from meshlm.proof.control_record import Where

    return Where(cfg=get_config("cpu").replace(quant=quant), layout=layout, has_row_bias=False)


@pytest.mark.slow  # the int8 block's bit-for-bit test and each control's test above catch the same bugs
def test_verify_quant_int8_proves_tiny_llama_and_detects_its_controls(capsys):
    """docs/quantization.md's proof as written: the sharded int8 step equals the unsharded one in float64,
    the int8 block bit for bit, and the five int8 controls (with every other) detected."""
    code = run_cli(
        "verify", "--config", "tiny-llama", "--quant", "int8", "--mesh", "2x2", "--devices", "4", "--x64"
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "int8 block output (sharded vs unsharded)" in out and "bit for bit" in out
    for control in [*BLOCK_CONTROLS, *(c for c in QUANT_CONTROLS if not c.by_int8_block)]:
        assert f"control {control.name}" in out and "detected" in out.split(f"control {control.name}")[1][:60]


def test_verify_quant_int8_asks_for_float64(capsys):
    """float32's rounding moves values across quantization boundaries (docs/quantization.md): one line."""
    assert run_cli("verify", "--quant", "int8") == 2
    err = capsys.readouterr().err
    assert err.startswith("meshlm: error: --quant int8 is proven in float64") and "add --x64" in err


def test_bench_times_int8_beside_the_float_step(capsys, monkeypatch):
    """bench --quant int8 --impls meshlm,meshlm-int8: both steps from the same parameters and batch, their
    ratio, and the int8 row's MFU over the chip's spec int8 peak (394 TOP/s on a v5e) beside bf16's."""
    from test_bench import _bench_json

    import meshlm.perf.bench as bench

    monkeypatch.setattr(bench, "device_kind", lambda: "TPU v5 lite")  # a known chip's spec peaks
    argv = ["--config", "tiny-llama", "--mesh", "1x1", "--json", "--peak-n", "128", "--gen-tokens", "0"]
    report = _bench_json([*argv, "--impls", "meshlm,meshlm-int8", "--quant", "int8", "--warmup", "0"], capsys)
    assert report["impls"] == ["meshlm", "meshlm-int8"] and "meshlm-int8/meshlm" in report["step_time_ratios"]
    assert report["spec_peak_flops"] == {"bfloat16": 197e12, "int8": 394e12}
    ours, int8 = report["results"]
    assert ours["mfu_spec_int8"] is None and int8["mfu_spec_int8"] == pytest.approx(int8["mfu_spec"] / 2)
    assert int8["loss"] == pytest.approx(ours["loss"], rel=0.01) and int8["loss"] != ours["loss"]


def test_the_micro_batched_reference_splits_the_rows_as_the_pipeline():
    """Under pp the int8 reference is the mean over the pipeline's micro-batches (``mean_of_microbatches``):
    micro-batch j holds the j-th half of each dp shard's rows (as ``pipeline_engines`` splits a device's
    rows), and the mean is over the M micro-batches' values."""
    from meshlm.sharding.spmd import mean_of_microbatches

    rows = jnp.arange(8.0)[:, None]  # 2 dp shards of 4 rows, 2 micro-batches of 2 rows each per shard
    seen = mean_of_microbatches(lambda p, b: (b["x"][:, 0], p), 2, 2)(1.0, {"x": rows})
    np.testing.assert_array_equal(seen[0], [(0 + 2) / 2, (1 + 3) / 2, (4 + 6) / 2, (5 + 7) / 2])
    assert float(seen[1]) == 1.0


@pytest.mark.slow  # 110 s on 2 cores; quick: test_the_micro_batched_reference_splits_the_rows_as_the_pipeline
def test_int8_under_pp_equals_the_reference_of_its_micro_batches_and_its_control_shows():
    """pp 2 x dp 2, 1F1B on 2 micro-batches: the pipeline's int8 step (each micro-batch's weight-gradient
    scales its own, a pmax over dp) equals the unsharded int8 step's mean over the same micro-batches in
    float64; the int8 controls that apply are detected, the token max from one shard's rows by the
    values through the pipeline."""
    from meshlm.proof import model_problem
    from meshlm.proof.prover import verify

    cfg = get_config("tiny-llama").replace(quant="int8")
    layout = Layout(dp=2, pp=2, microbatches=2, pp_schedule="1f1b")
    with jax.enable_x64(True):
        problem = model_problem(cfg, "tiny-llama", layout, 4, 16)
        report = verify(problem, layout, dtype=jnp.float64, controls=QUANT_CONTROLS, pipeline_faults=())
    assert report.ok and max(p.max_rel_err for p in report.params) < 1e-14
    by = {c["name"]: c["by"] for c in report.controls if c["detected"]}
    assert by["int8 weight-gradient scale from this shard's tokens"] == "values" and len(by) == 3, by


def test_a_non_finite_value_reaches_the_int8_results():
    """A NaN or inf in a matmul's input makes its results non-finite, not a finite integer after the int8
    cast (the pipeline's bubbles are NaN: one let through must show, ``quant.step``); dense and expert.
    Each compiled as the step compiles it (jitted: one program each, not one per operation)."""
    from meshlm.model.moe import Experts

    x, w, ct = _random([(4, 8), (8, 6), (4, 6)])
    dense = jax.jit(
        lambda x, w, ct: _value_and_grads(lambda x, w: int8_dense(Parallel(), "col", x, w), x, w, ct)
    )
    for bad in (jnp.nan, jnp.inf):
        y, dx, dw = dense(x.at[1, 2].set(bad), w, ct)
        assert not np.isfinite(np.asarray(y)[1]).any() and not np.isfinite(np.asarray(dw)).all()
        assert np.isfinite(np.asarray(y)[[0, 2, 3]]).all()
    ids, cw = jnp.array([[0], [1], [0], [1]]), jnp.ones((4, 1))
    weights = _random([(2, 8, 6), (2, 8, 6), (2, 6, 8)], seed=2)
    experts = lambda x, *ws: Parallel().experts(
        x, ids, cw, Experts(*ws, "blocks", quant="int8", par=Parallel())
    )

    @jax.jit
    def experts_and_grads(x, *ws):
        y, vjp = jax.vjp(experts, x, *ws)
        return y, vjp(jnp.ones_like(y))

    y, grads = experts_and_grads(x.at[1, 2].set(jnp.nan), *weights)
    assert np.isnan(np.asarray(y)[1]).all() and np.isfinite(np.asarray(y)[[0, 2, 3]]).all()
    assert np.isnan(np.asarray(grads[1])[1]).any()  # expert 1's w_gate gradient: its NaN row's
