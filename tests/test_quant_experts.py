"""--quant int8 on a mixture of experts (model.quant_experts): the expert matmuls lower to s8 x s8 -> s32
dots in every dispatch, each dispatch equals the "dense" reference bit for bit, and the int8 experts'
check (proof.quant_experts_exact) holds sharded over ep, mp and the data shards and catches the expert
controls."""

import re
from contextlib import nullcontext

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.errors import ConfigError
from meshlm.model.config import get_config
from meshlm.model.moe import Experts
from meshlm.parallel.context import Parallel
from meshlm.parallel.layout import Layout
from meshlm.proof.control_record import Where
from meshlm.proof.quant_controls import QUANT_CONTROLS
from meshlm.proof.quant_experts_exact import expert_rows

E, N, D, H = 4, 24, 16, 8  # experts, tokens, width, hidden units


def _inputs(k: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(N, D)) * np.where(rng.random((N, 1)) < 0.25, 16, 1), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(N)]), jnp.int32)
    cw = jnp.asarray(rng.uniform(0.5, 1.5, (N, k)), jnp.float32)
    ws = [jnp.asarray(rng.normal(size=s) / 4, jnp.float32) for s in ((E, D, H), (E, D, H), (E, H, D))]
    return x, ids, cw, ws, jnp.asarray(rng.normal(size=(N, D)), jnp.float32)


def _value_and_grads(dispatch: str, quant: str, k: int = 1, cap: int = 0):
    """(y, dx, dcw, dw_gate, dw_up, dw_down) of the experts on ``_inputs(k)``, all local."""
    x, ids, cw, ws, ct = _inputs(k)
    par = Parallel()

    def fn(x, cw, *ws):
        return par.experts(x, ids, cw, Experts(*ws, dispatch, cap, quant=quant, par=par))

    out, vjp = jax.vjp(fn, x, cw, *ws)
    return [out, *vjp(ct)]


@pytest.mark.parametrize("dispatch", ["blocks", "ragged_dot", "dense"])
def test_int8_experts_lower_to_s8_dots_with_s32_accumulators(dispatch):
    """Forward, dx and dw of the gate/up pair (one matmul) and of down: six dots s8 x s8 -> s32, and no
    float dot of an expert weight (the dense reference's combine is a float dot of the outputs)."""
    text = jax.jit(lambda: _value_and_grads(dispatch, "int8")).lower().as_text()
    dots = [line for line in text.splitlines() if re.search(r"stablehlo\.(dot_general|ragged_dot)", line)]
    int8 = r"\(tensor<[0-9x]+xi8>, tensor<[0-9x]+xi8>(, tensor<[0-9x]+xi32>)?\) -> tensor<[0-9x]+xi32>"
    assert len([line for line in dots if re.search(int8, line)]) == 6, dots
    weights = (f"{E}x{D}x{H}xf32", f"{E}x{H}x{D}xf32")
    assert not [line for line in dots if any(w in line for w in weights)], dots


@pytest.mark.parametrize(
    "dispatch,k,cap", [("blocks", 1, 0), ("ragged_dot", 1, 0), ("blocks", 2, 0), ("blocks", 1, N)]
)
def test_each_dispatch_equals_the_dense_reference_and_approximates_float(dispatch, k, cap):
    """One choice per token: the combine is one product, so every dispatch's int8 experts equal the dense
    reference's bit for bit (their int32 sums and scales are the same; padding and unchosen rows carry no
    gradient). Two: the combine's float sums may round apart, nothing more. Against float: 1-2%. (``cap``:
    the capacity's slots [E, cap, D], here room for every choice.)"""
    run = lambda how, quant: jax.jit(lambda: _value_and_grads(how, quant, k, cap))()
    got, want, flt = run(dispatch, "int8"), run("dense", "int8"), run("dense", "none")
    for a, b, f in zip(got, want, flt, strict=True):
        if k == 1:
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(b))))
        rel = float(jnp.linalg.norm(a - f) / jnp.linalg.norm(f))
        assert 1e-4 < rel < 0.03, rel


@pytest.mark.parametrize(
    "layout,dispatch",
    [(Layout(dp=2, ep=2, mp=2), "blocks"), (Layout(dp=4, ep=2), "ragged_dot")],
    ids=["2x2+EP2 blocks", "4x1+EP2 ragged_dot"],
)
def test_int8_experts_sharded_equal_unsharded_bit_for_bit(layout, dispatch):
    """ep with mp: everything bit for bit (each expert's rows on its ep shard); ep inside dp 4: the expert
    weights' gradients are summed over the 2 data shards outside ep, within the float sum's bound."""
    rows = expert_rows(layout, jnp.float32, dispatch)
    assert all(r["ok"] for r in rows), rows
    bitwise = [r for r in rows if "bit for bit" in r["detail"]]
    assert len(bitwise) == (5 if layout.dp == layout.ep else 2), rows


EXPERT_CONTROLS = [c for c in QUANT_CONTROLS if "expert" in c.name]


@pytest.mark.parametrize("control", EXPERT_CONTROLS, ids=lambda c: c.name)
def test_each_expert_control_fails_the_int8_experts_check(control):
    """Each where it applies and only there: the local rows' max with data shards outside ep (dp 4, ep 2),
    the max over other shards' experts with ep (dp 2 = ep: each expert's rows on one shard)."""
    layout = Layout(dp=4, ep=2) if "this shard's rows" in control.name else Layout(dp=2, ep=2)
    rows = expert_rows(layout, jnp.float32, "blocks", 0, control.par_cls, control.plant or nullcontext)
    assert not all(r["ok"] for r in rows), rows
    moe = get_config("tiny-qwen3-moe")
    assert control.applies(Where(cfg=moe.replace(quant="int8"), layout=layout, has_row_bias=False))
    assert not control.applies(Where(cfg=moe, layout=layout, has_row_bias=False))
    assert not control.applies(Where(cfg=moe.replace(quant="int8"), layout=Layout(mp=2), has_row_bias=False))


def test_int8_experts_accepted_and_gmm_refused():
    moe = get_config("tiny-qwen3-moe")
    assert moe.replace(quant="int8").quant == "int8"
    with pytest.raises(ConfigError, match="--moe-dispatch gmm: its Pallas kernel multiplies bfloat16"):
        moe.replace(quant="int8", moe_dispatch="gmm")


@pytest.mark.slow  # 12 min on 2 loaded cores; quick: the expert block and control tests above
def test_verify_quant_int8_proves_tiny_qwen3_moe_over_ep(capsys):
    """docs/quantization.md's MoE proof as written: the sharded int8 step (the blocks dispatch over ep 2
    with mp 2) equals the unsharded one in float64, the int8 experts bit for bit, every control that
    applies detected (the block scan's own weight-gradient fault skipped: int8 runs its own scan)."""
    from helpers import run_cli

    argv = ["verify", "--config", "tiny-qwen3-moe", "--quant", "int8", "--mesh", "2x2", "--ep", "2"]
    import jax

    was = jax.config.jax_enable_x64
    try:
        code = run_cli(*argv, "--devices", "4", "--x64")
    finally:  # verify --x64 turns float64 on for the process: the worker's next tests must not inherit it
        jax.config.update("jax_enable_x64", was)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "check int8 experts output (blocks sharded vs dense unsharded) PASS  (bit for bit)" in out
    assert "int8 expert scale over other shards' experts detected" in out and "NOT DETECTED" not in out
