"""The pipeline engine on the real model (``sharding.pipelined``: ``model.transformer``'s embedding, layer
chunks and head): loss and every parameter's gradient equal the unsharded model's
(``spmd.reference_value_and_grad``) in float64, with NaN in every bubble, for each family; with mp the
stages run their Megatron collectives and with FSDP their all-gathers inside the pipeline's shard_map."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.model.config import get_config
from meshlm.model.transformer import init_fn, loss_fn
from meshlm.parallel.layout import Layout
from meshlm.sharding.pipelined import pipelined_value_and_grad
from meshlm.sharding.rules import model_specs
from meshlm.sharding.spmd import reference_value_and_grad


def _errors(config, layout: Layout, vocab: int = 64, **changes) -> dict:
    """Normwise relative error of the loss and each gradient leaf (inf where not finite); token ids
    below ``vocab`` (a small one makes the document mask's EOD frequent)."""
    cfg = get_config(config).replace(**changes)
    init, _ = init_fn(cfg)
    with jax.enable_x64(True):
        tokens = jax.random.randint(jax.random.PRNGKey(1), (2 * layout.microbatches * layout.dp, 9), 0, vocab)
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
        start = jax.jit(lambda key: jax.tree.map(lambda a: a.astype(jnp.float64), init(key, batch)))
        params = start(jax.random.PRNGKey(0))  # one program, not one per operation
        ref_loss, ref_grads = jax.jit(reference_value_and_grad(lambda par: loss_fn(cfg, par)))(params, batch)
        specs = model_specs(cfg, params, layout)
        fn = pipelined_value_and_grad(cfg, layout, specs, fill=float("nan"))
        loss, grads = jax.jit(fn)(params, batch)
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    errors = {"loss": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss))}
    for name in ref_grads:
        for leaf in ref_grads[name]:
            a, b = np.asarray(grads[name][leaf]), np.asarray(ref_grads[name][leaf])
            err = np.max(np.abs(a - b)) / np.max(np.abs(b)) if np.all(np.isfinite(a)) else np.inf
            errors[f"{name}/{leaf}"] = float(err)
    return errors


@pytest.mark.parametrize(
    ("config", "layout", "leaves"),
    [
        # tiny-deep (8 layers): pp = 4, interleaved over 2 virtual stages, unsharded stages.
        # slow: pp = 4 interleaved (scale; the interleaved engine with its controls: test_pipeline.py, quick)
        pytest.param(
            "tiny-deep",
            Layout(pp=4, microbatches=4, pp_schedule="interleaved", virtual_stages=2),
            12,
            marks=pytest.mark.slow,
        ),
        ("tiny-gptj", Layout(pp=2, mp=2, microbatches=2, pp_schedule="gpipe"), 15),
        ("tiny", Layout(pp=2, dp=2, mp=2, fsdp=True, microbatches=2, pp_schedule="1f1b"), 8),
    ],
    ids=["llama-interleaved-pp4", "gptj-gpipe-pp2x1x2", "ff-1f1b-pp2x2x2-fsdp"],
)
def test_real_model_through_the_pipeline_equals_the_unsharded_model(config, layout, leaves):
    """Float64, NaN in every bubble; the loss and every parameter (embedding and head included). Worst
    errors measured: ~1e-15 each."""
    errors = _errors(config, layout)
    assert len(errors) == 1 + leaves
    assert max(errors.values()) <= 1e-12, errors


@pytest.mark.parametrize(
    ("layout", "changes"),
    # slow: pp x cp and pp x the document mask, products of axes each proven quick (their cost is their
    # scale)
    [
        pytest.param(Layout(pp=2, cp=2, microbatches=2, pp_schedule="1f1b"), {}, marks=pytest.mark.slow),
        pytest.param(
            Layout(pp=2, cp=2, mp=2, microbatches=2, pp_schedule="gpipe", cp_strategy="allgather"),
            {},
            marks=pytest.mark.slow,
        ),
        pytest.param(
            Layout(pp=2, mp=2, microbatches=2, pp_schedule="1f1b"), {"doc_mask": 3}, marks=pytest.mark.slow
        ),
    ],
    ids=["pp2-cp2-ring-1f1b", "pp2-cp2-mp2-allgather-gpipe", "pp2-mp2-doc-mask-1f1b"],
)
def test_pp_with_cp_and_with_the_document_mask_equals_the_unsharded_model(layout, changes):
    """The stages attend across cp (each holds its chunks i and 2cp-1-i, at their global positions; the
    loss a mean over dp and cp), or mask documents (the starts computed before the pipeline and passed
    with each micro-batch): tiny-llama, float64, NaN in every bubble. Worst measured: ~1e-15. With the
    layers at positions 0..T/cp-1 (the cp shard's own count) the cp cases fail."""
    errors = _errors("tiny-llama", layout, vocab=8, **changes)
    assert max(errors.values()) <= 1e-12, errors
