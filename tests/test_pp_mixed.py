"""``--pp`` over stacks of two layer kinds (``model.stage_layers``): a periodic stack (Qwen3.5's linear and
full attention layers) splits each kind's stack over the stages, a MoE's dense prefix (DeepSeek-V3's
first_k_dense_replace) runs with the embedding on the first stage; both proven equal to the unsharded
model in float64 with the pipeline's controls detected. Stacks whose chunks would differ are refused in
one line naming the pp values that work (``rules.check_uniform_stack``). The tiny presets' CLI proofs
are in docs/proof.md."""

import jax
import jax.numpy as jnp
import pytest

from meshlm.errors import ShardingError
from meshlm.model import stage_layers
from meshlm.model.config import get_config
from meshlm.model.params import flat_params
from meshlm.model.transformer import param_shapes
from meshlm.parallel.axes import PP
from meshlm.parallel.layout import Layout
from meshlm.proof import model_problem, verify
from meshlm.proof.controls import CONTROLS
from meshlm.sharding.pipelined import split_model
from meshlm.sharding.rules import check_uniform_stack, model_specs


@pytest.mark.parametrize(
    "name, changes, pp, match",
    [
        (
            "tiny-qwen3.5",
            {"n_layers": 2},  # one period: a linear and a full layer cannot be a stage each
            2,
            r"--pp 2: chunks of 1 layers hold different .* \(layer by layer lm\).*; drop --pp",
        ),
        ("tiny-qwen3.5", {}, 4, r"layer by layer lmlm\).*; use --pp 2$"),
        (
            "tiny-llama4",
            {},
            2,
            r"layer by layer dmdM; global_every=4\).*; drop --pp",
        ),  # global_every 4 over chunks of 2
        (
            "tiny-deepseek-v3",
            {"n_layers": 2},
            2,
            r"after the 1 dense layers .* 1 layers do not split into 2 chunks",
        ),
        # uneven stages are padded for a body of one kind only (``stage_layers.slots``)
        (
            "tiny-qwen3.5",
            {"n_layers": 6},
            4,
            r"6 layers do not split into 4 chunks .*not of two layer kinds.*; use --pp 3$",
        ),
    ],
)
def test_chunks_that_would_differ_are_refused_naming_a_pp_that_works(name, changes, pp, match):
    with pytest.raises(ShardingError, match=match):
        check_uniform_stack(get_config(name).replace(**changes), Layout(pp=pp))


def test_periodic_chunks_and_a_dense_prefix_pass_and_place_their_stacks():
    for name, changes, pp in (
        ("tiny-qwen3.5", {}, 2),  # 4 layers: a linear and a full one per stage
        ("qwen3.5-text", {}, 4),  # 32 layers: chunks of 8, two periods of 4 each
        ("tiny-qwen2-moe", {}, 2),  # dense layer 0 with the embedding, MoE layers 1, 2 one per stage
        ("deepseek-v3", {}, 2),  # 3 dense layers with the embedding, 58 MoE layers in chunks of 29
        (
            "deepseek-v3",
            {},
            4,
        ),  # uneven stages: 58 MoE layers in 4 chunks of 15 slots (tests/test_pp_uneven.py)
    ):
        check_uniform_stack(get_config(name).replace(**changes), Layout(pp=pp))
    hybrid = stage_layers.chunk_config(get_config("tiny-qwen3.5").replace(n_layers=8), 4)
    assert (hybrid.n_layers, hybrid.linear_layers) == (4, (0, 2))  # each chunk's kinds from 0
    cfg = get_config("tiny-qwen2-moe")
    assert stage_layers.prefix(cfg) == 1 and stage_layers.chunk_config(cfg, 1).dense_layers == ()
    assert stage_layers.prefix(get_config("tiny-llama4")) == 0  # dense 0 and 2: interleaved, no prefix
    specs = model_specs(cfg, param_shapes(cfg), Layout(pp=2, mp=2))
    flat = flat_params(specs)
    assert flat["layers/attn/wq"][0] == PP and flat["dense_layers/attn/wq"][0] is None  # not over pp
    embed, layers, head = split_model(specs, cfg)
    assert {k.split("/")[0] for k in embed} == {"embed", "dense_layers"}
    assert {k.split("/")[0] for k in layers} == {"layers"} and "final_ln" in str(sorted(head))


FAULTS = ("one micro-batch's gradient dropped", "a bubble's NaN let through")


# slow: mixed stacks through the pipeline (their cost, ~1 CPU-min each); the hybrid's proof
# (tests/test_deltanet.py), the pipeline's (tests/test_pp_verify.py) and the stacks' chunking
# (test_periodic_chunks_and_a_dense_prefix_pass_and_place_their_stacks) are quick
@pytest.mark.slow
@pytest.mark.parametrize(
    "name, changes, schedule, controls",
    [
        ("tiny-qwen3.5", {}, "1f1b", ()),  # the preset: each stage one linear and one full layer
        # dense layer 0 with the embedding; MoE 1, 2; the MTP depth with the head on the last stage (the
        # embedding table on both ends: its gradient the sum of theirs). Its control of another shard's
        # heads runs in the depth's attention, in the last stage's cond: as a permute over mp it hung
        # (XLA:CPU's permute waits for every device), as an all-gather it is detected
        ("tiny-deepseek-v3", {}, "gpipe", ("shard uses another shard's heads",)),
    ],
    ids=["qwen3.5-periodic-1f1b", "deepseek-v3-prefix-gpipe"],
)
def test_mixed_stack_through_the_pipeline_is_proven(name, changes, schedule, controls):
    layout = Layout(pp=2, mp=2, microbatches=2, pp_schedule=schedule)
    cfg = get_config(name).replace(**changes)
    problem = model_problem(cfg, name, layout, 4, 16)
    with jax.enable_x64(True):
        # The two pipeline controls whose planted engine touches what this stage body changes: the bubbles'
        # NaN fill (a dense prefix runs in the first chunk's slot) and each micro-batch's gradient (the
        # prefix's flows as the embedding's). The schedule's other faults (a reversed permute, the loss's
        # 1/M) are the engine's alone, proven on every schedule (tests/test_pp_verify.py, test_pp_cli.py);
        # ``controls``: the model's named ones; all of the model's under pp: the CLI runs (docs/proof.md).
        chosen = tuple(c for c in CONTROLS if c.name in controls)
        report = verify(problem, layout, steps=1, dtype=jnp.float64, controls=chosen, pipeline_faults=FAULTS)
    assert report.ok and report.loss_ok, [c for c in report.checks if not c["ok"]]
    assert max(p.max_rel_err for p in report.params) <= 1e-12
    names = {c["name"] for c in report.controls}
    assert names == {f"pipeline: {n}" for n in FAULTS} | set(controls)
    assert all(c["detected"] for c in report.controls), report.controls
