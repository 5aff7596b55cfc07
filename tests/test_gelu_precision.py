"""The tanh GELU (``layers.gelu_tanh``: Gemma's MLPs, Gemma 4's per-layer inputs, GPT-J's) keeps its
relative precision in float32 where x < 0. A norm after it (Gemma's post-MLP norm, Gemma 4's per-layer
input norm) rescales small outputs to unit size, so their relative error reaches the logits:
``jax.nn.gelu(x, approximate=True)``'s 1 + tanh(u) cancels there (4e-3 off on [-4, 0), torch's 7e-4),
and Gemma 4's float32 logits were 2.5e-5 off float64 by it (tests/test_hf_gemma4.py)."""

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.model.layers import gelu_tanh

X = np.linspace(-4, 4, 8001)


def _exact(x):
    """0.5 x (1 + tanh(u)) in float64 as x / (1 + exp(-2u)) (the tanh form cancels in float64 too)."""
    return x / (1 + np.exp(-2 * np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def test_float32_relative_error_where_negative():
    """Mutant caught: ``gelu_tanh`` as ``jax.nn.gelu(x, approximate=True)`` (4e-3 here)."""
    x = X.astype(np.float32)
    got = np.asarray(jax.jit(gelu_tanh)(x), np.float64)
    want = _exact(x.astype(np.float64))
    neg = x < 0
    assert np.max(np.abs(got - want)[neg] / np.abs(want)[neg]) < 1e-5
    assert np.max(np.abs(got - want)) < 1e-6  # and absolutely everywhere


def test_the_tanh_form_in_float64_and_dtype_kept():
    """The same function as transformers' 0.5 x (1 + tanh(u)) (float64, where the tanh form does not
    cancel to 0: 1e-10); bf16 stays bf16, and the gradient is finite far in the tail (exp(-2u) overflows)."""
    with jax.enable_x64(True):
        got = np.asarray(gelu_tanh(jnp.asarray(X)))
    u = np.sqrt(2 / np.pi) * (X + 0.044715 * X**3)
    assert np.allclose(got, 0.5 * X * (1 + np.tanh(u)), rtol=1e-10)  # its own cancellation: 3e-12 at -4
    assert gelu_tanh(jnp.ones(2, jnp.bfloat16)).dtype == jnp.bfloat16
    tail = jnp.asarray([-30.0, -15.0, 30.0], jnp.float32)
    assert bool(jnp.all(jnp.isfinite(jax.vmap(jax.grad(gelu_tanh))(tail))))
