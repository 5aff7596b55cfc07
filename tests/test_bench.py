"""meshlm bench: the report's schema and sanity, the theoretical collective counts, the per-step
collective counter. No timing assertions: the machine is shared and noisy."""

import json
import math
import re

import jax
import pytest
from helpers import run_cli

from meshlm.errors import ConfigError
from meshlm.generate.cache import cache_bytes
from meshlm.io.model_io import abstract_params
from meshlm.model.config import get_config
from meshlm.parallel.mesh import make_mesh
from meshlm.parallel.placement import total_bytes
from meshlm.perf.bench import IMPLS, NO_PP, BenchSettings, run_bench
from meshlm.perf.collectives import theoretical_collectives
from meshlm.perf.hlo import COLLECTIVES
from meshlm.perf.memory import memory_report
from meshlm.train.optim import OptimConfig, adamw

BYTES_KEYS = {"params", "opt_state", "peak", "compiled"}


def _bench_json(argv, capsys) -> dict:
    assert run_cli("bench", *argv) == 0
    return json.loads(capsys.readouterr().out)


def _positive(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def _check_result(r: dict) -> None:
    for key in ("step_s_median", "step_s_min", "step_s_max", "tokens_per_s", "mfu"):
        assert _positive(r[key]), (r["impl"], key, r[key])
    assert len(r["step_s"]) == 5 and all(_positive(t) for t in r["step_s"])
    assert r["step_s_min"] <= r["step_s_median"] <= r["step_s_max"]
    assert math.isfinite(r["loss"])
    mem = r["bytes_per_device"]
    assert BYTES_KEYS <= set(mem) and all(_positive(mem[k]) for k in ("params", "opt_state", "peak"))
    for view in ("static", "per_step"):
        assert set(COLLECTIVES) <= set(r["collectives"][view])


def _check_collectives(report: dict) -> None:
    """Per step on the 2x2 mesh: meshlm compiles exactly the theoretical all-reduces and nothing else,
    the unsharded step none; GSPMD's partitioning is XLA's own choice, so only its presence is checked."""
    theory = report["theoretical_collectives"]
    per_step = {r["impl"]: r["collectives"]["per_step"] for r in report["results"]}
    ours = per_step["meshlm"]
    # XLA's all-reduce combiner may put the two scalars, the loss mean over DP and the clip's squared norm,
    # into other all-reduces over the same devices (independent values: the loss mean did with a rolled
    # layer loop; since the optimizer's update is a lax.cond, 14 of tiny-llama's 16 on 2x2 are separate
    # ops); every other all-reduce of the theoretical minimum is its own op. (The bytes count each once.)
    scalars = theory["dp_loss"] + theory["grad_norm"]
    assert theory["total"] - scalars <= ours["all-reduce"]["count"] <= theory["total"]
    assert all(ours[kind]["count"] == 0 for kind in COLLECTIVES if kind != "all-reduce")
    for one_device in ("unsharded", "plain"):
        assert all(per_step[one_device][kind] == {"count": 0, "bytes": 0} for kind in COLLECTIVES)
    assert per_step["gspmd"]["all-reduce"]["count"] > 0
    assert all(p["trivial"] == 0 for p in per_step.values())  # 2x2: no one-device replica groups


def _expected_bytes(cfg) -> dict[str, dict[str, int]]:
    """Bytes one device holds per implementation on the 2x2 mesh, from shapes alone: parameters by the
    sharding rules (meshlm and gspmd use the same layout; unsharded holds everything), AdamW's two
    moments laid out like them, and its scalar step counters replicated."""
    mesh = make_mesh(2, 2)
    mem = memory_report(cfg, mesh)
    params = abstract_params(cfg, mesh)
    total = mem["param_bytes_total"]
    counters = total_bytes(jax.eval_shape(adamw(OptimConfig(), params).init, params)) - 2 * total
    per_device = mem["param_bytes_per_device"]
    assert per_device == mem["param_bytes_ideal_per_device"]  # total/mp + replicated: nothing wasted
    sharded = {"params": per_device, "opt_state": 2 * per_device + counters}
    whole = {"params": total, "opt_state": 2 * total + counters}
    return {"meshlm": sharded, "gspmd": sharded, "unsharded": whole, "plain": whole}


@pytest.mark.parametrize(
    ("config", "gen_tokens", "vocab"),
    # gptj with a padded vocabulary slow: the same report on another preset (its cost is its scale)
    [("tiny-llama", "4", None), pytest.param("tiny-gptj", "0", 200, marks=pytest.mark.slow)],
)
def test_bench_json_schema_and_values(config, gen_tokens, vocab, capsys, tmp_path):
    argv = ["--config", config, "--mesh", "2x2", "--json", "--steps", "5", "--peak-n", "256"]
    argv += ["--vocab-size", str(vocab)] if vocab else []  # another vocabulary (200, padded to 256)
    report = _bench_json([*argv, "--gen-tokens", gen_tokens, "--out", str(tmp_path)], capsys)
    cfg = get_config(config).replace(vocab_size=vocab) if vocab else get_config(config)
    name = f"{config} (vocab {vocab})" if vocab else config
    assert {"config", "mesh", "peak_flops", "results", "generation"} <= set(report)
    assert report["config"] == name and report["mesh"] == {"dp": 2, "mp": 2}
    assert all(_positive(report["peak_flops"][d]) for d in ("float32", "bfloat16"))
    assert [r["impl"] for r in report["results"]] == list(IMPLS)
    for r in report["results"]:
        _check_result(r)
    assert set(report["step_time_ratios"]) == {f"meshlm/{i}" for i in IMPLS[1:]} | {"unsharded/plain"}
    for ratio in report["step_time_ratios"].values():
        assert _positive(ratio["of_medians"]) and _positive(ratio["paired"])
    losses = [r["loss"] for r in report["results"]]
    assert max(losses) - min(losses) < 1e-3 * max(abs(x) for x in losses)  # same start, same steps
    _check_collectives(report)
    expected = _expected_bytes(cfg)
    for r in report["results"]:
        got = r["bytes_per_device"]
        assert {k: got[k] for k in ("params", "opt_state")} == expected[r["impl"]], r["impl"]
    total = expected["unsharded"]["params"]
    assert report["param_bytes"] == {"total": total, "ideal_per_device": total / 2}  # total/mp
    gen = report["generation"]
    if gen_tokens == "0":
        assert gen is None
    else:  # the CLI's defaults on 2x2: batch 4; new tokens 4 of max_seq_len 64, so prompts of 60
        assert {k: gen[k] for k in ("batch", "prompt_len", "new_tokens")} == {
            "batch": 4,
            "prompt_len": 60,
            "new_tokens": 4,
        }
        assert all(_positive(gen[k]) for k in ("prefill_tokens_per_s", "decode_tokens_per_s"))
        # a step reads every parameter and the whole cache (4 x 64 slots), each device its share
        assert gen["decode_bytes_per_device"] > expected["meshlm"]["params"]
        assert gen["decode_step_ms"] == pytest.approx(1e3 * 4 / gen["decode_tokens_per_s"])
        assert gen["roofline_ms"] is None and gen["over_roofline"] is None  # a CPU: no known bandwidth
    assert json.loads((tmp_path / "bench.json").read_text())["config"] == name
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# slow: bench's pipeline, schedule and linear-attention comparisons time whole training steps of several
# layouts (their cost); the report's schema and values: test_bench_json_schema_and_values, quick
@pytest.mark.slow
def test_bench_pp_times_the_pipeline_against_no_pp(capsys):
    """``--pp``: the pipelined step beside the others and ``no-pp`` (the same model and batch on the
    dp x mp mesh without the pipeline); the report's pipeline entry puts the measured overhead, 1 -
    t(no-pp)/t(pp) paired per repetition, next to the schedule's ideal bubble. The smallest run: pp 2 on
    two devices, M = 2, one row per micro-batch, no warm-up, no generation."""
    argv = ["--config", "tiny-llama", "--pp", "2", "--mesh", "1x1", "--json", "--steps", "5", "--warmup"]
    argv += ["0", "--peak-n", "64", "--batch-size", "2", "--seq-len", "8", "--gen-tokens", "0"]
    report = _bench_json(argv, capsys)
    assert report["mesh"] == {"pp": 2, "dp": 1, "mp": 1} and report["generation"] is None
    results = {r["impl"]: r for r in report["results"]}
    assert list(results) == [*IMPLS, NO_PP]
    for r in results.values():
        _check_result(r)
    losses = [results[i]["loss"] for i in ("meshlm", NO_PP)]  # same start, same steps
    assert abs(losses[0] - losses[1]) < 1e-3 * abs(losses[1])
    stage, whole = (results[i]["bytes_per_device"]["params"] for i in ("meshlm", NO_PP))
    assert stage < whole  # a stage holds half the layers
    pipe = report["pipeline"]
    assert {k: pipe[k] for k in ("schedule", "pp", "microbatches", "virtual_stages")} == {
        "schedule": "1f1b",
        "pp": 2,
        "microbatches": 2,
        "virtual_stages": 1,
    }
    assert pipe["ideal_bubble"] == pytest.approx(1 / 3)  # (pp - 1) / (M + pp - 1)
    paired = report["step_time_ratios"][f"meshlm/{NO_PP}"]["paired"]  # median of t(pp)/t(no-pp), 5 steps
    assert pipe["measured_overhead"] == pytest.approx(1 - 1 / paired)


@pytest.mark.slow
def test_bench_compare_schedules_times_each_schedule_against_no_pp(capsys):
    """``--pp --compare-schedules``: every schedule of one pp and M side by side with no-pp in one run,
    each overhead (1 - t(no-pp)/t(schedule), paired) next to its ideal bubble; all start from the same
    parameters and batch, so their losses after the same steps agree. pp 2 on two devices, M = 2, 8
    layers (interleaved V = 2 splits them into 4 chunks)."""
    argv = ["--config", "tiny-deep", "--pp", "2", "--mesh", "1x1", "--json", "--steps", "5", "--warmup"]
    argv += ["0", "--batch-size", "2", "--seq-len", "8", "--gen-tokens", "0", "--compare-schedules"]
    report = _bench_json(argv, capsys)
    rows = {r["name"]: r for r in report["schedules"]}
    assert list(rows) == ["gpipe", "1f1b+remat", "1f1b", "interleaved"]
    assert [rows[n]["schedule"] for n in rows] == ["gpipe", "1f1b", "1f1b", "interleaved"]
    assert rows["interleaved"]["virtual_stages"] == 2
    assert rows["1f1b"]["ideal_bubble"] == pytest.approx(1 / 3)  # (pp - 1) / (M + pp - 1)
    assert rows["interleaved"]["ideal_bubble"] == pytest.approx(1 / 5)  # (pp - 1) / (V M + pp - 1)
    losses = [r["loss"] for r in rows.values()]
    assert max(losses) - min(losses) < 1e-3 * abs(losses[0])
    for r in rows.values():
        paired = sorted(report["no_pp_s"][i] / t for i, t in enumerate(r["step_s"]))[2]  # median of 5
        assert r["measured_overhead"] == pytest.approx(1 - paired)
        micro = sorted(report["no_pp_micro_s"][i] / t for i, t in enumerate(r["step_s"]))[2]
        assert r["micro_overhead"] == pytest.approx(1 - micro)  # against the M micro-batches in turn
    assert len(report["no_pp_micro_s"]) == 5


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        (BenchSettings(steps=4, seq_len=8), "--steps"),
        (BenchSettings(batch_size=3, seq_len=8), "multiple of dp"),
    ],
)
def test_bad_settings_are_config_errors(settings, match):
    with pytest.raises(ConfigError, match=match):
        run_bench(get_config("tiny-llama"), "tiny-llama", make_mesh(2, 2), settings)


