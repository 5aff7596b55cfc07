"""The decode step's KV-cache write: the Pallas kernel (interpret mode here) writes exactly what XLA's
scatter writes, a planted wrong row or slot is caught, the TPU trace picks the kernel, and a
generation with the kernel draws the scatter's tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_generate import PROMPTS, host_params

from meshlm.errors import ConfigError
from meshlm.generate.generator import Generator
from meshlm.model import cache_kernel
from meshlm.model.cache_kernel import KV_WRITE_ENV, kernel_write, scatter_write, write_rows
from meshlm.model.config import get_config
from meshlm.parallel.compile_target import compiling_for
from meshlm.parallel.mesh import make_mesh

L, B, S, F = 3, 4, 32, 40  # F not a multiple of 128: a flat cache of 5 heads of 8
# slots: a tile's first and last, the next tile's first, S's last, and one past S (dropped, as a scatter)
AT = np.array([[0], [7], [8], [31]], np.int32)


def _case(dtype, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed))
    stack = jax.random.normal(keys[0], (L, B, S, F)).astype(dtype)
    return stack, jax.random.normal(keys[1], (B, 1, F)).astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("at", [AT, np.array([[3], [32], [16], [24]], np.int32)])
def test_kernel_writes_what_the_scatter_writes(dtype, at):
    stack, x = _case(dtype)
    index = jnp.int32(1)  # traced, as in the layer scan
    want = jax.jit(scatter_write)(stack, index, at, x)
    got = jax.jit(kernel_write)(stack, index, at, x)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    changed = np.asarray(got != stack)  # the control that the case writes at all: B rows (less a drop)
    assert changed.sum() == F * np.sum(at < S) and changed[1].all(axis=-1).sum() == np.sum(at < S)


@pytest.mark.parametrize("plant", ["row", "slot"])
def test_a_wrong_row_or_slot_is_caught(plant):
    """Controls: the comparison above fails for a kernel writing the wrong row's token, or one slot off."""
    stack, x = _case(jnp.float32, seed=1)
    want = scatter_write(stack, 2, AT, x)
    x_bad, at_bad = (x[::-1], AT) if plant == "row" else (x, AT + 1)
    got = kernel_write(stack, 2, at_bad, x_bad)
    assert not np.array_equal(np.asarray(got), np.asarray(want))


def test_the_tpu_trace_writes_a_decode_step_by_the_kernel(monkeypatch):
    stack, x = _case(jnp.bfloat16)

    def prims(x, at):  # a new function each time: make_jaxpr's trace is cached by function and shapes
        return {e.primitive.name for e in jax.make_jaxpr(lambda *a: write_rows(*a))(stack, 0, at, x).eqns}

    with compiling_for("tpu"):  # tracing only: no TPU needed
        assert "meshlm_kv_write" in prims(x, AT)
        two = jnp.concatenate([x, x], axis=1)  # two tokens a row (a speculative check): the scatter
        assert "scatter" in prims(two, np.concatenate([AT, AT + 1], 1).clip(max=S - 1))
        monkeypatch.setenv(KV_WRITE_ENV, "scatter")
        assert "meshlm_kv_write" not in prims(x, AT)
    monkeypatch.delenv(KV_WRITE_ENV)
    assert "meshlm_kv_write" not in prims(x, AT)  # this host: the scatter
    assert not cache_kernel.kernel_fits(jnp.zeros((1, 1, 12, 8)))  # slots not whole tiles
    monkeypatch.setenv(KV_WRITE_ENV, "kernels")
    with pytest.raises(ConfigError, match="MESHLM_KV_WRITE='kernels'"):
        write_rows(stack, 0, AT, x)


def test_generation_with_the_kernel_draws_the_scatter_tokens(monkeypatch):
    """Every decode step's cache write by the kernel (interpret mode, inside shard_map over dp x mp):
    the greedy tokens are the scatter's. (test_generate proves the scatter's against the unsharded
    model.)"""
    cfg, params, mesh = get_config("tiny-llama"), host_params("tiny-llama"), make_mesh(2, 2)
    want = Generator(cfg, params, mesh, eod=None).generate(PROMPTS, 9)
    monkeypatch.setenv(KV_WRITE_ENV, "kernel")
    traced = []  # the control that the kernel ran: its writes, as traced
    monkeypatch.setattr(cache_kernel, "kernel_write", lambda *a: traced.append(1) or kernel_write(*a))
    got = Generator(cfg, params, mesh, eod=None).generate(PROMPTS, 9)
    assert [r.tokens for r in got] == [r.tokens for r in want] and traced
