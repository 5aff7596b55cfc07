"""A flat cache's values (``attention._flat_out``): the matmul kept apart from its head selection by an
optimization barrier (``MESHLM_FLAT_VALUES`` "apart", the default) or left to XLA to fuse ("fused", the
program before: on a TPU at batch 1 the fused form copied each layer's values transposed every decode
step, docs/benchmarks.md "Decode: the values apart"). Both are the heads' form's values; the barrier is
in the program exactly when asked; a generation draws the same tokens either way; a bad value is one
line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_generate import PROMPTS, host_params

from meshlm.errors import ConfigError
from meshlm.generate.generator import Generator
from meshlm.model import attention
from meshlm.model.config import get_config
from meshlm.parallel.mesh import make_mesh

B, KV, G, T, S, EV = 2, 3, 2, 1, 24, 8  # a decode step's one query a row, 3 KV heads of 2 queries each


def _case(seed=0):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    probs = jax.nn.softmax(jax.random.normal(k1, (B, KV, G, T, S), jnp.float64), axis=-1)
    return probs, jax.random.normal(k2, (B, S, KV * EV), jnp.float64)


def _program(probs, v):  # a new function each time: jit's trace is cached by function and shapes
    return jax.jit(lambda p, x: attention._flat_out(p, x)).lower(probs, v).as_text()


@pytest.mark.parametrize("mode", ["apart", "fused"])
def test_flat_values_are_the_heads_form_values(monkeypatch, mode):
    monkeypatch.setenv(attention.VALUES_ENV, mode)
    with jax.enable_x64(True):
        probs, v = _case()
        got = jax.jit(attention._flat_out)(probs, v)  # [B, T, KV, G, EV]
        heads = v.reshape(B, S, KV, EV)
        want = jnp.einsum("bkgts,bske->btkge", probs, heads)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-13, atol=1e-15)
        other = jnp.einsum("bkgts,bske->btkge", probs, jnp.roll(heads, 1, axis=2))  # each head's own block
        assert np.abs(np.asarray(got) - np.asarray(other)).max() > 1e-3


def test_the_barrier_is_in_the_program_exactly_when_apart(monkeypatch):
    probs, v = (x.astype(jnp.float32) for x in _case())
    monkeypatch.delenv(attention.VALUES_ENV, raising=False)
    assert "optimization_barrier" in _program(probs, v)  # the default
    monkeypatch.setenv(attention.VALUES_ENV, "fused")
    assert "optimization_barrier" not in _program(probs, v)
    monkeypatch.setenv(attention.VALUES_ENV, "together")
    with pytest.raises(ConfigError, match="MESHLM_FLAT_VALUES='together': use apart or fused"):
        _program(probs, v)


def test_a_generation_draws_the_same_tokens_apart_and_fused(monkeypatch):
    """Inside shard_map over dp x mp, one row a batch (where the barrier matters on a chip) and two."""
    cfg, params, mesh = get_config("tiny-llama"), host_params("tiny-llama"), make_mesh(2, 2)
    tokens, programs = {}, {}
    for mode in ("apart", "fused"):
        monkeypatch.setenv(attention.VALUES_ENV, mode)
        gen = Generator(cfg, params, mesh, eod=None)
        tokens[mode] = [[r.tokens for r in gen.generate(p, 9)] for p in (PROMPTS[:1], PROMPTS[:2])]
        programs[mode] = gen._prog
    assert tokens["apart"] == tokens["fused"]
    assert programs["apart"] is not programs["fused"]  # each mode's own programs, traced under it