def test_theoretical_collectives_documented_numbers():
    small = get_config("small")  # llama, 8 layers: 2 all-reduces per layer each way
    assert theoretical_collectives(small, 1, 4) == {
        "layer_forward": 16,
        "layer_backward": 16,
        "kv_replicated_grads": 0,
        "embedding": 1,
        "head_backward": 1,
        "loss": 3,
        "grad_norm": 1,
        "dp_gradients": 0,
        "dp_loss": 0,
        "total": 38,
    }
    assert theoretical_collectives(small, 2, 2)["total"] == 40  # + DP gradients and loss mean
    gptj = get_config("tiny-gptj")  # parallel block: 1 per layer each way, 2 layers
    assert theoretical_collectives(gptj, 2, 2)["total"] == 2 + 2 + 1 + 1 + 3 + 1 + 2
    assert theoretical_collectives(gptj.replace(remat=True), 1, 2)["layer_forward"] == 4
    llama = get_config("tiny-llama")  # 4 KV heads on mp=8: replicated, gradients summed over MP
    assert theoretical_collectives(llama, 1, 8)["kv_replicated_grads"] == 2
    assert theoretical_collectives(llama, 1, 1)["total"] == 0
    assert theoretical_collectives(llama, 4, 1)["total"] == 2  # pure data parallel


