"""``scripts/int8_hlo.py`` (the roofline of the int8 and bf16 steps' optimized HLO, issue 65 item 3):
its reading of an HLO module's text -- a dot's FLOPs, an int8 dot's apart, the bytes of each top-level
instruction, the int32 results written to memory -- on a tiny program compiled by this host's XLA."""

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("int8_hlo", ROOT / "scripts" / "int8_hlo.py")
int8_hlo = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = int8_hlo  # its dataclass looks its module up
_spec.loader.exec_module(int8_hlo)


def test_the_roofline_counts_each_dots_flops_and_an_int32_result():
    def f(a, b, qa, qb):
        acc = lax.dot_general(qa, qb, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
        return a @ b, acc  # [64, 16] f32, [64, 16] s32 (returned: written to memory)

    args = (
        jnp.ones((64, 32)),
        jnp.ones((32, 16)),
        jnp.ones((64, 32), jnp.int8),
        jnp.ones((32, 16), jnp.int8),
    )
    costs = int8_hlo.step_costs(jax.jit(f).lower(*args).compile().as_text())
    assert sum(c.flops for c in costs) == 2 * 64 * 32 * 16  # the float dot
    assert sum(c.int8_flops for c in costs) == 2 * 64 * 32 * 16  # the int8 one, counted apart
    assert any(k.startswith("s8xs8->s32") for c in costs for k in c.matmuls)
    assert sum(c.bytes for c in costs) >= 4 * (64 * 32 + 32 * 16 + 64 * 16) + 64 * 32 + 32 * 16 + 4 * 64 * 16
    lines = int8_hlo.report({"int8": costs}, (1e12, 2e12, 1e11), top=2)
    assert "int32 arrays written to memory (> 64 KiB): 0" in lines[2]  # 4 KiB: under the report's floor
    assert int8_hlo.shape_bytes("(s32[64,16]{1,0}, bf16[8]{0:T(1024)S(1)})", hbm=True) == 4 * 64 * 16


def test_one_matmul_compiles_three_int8_dots_against_three_float_ones():
    """``--matmul N,K,M`` (one weight matmul's forward and backward): the bf16 program's three matmuls
    are float, the int8 one's int8 (forward, dx, dw), each 2 N K M FLOPs."""
    texts = int8_hlo.matmul_steps(64, 32, 16, chip=None)
    flops = {name: int8_hlo.step_costs(text) for name, text in texts.items()}
    assert sum(c.flops for c in flops["bf16"]) == 3 * 2 * 64 * 32 * 16
    int8, wide = sum(c.int8_flops for c in flops["int8"]), sum(c.flops for c in flops["int8"])
    # XLA:CPU widens one of the three to an s32 dot (tests/test_quant.py's first test); a TPU keeps three
    assert int8 + wide == 3 * 2 * 64 * 32 * 16 and int8 >= 2 * 2 * 64 * 32 * 16
