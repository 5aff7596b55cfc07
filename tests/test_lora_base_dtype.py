"""LoRA's frozen base stored in bf16 (``--base-dtype``, ``train.lora.stored_base``): a --bf16 LoRA run
holds its base in bf16 and its adapters and their AdamW state in float32, and saves float32 adapters
alone; the compiled LoRA step computes no frozen weight's gradient; ``verify --base-dtype bf16`` proves
both runs on the bf16 base in float64; ``bench --lora-rank`` benches a LoRA step on a random base with
the LoRA model FLOPs (``perf.flops``: 4 N_base + 6 N_adapter a token + attention's)."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_cli, saved_tiny_base, tiny_lm_config

from meshlm.model import lora
from meshlm.model.config import get_config


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return saved_tiny_base(tmp_path_factory.mktemp("lora_bf16"))


def _floats(tree) -> set[str]:
    return {jnp.dtype(x.dtype).name for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}


def test_a_bf16_lora_run_holds_its_base_in_bf16_and_saves_float32_adapters(base, tmp_path):
    """--bf16 (--base-dtype's default there): the step's base leaves bf16, before and after a step, its
    adapters and their AdamW moments float32 (no state for the base); the checkpoint holds the adapters
    alone, float32; the end-of-run sample generates (one dtype: ``loop._sample_params``)."""
    from meshlm.parallel.mesh import make_mesh
    from meshlm.train.loop import _train
    from meshlm.train.run import build_run
    from meshlm.train.stop import Stop

    ck, text = base
    tcfg = tiny_lm_config(
        str(text), tmp_path / "run", checkpoint=str(ck), lora_rank=2, compute_dtype="bfloat16",
        batch_size=2, steps=1, save_every=1, sample_tokens=4,
    )  # fmt: skip
    run = build_run(tcfg, make_mesh(1, 1))
    try:
        for _ in range(2):  # at the start, then after the step
            params, opt_state = run.params, run.opt_state
            assert _floats(lora.base(params)) == {"bfloat16"}
            assert _floats(lora.adapters(params)) == {"float32"}
            moments = [x for x in jax.tree.leaves(opt_state) if x.ndim]
            assert len(moments) == 2 * len(jax.tree.leaves(lora.adapters(params)))
            assert {x.dtype for x in moments} == {np.dtype(np.float32)}
            if run.step == 0:
                stop = Stop()
                try:
                    assert _train(run, stop)["sample"].startswith("def ")
                finally:
                    stop.restore()
        assert run.step == 1
    finally:
        run.release()
    saved = json.loads((tmp_path / "run" / "1" / "integrity" / "metadata").read_text())["arrays"]
    leaves = {k: v for k, v in saved.items() if k.startswith("['params']")}
    assert leaves and all("lora_" in k for k in leaves), leaves
    assert all("float32" in json.dumps(v) for v in leaves.values()), leaves


def _compiled_step(cfg, base_dtype: str, dp: int = 1):
    """The train step (bf16 compute, batch 2 x 16 per data shard) compiled on a dp x 1 mesh."""
    from meshlm.parallel.layout import Layout
    from meshlm.perf.plan import abstract_step
    from meshlm.perf.plan_settings import PlanSettings

    settings = PlanSettings(batch_size=2 * dp, seq_len=16, compute_dtype="bfloat16", base_dtype=base_dtype)
    step, params, opt_state, batch = abstract_step(cfg, Layout(dp=dp, mp=1), settings)
    return step.lower(params, opt_state, batch).compile()


def _weight_gradient_dots(cfg, base_dtype: str) -> list[str]:
    """The compiled step's dot products whose result has a frozen MLP weight's shape [D, F] or [F, D]:
    a weight gradient (the forward's dots are [tokens, F] and [tokens, D])."""
    hlo = _compiled_step(cfg, base_dtype).as_text()
    d, f = cfg.d_model, cfg.d_ff
    shape = re.compile(rf"\[(\d+,)?({d},{f}|{f},{d})\]")
    return [line for line in hlo.splitlines() if " dot(" in line and shape.search(line.split("=")[1])]


def test_the_compiled_lora_step_computes_no_frozen_weight_gradient():
    """With adapters on q and v only, the MLP's weights are frozen: no dot of the step makes a [D, F]
    gradient; the full fine-tune's step (the control: the same search can find them) does. On dp = 2
    the one gradient all-reduce carries the adapters' float32 gradients alone, not the base's."""
    from meshlm.model.transformer import param_shapes
    from meshlm.perf.hlo import collectives_per_step

    cfg = get_config("tiny-llama").replace(vocab_size=200)  # d 64, ffn 128, vocab 256: only the MLP is [D, F]
    assert len({cfg.d_model, cfg.d_ff, 2 * 16}) == 3
    assert _weight_gradient_dots(cfg, "float32")  # full fine-tune: the MLP's weight gradients
    adapted = cfg.replace(lora_rank=4, lora_targets="q,v")
    assert _weight_gradient_dots(adapted, "bf16") == []
    assert _weight_gradient_dots(adapted, "float32") == []
    summed = lambda c, dtype: collectives_per_step(_compiled_step(c, dtype, dp=2).as_text())["all-reduce"]
    adapter_bytes = 4 * sum(x.size for x in jax.tree.leaves(lora.adapters(param_shapes(adapted))))
    assert adapter_bytes <= summed(adapted, "bf16")["bytes"] <= adapter_bytes + 64  # + the loss's scalars
    assert summed(cfg, "float32")["bytes"] > 10 * adapter_bytes  # the full fine-tune's: every weight's


# slow: a proof (its cost); the bf16 base's step runs quick in
# test_a_bf16_lora_run_holds_its_base_in_bf16_and_saves_float32_adapters, LoRA's proof in tests/test_lora.py
@pytest.mark.slow
def test_verify_proves_a_bf16_base_in_float64_and_the_controls_are_detected():
    """The proof's base stored in bf16 in both runs (its values bf16-representable, the step computing
    in float64): sharded == unsharded at 1e-12, the LoRA rows pass, the controls detected."""
    from meshlm.parallel.layout import Layout
    from meshlm.proof import format_report, model_problem, verify
    from meshlm.proof.lora import LORA_CONTROLS, lora_problem

    lay = Layout(dp=2, mp=2)
    cfg = get_config("tiny-llama").replace(lora_rank=2, lora_alpha=4.0, lora_targets="q,down")
    problem = lora_problem(model_problem(cfg, "tiny-llama", lay, 4, 16), "bf16")
    with jax.enable_x64(True):
        report = verify(problem, lay, dtype=np.float64, controls=LORA_CONTROLS, collectives=False)
        prepared = problem.prepare_params(problem.load_params or _example_params(problem, lay))
    assert report.ok, format_report(report)
    assert "bf16 base" in report.config
    assert _floats(lora.base(prepared)) == {"bfloat16"} and _floats(lora.adapters(prepared)) == {"float64"}
    adapters = [p for p in report.params if lora.is_adapter(p.path)]
    assert len(adapters) == 4 and max(p.max_rel_err for p in adapters) <= 1e-12
    assert all(c["ok"] for c in report.checks if c["name"].startswith("LoRA"))
    assert all(c["detected"] for c in report.controls), report.controls


def _example_params(problem, lay):
    from meshlm.proof.runs import _init

    return _init(problem, lay.mesh, jnp.float64, 0)[0]


def test_bench_lora_rank_runs_on_a_random_base_with_the_lora_flops(capsys):
    cfg = get_config("tiny-llama").replace(lora_rank=4, lora_targets="q,k,v,o")
    argv = ["bench", "--config", "tiny-llama", "--lora-rank", "4", "--mesh", "1x1", "--bf16", "--json"]
    argv += ["--batch-size", "2", "--seq-len", "16", "--steps", "5", "--warmup", "0", "--peak-n", "64"]
    assert run_cli(*argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["lora"] == {"rank": 4, "alpha": 4.0, "targets": "q,k,v,o", "base_dtype": "bf16"}
    assert [r["impl"] for r in report["results"]] == ["meshlm"]
    from meshlm.model.transformer import param_shapes
    from meshlm.perf.flops import matmul_param_count

    shapes = param_shapes(cfg)
    n_base = matmul_param_count(cfg, shapes)
    n_adapter = sum(x.size for x in jax.tree.leaves(lora.adapters(shapes)))
    attention = 12 * cfg.n_layers * 16 * cfg.d_model
    assert report["model_flops_per_step"] == (4 * n_base + 6 * n_adapter + attention) * 2 * 16
    assert np.isfinite(report["results"][0]["loss"])
    assert run_cli("bench", "--config", "tiny-llama", "--base-dtype", "bf16") == 2  # no --lora-rank