def test_moe_against_the_dense_model_of_equal_active_parameters():
    """dense-eq: one expert of k x moe_d_ff that every token takes (a dense gated MLP): the MoE's active
    parameters (its router's D x 1 for D x E aside); the comparison's fields from paired step times."""
    from meshlm.model.accounting import param_counts
    from meshlm.parallel.layout import Layout
    from meshlm.perf.bench_moe import DENSE, dense_equivalent, moe_comparison
    from meshlm.perf.bench_report import _moe_line

    cfg = get_config("tiny-mixtral")
    dense = dense_equivalent(cfg)
    assert (dense.n_experts, dense.experts_per_token, dense.moe_d_ff) == (1, 1, 2 * cfg.moe_d_ff)
    assert dense.router_aux_loss_coef == dense.router_z_loss_coef == 0
    assert dense.moe_dispatch == "dense"  # one matmul per projection, not a scan over 16-row blocks
    moe, eq = param_counts(cfg), param_counts(dense)
    assert eq.total == eq.active and moe.active - eq.total == cfg.n_layers * cfg.d_model * (cfg.n_experts - 1)
    samples = {"meshlm": [2.0, 4.0, 3.0], "no-ep": [1.0, 3.0, 1.5], DENSE: [1.0, 2.0, 1.0]}  # made-up steps
    out = moe_comparison(cfg, samples, Layout(), 256)
    flops = out["expert_flops_over_routed"]  # compiled matmul FLOPs over the routed ones, 256 tokens
    assert flops["dense"] == pytest.approx(cfg.n_experts / cfg.experts_per_token, rel=0.01)  # + the combine
    assert 1 <= flops["blocks"] < 1.5  # padding: at most E x (BLOCK - 1) rows beyond the 512 routed
    assert 1 <= out["expert_flops_run_over_routed"] <= flops["blocks"]  # the used blocks of the bound
    assert out["step_time_over_dense"] == {"meshlm": 2.0, "no-ep": 1.5}  # medians of paired ratios
    assert out["overhead_vs_dense"] == {"meshlm": 0.5, "no-ep": pytest.approx(1 / 3)}
    assert out["expert_compute_factor"] == 2.0 and out["active_params"] == moe.active
    assert "meshlm/dense-eq 2.00x (overhead 50.0%)" in _moe_line(out)
    assert moe_comparison(get_config("tiny-llama"), samples, Layout(), 256) is None  # a dense model
    # cpu-moe's dense-eq: a config (its groups of 16 would not split one expert), weight exactly 1
    cpu = dense_equivalent(get_config("cpu-moe"))
    assert (cpu.router_score, cpu.n_group, cpu.routed_scaling_factor, cpu.balance_bias) == (
        "softmax",
        0,
        1,
        False,
    )
    assert cpu.n_shared_experts == 0 and cpu.moe_d_ff == (8 + 1) * 128  # the shared expert folded in
    full = get_config("cpu-moe")
    router = full.n_layers * (full.d_model * (full.n_experts - 1) + full.n_experts)  # w [D, E], bias [E]
    assert param_counts(full).active - param_counts(cpu).total == router  # the active parameters


