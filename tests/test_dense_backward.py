"""The weight matmul's two backwards (``model.dense``): the 2-D one XLA:CPU runs, and JAX's own, which
every other platform (the TPU) runs. The CPU's proofs run the first unless ``MESHLM_DENSE_BACKWARD``
says otherwise; here the TPU's backward is proven on CPU: the same float64 gradients as the 2-D one,
and ``meshlm verify --x64`` passes with it (sharded against unsharded, its controls detected)."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_cli

from meshlm.errors import ConfigError
from meshlm.model.config import get_config
from meshlm.model.dense import ENV, backward_kind
from meshlm.parallel.context import Parallel
from meshlm.parallel.layout import Layout
from meshlm.train.step import init_model, loss_fn


def _grads(kind: str, seed: int, monkeypatch):
    monkeypatch.setenv(ENV, kind)
    cfg = get_config("tiny-llama")
    layout = Layout.of(jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("dp", "mp")))
    params, _ = init_model(cfg, layout, 0, dtype=jnp.float64)
    rng = np.random.default_rng(seed)
    batch = {
        k: jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 16)), jnp.int32) for k in ("inputs", "targets")
    }
    apply = hk.without_apply_rng(hk.transform(loss_fn(cfg, Parallel(), False))).apply
    return jax.jit(jax.grad(apply))(params, batch)  # traced here, under ``kind``: one program, as a step


def test_jax_backward_equals_the_2d_one_in_float64(monkeypatch):
    with jax.enable_x64(True):
        g2d, gjax = _grads("2d", 0, monkeypatch), _grads("jax", 0, monkeypatch)
        other = _grads("jax", 1, monkeypatch)
    for a, b in zip(jax.tree.leaves(g2d), jax.tree.leaves(gjax), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-12, atol=1e-14)
    # and the check can fail: another batch's gradients differ
    assert any(
        not np.allclose(a, b) for a, b in zip(jax.tree.leaves(gjax), jax.tree.leaves(other), strict=True)
    )


def test_verify_proves_the_tpus_backward_on_cpu(monkeypatch, capsys):
    monkeypatch.setenv(ENV, "jax")
    argv = ("verify", "--config", "tiny", "--mesh", "1x2", "--seq-len", "8", "--x64", "--no-collectives")
    was = jax.config.jax_enable_x64
    try:
        assert run_cli(*argv) == 0, capsys.readouterr().err
    finally:  # verify --x64 turns float64 on for the process: the worker's next tests must not inherit it
        jax.config.update("jax_enable_x64", was)


def test_the_platform_picks_the_backward_and_a_bad_override_is_refused(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert backward_kind() == ("2d" if jax.default_backend() == "cpu" else "jax")
    monkeypatch.setenv(ENV, "transposed")
    with pytest.raises(ConfigError, match="MESHLM_DENSE_BACKWARD='transposed' is not a dense backward"):
        backward_kind()
