"""The chunked cross-entropy (``--loss-chunk``, ``model.chunked_xent``): in float64 the loss and every
gradient equal the whole [B, T, V] logits' loss (a chunk that does not divide the tokens, a tied and
soft-capped head, z-loss, a padded vocabulary, the SFT loss's weights); ``meshlm verify --x64`` proves it
sharded (its reference runs the whole loss) and detects the planted faults; the compiled step's
temporaries shrink and it runs the whole loss's three head matmuls (its gradients computed in the
forward); what it does not chunk (MTP) is refused in one line."""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.errors import ConfigError
from meshlm.model.config import get_config
from meshlm.model.transformer import init_fn, loss_fn
from meshlm.parallel.context import Parallel

TOL = 1e-12


def _loss_and_grads(cfg, params, batch):
    apply = hk.without_apply_rng(hk.transform(loss_fn(cfg, Parallel()))).apply
    return jax.jit(jax.value_and_grad(apply))(params, batch)


def _batch(cfg, rows: int, t: int, weights: bool):
    rng = np.random.default_rng(1)
    ids = lambda: jnp.asarray(rng.integers(0, cfg.vocab_size, (rows, t)), jnp.int32)
    batch = {"inputs": ids(), "targets": ids()}
    if weights:  # the SFT loss's step-normalized weights (``model.masked``)
        mask = rng.integers(0, 2, (rows, t)).astype(np.float64)
        batch["weights"] = jnp.asarray(mask * mask.size / mask.sum())
    return batch


@pytest.mark.parametrize(
    ("preset", "changes", "weights"),
    [
        ("tiny-lm", dict(z_loss=1e-2, vocab_size=250), True),  # untied; padded vocabulary; SFT weights
        # slow: the tied, capped head (its chunked path is the untied one's on the table: the quick case)
        pytest.param("tiny-gemma-softcap", {}, False, marks=pytest.mark.slow),
    ],
)
def test_chunked_loss_and_every_gradient_equal_the_whole_loss_in_float64(preset, changes, weights):
    with jax.enable_x64(True):
        cfg = get_config(preset).replace(**changes)
        init, example = init_fn(cfg)

        @jax.jit  # one program, not one per operation
        def start(key):
            params = jax.tree.map(lambda p: p.astype(jnp.float64), init(key, example))
            return jax.tree.map(lambda p: p + 0.01 * jnp.sin(jnp.arange(p.size).reshape(p.shape)), params)

        params = start(jax.random.PRNGKey(0))
        batch = _batch(cfg, 3, 9, weights)  # 27 tokens: chunks of 4 leave a tail of 3
        whole, g_whole = _loss_and_grads(cfg, params, batch)
        chunked, g_chunked = _loss_and_grads(cfg.replace(loss_chunk=4), params, batch)
        assert abs(float(chunked) - float(whole)) <= TOL * abs(float(whole))
        flat = jax.tree_util.tree_flatten_with_path(g_whole)[0]
        for (path, a), b in zip(flat, jax.tree.leaves(g_chunked), strict=True):
            scale = float(jnp.max(jnp.abs(a)))
            assert scale > 0, path  # every gradient reaches the loss
            assert float(jnp.max(jnp.abs(a - b))) <= TOL * scale, path


def test_verify_x64_proves_chunked_sharded_against_the_whole_loss_and_detects_the_fault():
    """1x2: the vocabulary split over mp, 16 tokens in chunks of 6 (three chunks, the last 4)."""
    from meshlm.proof.loss_controls import LOSS_CONTROLS
    from tests.helpers import verify_preset

    cfg = get_config("tiny-qwen2").replace(loss_chunk=6)  # tied head
    with jax.enable_x64(True):
        report = verify_preset(
            "tiny-qwen2", 1, 2, batch=1, seq=16, cfg=cfg, dtype=jnp.float64, controls=LOSS_CONTROLS
        )
    assert report.ok, report
    assert [c["name"] for c in report.controls if c["detected"]] == [c.name for c in LOSS_CONTROLS]