def test_dense_eq_is_the_dense_gated_mlp_model():
    """dense-eq's logits are those of the dense family (mistral, mixtral's attention) with d_ff = k x
    moe_d_ff and the same weights: its one expert, taken with weight 1, is a dense gated MLP."""
    import haiku as hk
    import numpy as np

    from meshlm.model.transformer import init_fn, logits_fn
    from meshlm.parallel.context import Parallel
    from meshlm.perf.bench_moe import dense_equivalent

    eq = dense_equivalent(get_config("tiny-mixtral"))
    mlp = {"n_experts": 0, "experts_per_token": 0, "moe_d_ff": 0, "d_ff": eq.moe_d_ff}
    dense = eq.replace(family="mistral", **mlp)
    init, example = init_fn(eq)
    params = init(jax.random.key(0), example)
    moved = {k: v for k, v in params.items() if "/moe/" not in k}
    moved["layers/mlp"] = {w: params["layers/moe/experts"][w][:, 0] for w in ("w_gate", "w_up", "w_down")}
    tokens = np.arange(16, dtype=np.int32).reshape(2, 8) % eq.vocab_size
    run = lambda cfg, p: jax.jit(hk.transform(logits_fn(cfg, Parallel())).apply)(p, None, tokens)
    np.testing.assert_allclose(run(eq, params), run(dense, moved), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_bench_compare_linear_times_both_mixers_at_three_lengths(capsys):
    """``--compare-linear`` (a hybrid): its linear-attention layer and its full-attention layer timed
    side by side at --seq-len / 16, / 4 and / 1, each row with both kinds' tokens per second (the batch's
    tokens over the median step) and five timed steps; what it cannot time is one line, before any
    compile."""
    argv = ["--config", "tiny-qwen3.5", "--attention", "blockwise", "--attn-block", "8", "--mesh", "1x1"]
    argv += ["--json", "--steps", "5", "--warmup", "0", "--batch-size", "1", "--seq-len", "32"]
    report = _bench_json([*argv, "--compare-linear"], capsys)
    assert [r["seq_len"] for r in report["rows"]] == [2, 8, 32] and report["linear_chunk"] == 8
    for r in report["rows"]:
        for kind in ("linear", "full"):
            assert len(r[f"{kind}_s"]) == 5 and all(_positive(t) for t in r[f"{kind}_s"])
            assert r[f"{kind}_tokens_per_s"] == pytest.approx(r["seq_len"] / r[f"{kind}_s_median"])
    assert run_cli("bench", *argv, "--compare-linear", "--config", "tiny-llama") == 2
    assert "has none: use a config with linear layers" in capsys.readouterr().err
    assert run_cli("bench", *argv, "--compare-linear", "--attention", "plain") == 2
    assert "add --attention blockwise" in capsys.readouterr().err


def test_bench_impls_and_bf16_build_only_those_in_bf16(capsys, monkeypatch):
    """--impls builds and times only the implementations named (ratios only between those), --bf16
    computes in bf16 on float32 master weights in both (plain too: the same cast as train --bf16), and
    the JSON says which were built, the dtype, remat, and MFU over a known chip's spec peak."""
    import meshlm.perf.bench as bench

    monkeypatch.setattr(bench, "device_kind", lambda: "TPU v5 lite")  # a known chip's spec peak
    argv = ["--config", "tiny-llama", "--mesh", "1x1", "--json", "--peak-n", "128", "--gen-tokens", "0"]
    report = _bench_json([*argv, "--impls", "plain,meshlm", "--bf16", "--remat", "full"], capsys)
    assert report["impls"] == ["meshlm", "plain"] == [r["impl"] for r in report["results"]]
    assert report["remat"] == "full"  # meshlm's step recomputes each layer; plain has no remat
    assert report["compute_dtype"] == "bfloat16" and set(report["step_time_ratios"]) == {"meshlm/plain"}
    assert report["device_kind"] == "TPU v5 lite" and report["spec_peak_flops"]["bfloat16"] == 197e12
    cfg = get_config("tiny-llama")
    f32_bytes = total_bytes(abstract_params(cfg, make_mesh(1, 1)))
    for r in report["results"]:
        _check_result(r)
        assert r["bytes_per_device"]["params"] == f32_bytes  # float32 master weights
        # the two MFU figures against each other and the throughput, free of any one step's time: the
        # spec's over the measured bf16 peak's is the peaks' inverse ratio, and the FLOP rate (mfu times
        # its peak) over the token rate is the model's FLOPs per token
        peak = report["peak_flops"]["bfloat16"]
        assert r["mfu_spec"] / r["mfu"] == pytest.approx(peak / 197e12)
        tokens = report["batch_size"] * report["seq_len"]
        assert r["mfu"] * peak / r["tokens_per_s"] == pytest.approx(report["model_flops_per_step"] / tokens)
    losses = [r["loss"] for r in report["results"]]
    assert abs(losses[0] - losses[1]) < 2e-2 * abs(losses[0])  # bf16 rounding, same model and steps


def test_bench_impls_unknown_name_is_one_line_before_setup(capsys, monkeypatch):
    def too_late(*args, **kwargs):
        raise AssertionError("--impls must be checked before the devices start")

    monkeypatch.setattr("meshlm.cli.bench.setup", too_late)
    argv = ["--config", "tiny-llama", "--mesh", "1x1", "--impls", "meshlm,jax"]
    assert run_cli("bench", *argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "jax" in err and "valid: meshlm,unsharded,gspmd,plain" in err
    assert run_cli("bench", "--config", "tiny-mixtral", "--mesh", "2x1", "--ep", "2", "--impls", "plain") == 2
    err = capsys.readouterr().err  # a mixture of experts has no plain; ep adds no-ep
    assert "valid: meshlm,unsharded,gspmd,no-ep,dense-eq,dense-dispatch" in err
    assert (
        run_cli("bench", "--config", "tiny-llama", "--mesh", "1x1", "--impls", "plain", "--compare-linear")
        == 2
    )
    assert "--compare-linear times steps of its own, in float32; drop --impls" in capsys.readouterr().err


def test_spec_peaks_of_known_chips():
    from meshlm.perf.chips import spec_bf16_peak

    assert spec_bf16_peak("TPU v5 lite") == 197e12 and spec_bf16_peak("TPU v4") == 275e12
    assert (
        spec_bf16_peak("NVIDIA H100 80GB HBM3") == 989e12
        and spec_bf16_peak("NVIDIA A100-SXM4-40GB") == 312e12
    )
    assert spec_bf16_peak("cpu") is None and spec_bf16_peak("TPU v9 future") is None


def test_decode_roofline_reads_the_parameters_and_cache_at_the_chips_bandwidth():
    """A decode step against its memory roofline: batch / rate a step, the bytes a device reads once at
    the chip's spec bandwidth (v5e: 819 GB/s); no roofline where the bandwidth is unknown (a CPU)."""
    from meshlm.perf.chips import decode_roofline, hbm_bandwidth

    gen = {"batch": 8, "decode_tokens_per_s": 4000.0, "decode_bytes_per_device": 819e6}
    got = decode_roofline(gen, "TPU v5 lite")
    assert got["decode_step_ms"] == pytest.approx(2.0) and got["roofline_ms"] == pytest.approx(1.0)
    assert got["over_roofline"] == pytest.approx(2.0)
    assert decode_roofline(gen, "cpu") == {
        "decode_step_ms": pytest.approx(2.0),
        "roofline_ms": None,
        "over_roofline": None,
    }
    assert (
        hbm_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
        and hbm_bandwidth("NVIDIA A100-SXM4-40GB") == 1.555e12
    )


def test_plain_bf16_computes_in_bf16_on_float32_master_weights():
    """--bf16's plain row: the matmuls in bf16 (the cast train --bf16 applies), the parameters it
    returns and their AdamW state in float32."""
    import jax.numpy as jnp

    from meshlm.perf.plain import plain_step
    from meshlm.train.step import init_model

    cfg = get_config("tiny-llama")
    params = jax.device_get(init_model(cfg, make_mesh(1, 1), 0)[0])
    step, opt = plain_step(cfg, OptimConfig(), params, compute_dtype=jnp.bfloat16)
    batch = {k: jnp.zeros((2, 8), jnp.int32) for k in ("inputs", "targets")}
    lowered = step.lower(params, opt.init(params), batch)
    dots = [line for line in lowered.as_text().splitlines() if "dot_general" in line]
    assert dots and all("bf16" in line for line in dots)
    new_params, new_opt, _ = jax.eval_shape(step, params, opt.init(params), batch)
    assert {x.dtype for x in jax.tree.leaves((new_params, new_opt)) if x.ndim} == {jnp.dtype("float32")}


# ---------------------------------------------------------------- figures that cannot be true (issue 66, 4)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--config", "small", "--peak-n", "64"], "--peak-n 64 is too small to measure a peak"),
        (["--config", "tiny-llama", "--peak-n", "1"], "use --peak-n 64 or more"),
        (["--config", "tiny-llama", "--gen-tokens", "100000"], "use --gen-tokens 32 or less"),
        (["--config", "tiny-llama", "--seq-len", "4096"], "is above the model's max_seq_len=64 with plain"),
        (["--config", "tiny-llama", "--peak-n", "1000000"], "the peak measurement's matmul holds three"),
    ],
)
def test_a_figure_that_cannot_be_true_is_refused_before_any_work(argv, words, capsys, monkeypatch):
    """--peak-n too small to measure (MFU 20,730), --gen-tokens past the context (silently cut before),
    --seq-len 4096 on a 64-token preset (ran until killed), a peak matmul larger than memory (an
    out-of-memory line that blamed the model): one line each, before anything is built."""

    def too_late(*args, **kwargs):
        raise AssertionError("refused after the implementations were built")

    monkeypatch.setattr("meshlm.perf.bench.build_impls", too_late)
    assert run_cli("bench", *argv, "--mesh", "1x1") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("meshlm: error: ") and words in err, err
    assert "out of memory" not in err


