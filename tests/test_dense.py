"""model.dense: the weight matmul with its hand-written backward equals JAX's own matmul and its
autodiff gradients (float64, tight tolerance), for plain and per-head shapes, and keeps dtypes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.model.dense import dense, dense_heads_in, dense_heads_out


def _value_and_grads(fn, x, w, ct):
    out, vjp = jax.vjp(fn, x, w)
    return (out, *vjp(ct))


def _random(shapes, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [jax.random.normal(k, s, dtype) for k, s in zip(keys, shapes, strict=True)]


@pytest.mark.parametrize(
    ("ours", "reference", "x_shape", "w_shape", "out_shape"),
    [
        (dense, jnp.matmul, (3, 5, 7), (7, 4), (3, 5, 4)),
        (dense, jnp.matmul, (6, 7), (7, 9), (6, 9)),
        (dense_heads_in, lambda x, w: jnp.einsum("btd,dhe->bthe", x, w), (2, 5, 8), (8, 3, 4), (2, 5, 3, 4)),
        (dense_heads_out, lambda x, w: jnp.einsum("bthe,hed->btd", x, w), (2, 5, 3, 4), (3, 4, 8), (2, 5, 8)),
    ],
)
def test_dense_equals_autodiff_float64(ours, reference, x_shape, w_shape, out_shape):
    with jax.enable_x64(True):
        x, w, ct = _random([x_shape, w_shape, out_shape], jnp.float64)
        got = _value_and_grads(ours, x, w, ct)
        want = _value_and_grads(reference, x, w, ct)
        for name, a, b in zip(("value", "dx", "dw"), got, want, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype, name
            np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13, err_msg=name)
        # a different cotangent gives different gradients: the check above is not vacuous
        other = _value_and_grads(ours, x, w, ct + 1.0)
        assert not np.allclose(other[2], got[2])


def test_dense_keeps_bfloat16_and_jits():
    x, w, ct = _random([(4, 8, 16), (16, 32), (4, 8, 32)], jnp.bfloat16, seed=1)
    out, dx, dw = jax.jit(lambda x, w, ct: _value_and_grads(dense, x, w, ct))(x, w, ct)
    assert (out.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16,) * 3
    ref = _value_and_grads(jnp.matmul, x.astype(jnp.float32), w.astype(jnp.float32), ct.astype(jnp.float32))
    for a, b in zip((out, dx, dw), ref, strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=0.05, atol=0.5)


def test_dense_off_cpu_is_jaxs_own_matmul():
    """Compiled for a TPU (or GPU) the weight matmul is JAX's own, its backward JAX's transpose: no
    custom VJP and no barrier (on XLA:TPU they kept more activations alive, ``model.dense``)."""
    from meshlm.parallel.compile_target import compiling_for

    x, w = jnp.zeros((2, 3, 4)), jnp.zeros((4, 5))
    grads = lambda: jax.make_jaxpr(jax.grad(lambda x, w: dense(x, w).sum(), (0, 1)))(x, w)
    with compiling_for("tpu"):
        off = str(grads())
    assert "optimization_barrier" not in off and "custom_vjp" not in off
    assert "optimization_barrier" in str(grads())  # on CPU: the 2-D backward, behind its barrier


def test_tpu_dense_pads_few_rows_to_the_matrix_unit():
    """Traced for a TPU, a matmul of fewer than ``MXU_ROWS`` rows (a decode step at batch < 8) is padded
    to them (XLA:TPU's vector multiply-reduce otherwise) and gives the rows' own results (up to the
    summation order of another matmul kernel); 8 rows or more are the plain matmul."""
    from meshlm.model.dense import MXU_ROWS, dense
    from meshlm.parallel.compile_target import compiling_for

    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((16, 24)), jnp.float32)
    for rows in (1, 3, MXU_ROWS):
        x = jnp.asarray(rng.standard_normal((rows, 1, 16)), jnp.float32)  # [B, T=1, K]
        with compiling_for("tpu"):
            jaxpr = str(jax.make_jaxpr(dense)(x, w))
            got = dense(x, w)
        assert ("pad" in jaxpr) == (rows < MXU_ROWS), rows
        np.testing.assert_allclose(np.asarray(got), np.asarray(x @ w), rtol=1e-5, atol=1e-5)
