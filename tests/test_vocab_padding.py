"""Vocabulary padding: the embedding/head have ``padded_vocab`` rows, padded logits are masked out, so
loss and gradients equal the unpadded model's and the padding's gradients are exactly zero; old
configs load unpadded; users never see (or sample) a padded id; the proof catches unmasked padding."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.errors import ConfigError, ShardingError
from meshlm.generate.generator import Generator, logits_with_cache
from meshlm.io.checkpoint import Checkpointer
from meshlm.io.model_io import FORMAT, load_model, read_config
from meshlm.model.config import PRESETS, from_dict, get_config
from meshlm.model.padding import padding_of, resize_tree
from meshlm.model.transformer import logits_fn, loss_fn, param_shapes
from meshlm.parallel.context import Parallel
from meshlm.parallel.layout import Layout
from meshlm.parallel.mesh import make_mesh
from meshlm.proof import model_problem, verify
from meshlm.proof.controls import CONTROLS
from meshlm.sharding.rules import model_specs


def test_padded_vocab_and_old_configs():
    cfg = get_config("tiny-gpt2vocab")
    assert (cfg.vocab_size, cfg.vocab_multiple, cfg.padded_vocab) == (50257, 128, 50304)
    assert "tiny-gpt2vocab" in PRESETS
    assert get_config("tiny").padded_vocab == 128 and get_config("seed").padded_vocab == 256
    shapes = param_shapes(cfg)
    assert shapes["embed"]["embeddings"].shape == (50304, 32) and shapes["head"]["w"].shape == (32, 50304)
    old = {k: v for k, v in get_config("tiny").to_dict().items() if k != "vocab_multiple"}
    assert from_dict(old).vocab_multiple == 1 and from_dict(old).padded_vocab == 64  # saved before padding
    assert from_dict(get_config("tiny").to_dict()) == get_config("tiny")  # the field round-trips
    with pytest.raises(ConfigError, match="vocab_multiple"):
        cfg.replace(vocab_multiple=0)


@pytest.mark.parametrize("mp", [2, 4, 8, 16, 32, 64, 128])
def test_every_power_of_two_mp_divides_the_padding(mp):
    cfg = get_config("tiny").replace(vocab_size=50257)  # ff: no heads to split; d_ff = 128
    specs = model_specs(cfg, param_shapes(cfg), Layout(mp=mp))
    assert specs["embed"]["embeddings"] == jax.sharding.PartitionSpec("mp", None)


def test_mp_that_does_not_divide_the_padded_vocab_is_an_error():
    cfg = get_config("tiny-gpt2vocab").replace(vocab_multiple=1)  # 50257 rows: prime to every mp > 1
    with pytest.raises(
        ShardingError, match=r"\(size 50257\) is not divisible by mp=2: the padded vocabulary"
    ):
        model_specs(cfg, param_shapes(cfg), Layout(mp=2))
    cfg = get_config("tiny").replace(vocab_size=50257, d_ff=80)  # everything else divisible by 5
    with pytest.raises(
        ShardingError, match=r"\(size 50304\) is not divisible by mp=5: the padded vocabulary \(50257 ids"
    ):
        model_specs(cfg, param_shapes(cfg), Layout(mp=5))


def test_loss_and_gradients_equal_the_unpadded_model():
    """float64, unsharded: padded model == unpadded model on the stripped parameters, exactly where
    it matters; padded rows' gradients exactly 0. Tied embeddings: the table is both lookup and head
    (the untied gptj head is proven sharded by ``test_verify_padded_against_unpadded``)."""
    cfg = get_config("tiny-llama").replace(tie_embeddings=True)
    plain = cfg.replace(vocab_multiple=1)
    rng = np.random.default_rng(0)
    batch = {k: rng.integers(0, cfg.vocab_size, (2, 8)).astype(np.int32) for k in ("inputs", "targets")}
    with jax.enable_x64(True):
        loss = hk.without_apply_rng(hk.transform(loss_fn(cfg, Parallel())))
        params = jax.jit(lambda key: jax.tree.map(lambda p: p.astype(jnp.float64), loss.init(key, batch)))(
            jax.random.PRNGKey(0)
        )  # one program, not one per operation
        pads = padding_of(params, cfg.vocab_size)
        assert pads and all(not np.any(np.asarray(p)) for p in pads.values())  # zero at init
        params = jax.tree_util.tree_map_with_path(  # make the padding visible if it leaked
            lambda path, p: p + 1.0 if path[0].key in ("embed", "head") else p, params
        )
        ref = hk.without_apply_rng(hk.transform(loss_fn(plain, Parallel())))
        lp, gp = jax.jit(jax.value_and_grad(loss.apply))(params, batch)
        lr, gr = jax.jit(jax.value_and_grad(ref.apply))(resize_tree(params, cfg.vocab_size), batch)
        assert abs(float(lp) - float(lr)) <= 1e-12 * abs(float(lr))
        stripped = resize_tree(gp, cfg.vocab_size)
        for got, want in zip(jax.tree.leaves(stripped), jax.tree.leaves(gr), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
        assert all(not np.any(np.asarray(g)) for g in padding_of(gp, cfg.vocab_size).values())
        logits = jax.jit(hk.without_apply_rng(hk.transform(logits_fn(cfg, Parallel()))).apply)(
            params, batch["inputs"]
        )
        assert logits.shape == (2, 8, cfg.vocab_size)  # users never see the padding


def test_generation_never_picks_a_padded_id():
    """Padded head columns with the largest logits by far: still never sampled, logits stripped."""
    cfg = get_config("tiny")
    params = loss_fn_params(cfg)
    params["head"]["b"] = params["head"]["b"].at[cfg.vocab_size :].set(1e4)
    gen = Generator(cfg, params, make_mesh(1, 4))
    for temperature in (0.0, 1.0):
        out = gen.generate([[1, 2, 3], [4, 5]], 6, temperature=temperature)
        assert all(0 <= t < cfg.vocab_size for r in out for t in r.tokens)
    logits = logits_with_cache(gen, np.array([[1, 2, 3, 4], [5, 6, 7, 8]]), np.array([2, 3]))
    assert [x.shape for x in logits] == [(3, cfg.vocab_size), (2, cfg.vocab_size)]


def loss_fn_params(cfg):
    example = {k: jnp.zeros((1, 8), jnp.int32) for k in ("inputs", "targets")}
    return hk.transform(loss_fn(cfg, Parallel())).init(jax.random.PRNGKey(0), example)


def test_old_checkpoint_loads_unpadded(tmp_path):
    """A checkpoint whose config predates the field: vocab 64 rows, exactly as saved."""
    cfg = get_config("tiny").replace(vocab_multiple=1)
    params = loss_fn_params(cfg)
    meta = {k: v for k, v in cfg.to_dict().items() if k != "vocab_multiple"}
    with Checkpointer(tmp_path / "run", keep=1) as ckpt:
        ckpt.save(0, {"params": params}, {"format": FORMAT, "model_config": meta})
    assert read_config(tmp_path / "run")[0] == cfg
    got_cfg, got, _ = load_model(tmp_path / "run", make_mesh(1, 4))
    assert got_cfg == cfg and got["embed"]["embeddings"].shape == (64, cfg.d_model)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# mp 2 quick; 4 and 8 slow: the same proof on more shards (scale)
@pytest.mark.parametrize(
    "mp", [2, pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)]
)
def test_verify_padded_against_unpadded(mp):
    """The proof on GPT-2's vocabulary: padded sharded == unpadded reference (float64, <= 1e-12), the
    padding's gradients exactly 0, and the planted *padded logits not masked* detected."""
    cfg = get_config("tiny-gpt2vocab")
    problem = model_problem(cfg, "tiny-gpt2vocab", mp, 2, 8, seed=0)
    assert problem.reference_loss is not None
    controls = tuple(c for c in CONTROLS if c.name == "padded logits not masked")
    with jax.enable_x64(True):
        report = verify(problem, make_mesh(1, mp), dtype=jnp.float64, controls=controls)
    assert report.ok, report.to_json()
    assert max(p.max_rel_err for p in report.params) <= 1e-12
    assert [c["name"] for c in report.controls] == ["padded logits not masked"]
    padding = [c for c in report.checks if c["name"] == "vocabulary padding inert"]
    assert padding and padding[0]["ok"], padding
    shapes = {p.path: p.shape for p in report.params}
    assert shapes["embed/embeddings"] == (50304, 32)