def test_an_mfu_above_one_is_never_printed_as_a_measurement(capsys, monkeypatch):
    """A peak measured too low (here: planted, 1 kFLOP/s) makes every step "faster than the peak": the
    MFU column shows "-" and the report says why and what to do, in the text and the JSON."""
    import meshlm.perf.bench as bench

    monkeypatch.setattr(bench, "matmul_peak_flops", lambda dtype, n, repeats: 1e3)
    argv = ["--config", "tiny-llama", "--mesh", "1x1", "--impls", "meshlm", "--batch-size", "1"]
    argv += ["--seq-len", "8", "--gen-tokens", "0", "--warmup", "0", "--peak-n", "64"]
    assert run_cli("bench", *argv) == 0
    text = capsys.readouterr().out
    row = next(line for line in text.splitlines() if re.match(r"meshlm +[0-9]", line))
    assert row.split()[5] == "-", row  # the MFU column
    assert "MFU over the measured peak not shown: a step ran faster than the --peak-n 64 matmul" in text
    report = _bench_json([*argv, "--json"], capsys)
    assert report["results"][0]["mfu"] is None and "raise --peak-n" in report["mfu_note"]


def test_bench_generation_at_several_batch_sizes_in_bf16(capsys):
    """``--gen-batch 2,4`` under ``--bf16``: one generation row per batch size (``generation`` the first),
    each with bf16 weights and KV cache: a decode step reads half the float32 weights' bytes and the bf16
    cache of its batch (prompt 60 + 4 new tokens: 64 slots a row)."""
    argv = ["--config", "tiny-llama", "--mesh", "1x1", "--json", "--steps", "5", "--peak-n", "256"]
    report = _bench_json(
        [*argv, "--impls", "meshlm", "--bf16", "--gen-tokens", "4", "--gen-batch", "2,4"], capsys
    )
    rows = report["generation_by_batch"]
    assert [g["batch"] for g in rows] == [2, 4] and report["generation"] == rows[0]
    cfg, weights = get_config("tiny-llama"), report["results"][0]["bytes_per_device"]["params"]
    for g in rows:
        assert g["dtype"] == "bfloat16" and all(
            _positive(g[k]) for k in ("decode_tokens_per_s", "decode_step_ms")
        )
        cache = cache_bytes(cfg, make_mesh(1, 1), g["batch"], 64, "bfloat16")["per_device"]
        assert g["decode_bytes_per_device"] == weights // 2 + cache


def test_bench_impls_name_each_sorted_dispatch():
    """A MoE bench builds ragged_dot's, gmm's and blocks' steps beside dense-eq when --impls names them
    (one run, side by side), never by default; a dense model has none."""
    from meshlm.parallel.layout import Layout
    from meshlm.perf.bench_settings import BenchSettings, chosen, impl_names

    moe, one = get_config("tiny-mixtral").replace(moe_dispatch="ragged_dot"), Layout()
    names = impl_names(moe, one)
    assert names[-3:] == ("blocks-dispatch", "ragged_dot-dispatch", "gmm-dispatch")
    assert chosen(BenchSettings(), names) == ("meshlm", "unsharded", "gspmd", "dense-eq", "dense-dispatch")
    asked = BenchSettings(impls="meshlm,gmm-dispatch,dense-eq")
    assert chosen(asked, names) == ("meshlm", "dense-eq", "gmm-dispatch")
    assert "gmm-dispatch" not in impl_names(get_config("tiny-llama"), one)