def test_compiled_step_temporaries_shrink_with_chunks():
    """A tiny model with a large vocabulary (8192 ids, d_model 64): 4 rows of 128 tokens, whose float32
    logits are 16 MiB. The whole loss's step keeps them and their gradient (measured, XLA:CPU: 43.7 MB
    of temporaries); in chunks of 32 tokens (1 MiB of logits each) 13.4 MB: at least 1.75 x the
    logits less."""
    cfg = get_config("tiny-lm").replace(vocab_size=8192)
    init, example = init_fn(cfg)
    params = jax.eval_shape(init, jax.random.PRNGKey(0), example)
    batch = {k: jax.ShapeDtypeStruct((4, 128), jnp.int32) for k in ("inputs", "targets")}

    def temp(c):
        apply = hk.without_apply_rng(hk.transform(loss_fn(cfg.replace(loss_chunk=c), Parallel()))).apply
        step = jax.jit(jax.value_and_grad(apply)).lower(params, batch).compile()
        return step.memory_analysis().temp_size_in_bytes

    logits = 4 * 128 * 8192 * 4
    whole, chunked = temp(0), temp(32)
    assert whole - chunked >= 1.75 * logits, (whole, chunked)


def test_refused_with_mtp_and_dpo_and_a_config_saved_without_it_loads_unchunked():
    from meshlm.model.config import from_dict
    from meshlm.train.dpo import check_dpo

    cfg = get_config("tiny-lm")
    saved = {k: v for k, v in cfg.to_dict().items() if k != "loss_chunk"}  # a checkpoint's, older
    assert from_dict(saved).loss_chunk == 0
    with pytest.raises(ConfigError, match="--objective dpo sums its own log-probabilities"):
        check_dpo(cfg.replace(loss_chunk=64))
    with pytest.raises(ConfigError, match="--loss-chunk does not chunk the multi-token prediction"):
        cfg.replace(loss_chunk=64, mtp_layers=1, mtp_weight=0.3)
    assert cfg.replace(loss_chunk=64, mtp_layers=1).loss_chunk == 64  # not run (weight 0): accepted


def _vocab_dots(cfg, rows: int, t: int, grad: bool) -> list[str]:
    """The dot ops of the compiled loss (with ``grad`` its value and gradient: the training step's) that
    have the padded vocabulary as a dimension of an operand or of the result (the head's matmuls:
    logits, dX = dlogits @ W^T, dW = X^T @ dlogits). XLA:CPU's text names the operands; their shapes
    are read from their definitions (instruction names are unique in a module)."""
    import re

    init, example = init_fn(cfg)
    params = jax.eval_shape(init, jax.random.PRNGKey(0), example)
    batch = {k: jax.ShapeDtypeStruct((rows, t), jnp.int32) for k in ("inputs", "targets")}
    apply = hk.without_apply_rng(hk.transform(loss_fn(cfg, Parallel()))).apply
    text = jax.jit(jax.value_and_grad(apply) if grad else apply).lower(params, batch).compile().as_text()
    shape = re.compile(r"^\s*(?:ROOT )?(%[\w.\-]+) = (\w+\[[\d,]*\])")
    shapes = {m[1]: m[2] for m in map(shape.match, text.splitlines()) if m}
    dot = re.compile(r"= (\w+\[[\d,]*\])\S* dot\((%[\w.\-]+), (%[\w.\-]+)\)")
    vocab = re.compile(rf"[\[,]{cfg.padded_vocab}[\],]")
    dots = [[m[1], shapes[m[2]], shapes[m[3]]] for m in map(dot.search, text.splitlines()) if m]
    return [d for d in dots if any(vocab.search(s) for s in d)]


def test_compiled_training_step_runs_three_head_matmuls_and_evaluation_one():
    """The fused chunked loss computes the head's gradients in its forward: in the compiled training step
    (``--remat full``: the head is outside the remat'ed layers, so nothing recomputes it) three dots
    meet the vocabulary, each on one chunk, as the whole loss's three; the recomputing
    backward it replaced ran four (its forward's logits again). Evaluation runs the logits' one; with
    LoRA (a frozen head) two: no weight gradient (the recomputing backward ran three)."""
    cfg = get_config("tiny-lm").replace(vocab_size=1000, remat="full")  # padded to 1024: no other dim
    whole, chunked = (_vocab_dots(cfg.replace(loss_chunk=c), 2, 64, grad=True) for c in (0, 16))
    assert len(whole) == 3, whole
    assert len(chunked) == 3, chunked
    assert all("[16," in " ".join(d) for d in chunked), chunked  # each on one chunk of 16 tokens
    assert len(_vocab_dots(cfg.replace(loss_chunk=16), 2, 64, grad=False)) == 1
    lora = cfg.replace(loss_chunk=16, lora_rank=4, lora_targets="q,v")
    assert len(_vocab_dots(lora, 2, 64, grad=True)) == 2
