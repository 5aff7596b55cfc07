"""Parameter initialisation traces the Haiku forward once per model config, and its values are the bits of
the program that traced it twice (init_sharded's eval_shape, then its own jit; the proof's likewise)."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.errors import MeshError, ShardingError
from meshlm.model.config import PRESETS, get_config
from meshlm.model.transformer import init_fn, loss_fn
from meshlm.parallel.context import Parallel
from meshlm.parallel.layout import Layout
from meshlm.parallel.mesh import make_mesh
from meshlm.proof.problem import model_problem
from meshlm.proof.runs import _init
from meshlm.sharding.rules import model_specs, shardings
from meshlm.train.step import init_model


def _same_bits(new, old, placed=True):
    """Equal trees, leaf by leaf the same dtype, bits and (``placed``) sharding."""
    assert jax.tree.structure(new) == jax.tree.structure(old)

    def check(path, a, b):
        assert a.dtype == b.dtype and (not placed or a.sharding == b.sharding), jax.tree_util.keystr(path)
        # bitwise (as unsigned integers of the same width): -0.0 and 0.0 differ, as would two NaNs
        bits = lambda x: np.asarray(x).view(f"u{np.dtype(x.dtype).itemsize}")
        assert np.array_equal(bits(a), bits(b)), jax.tree_util.keystr(path)

    jax.tree_util.tree_map_with_path(check, new, old)


def _old_init_model(cfg, layout, seed, dtype=None):
    """init_model as it was: a fresh Haiku init, traced by eval_shape and again by the sharded jit."""
    init = hk.transform(loss_fn(cfg, Parallel())).init
    t = min(cfg.max_seq_len, 8)
    example = {k: jnp.zeros((1, t), jnp.int32) for k in ("inputs", "targets")}
    key = jax.random.PRNGKey(seed)
    specs = model_specs(cfg, jax.eval_shape(init, key, example), layout)
    cast = (lambda p: p) if dtype is None else (lambda p: p.astype(dtype))
    out = shardings(specs, layout.mesh)
    return jax.jit(lambda k, b: jax.tree.map(cast, init(k, b)), out_shardings=out)(key, example)


# slow: FSDP's shardings and experts' leaves, the same init path (its bug class: tiny-llama on 2x2, quick)
@pytest.mark.parametrize(
    "name,mesh,kw",
    [
        ("tiny-llama", (2, 2), {}),
        pytest.param("tiny-llama", (2, 2), {"fsdp": True}, marks=pytest.mark.slow),  # weights split over dp
        pytest.param("tiny-mixtral", (1, 4), {}, marks=pytest.mark.slow),  # experts
    ],
)
def test_init_model_bits_equal_the_twice_traced_program(name, mesh, kw):
    cfg = get_config(name)
    layout = Layout.of(make_mesh(*mesh), **kw)
    new, _ = init_model(cfg, layout, 5)
    _same_bits(new, _old_init_model(cfg, layout, 5))
    again, _ = init_model(cfg, layout, 5)  # the memoised init's second use
    _same_bits(again, new)


# slow: test_init_model_bits_equal_the_twice_traced_program catches the same bug class (a change to how
# init is traced that changes its bits) on dense, FSDP and expert models; this sweeps every tiny family.
@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in PRESETS if n.startswith("tiny-")])
def test_every_tiny_presets_init_bits_equal_the_twice_traced_program(name):
    cfg = get_config(name)
    for mesh in ((2, 2), (1, 2), (1, 1)):  # the first the model's dimensions admit
        layout = Layout.of(make_mesh(*mesh))
        try:
            new, _ = init_model(cfg, layout, 11)
        except (ShardingError, MeshError):
            continue
        _same_bits(new, _old_init_model(cfg, layout, 11))
        return
    pytest.fail(f"{name} fits no mesh tried")


def test_a_configs_init_function_is_one_object_and_other_configs_get_their_own():
    cfg = get_config("tiny-llama")
    assert init_fn(cfg)[0] is init_fn(cfg.replace())[0]  # equal configs: one traced forward
    assert init_fn(cfg)[0] is not init_fn(cfg.replace(n_layers=3))[0]


def test_the_proofs_init_bits_equal_the_twice_traced_program():
    cfg = get_config("tiny-gemma3")  # local and global layers
    problem = model_problem(cfg, "tiny-gemma3", 2, 4, 8, dp=2)
    mesh = make_mesh(2, 2)
    params, _ = _init(problem, mesh, jnp.float32, 3)
    init = hk.transform(problem.build_loss(Parallel())).init
    example = jax.tree.map(lambda v: jnp.asarray(v)[:1], problem.batch)
    old = jax.jit(lambda k, b: init(k, b))(jax.random.PRNGKey(3), example)
    _same_bits(params, old, placed=False)  # the proof lays its host values out by the specs itself
