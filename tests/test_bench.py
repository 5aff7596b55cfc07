"""meshlm bench: the report's schema and sanity, the theoretical collective counts, the per-step
collective counter. No timing assertions: the machine is shared and noisy."""

import argparse
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from meshlm.cli import bench as bench_command
from meshlm.errors import ConfigError
from meshlm.model.config import get_config
from meshlm.parallel.axes import DP, MP
from meshlm.parallel.mesh import make_mesh
from meshlm.perf.bench import (
    IMPLS,
    BenchSettings,
    collectives_per_step,
    group_size,
    run_bench,
    theoretical_collectives,
)
from meshlm.perf.hlo import COLLECTIVES

BYTES_KEYS = {"params", "opt_state", "peak", "compiled"}


def _run_cli(argv, capsys) -> dict:
    parser = argparse.ArgumentParser()
    bench_command.add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", *argv])
    assert args.fn(args) == 0
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
    all_reduces = r["collectives"]["per_step"]["all-reduce"]["count"]
    assert (all_reduces > 0) == (r["impl"] != "unsharded")


@pytest.mark.parametrize(("config", "gen_tokens"), [("tiny-llama", "4"), ("tiny-gptj", "0")])
def test_bench_json_schema_and_values(config, gen_tokens, capsys, tmp_path):
    argv = ["--config", config, "--mesh", "2x2", "--json", "--steps", "5", "--peak-n", "256"]
    report = _run_cli([*argv, "--gen-tokens", gen_tokens, "--out", str(tmp_path)], capsys)
    assert {"config", "mesh", "peak_flops", "results", "generation"} <= set(report)
    assert report["config"] == config and report["mesh"] == {"dp": 2, "mp": 2}
    assert all(_positive(report["peak_flops"][d]) for d in ("float32", "bfloat16"))
    assert [r["impl"] for r in report["results"]] == list(IMPLS)
    for r in report["results"]:
        _check_result(r)
    for ratio in report["step_time_ratios"].values():
        assert _positive(ratio["of_medians"]) and _positive(ratio["paired"])
    losses = [r["loss"] for r in report["results"]]
    assert max(losses) - min(losses) < 1e-3 * max(abs(x) for x in losses)  # same start, same steps
    ours = report["results"][0]["bytes_per_device"]["params"]
    assert abs(ours / report["param_bytes"]["ideal_per_device"] - 1) < 0.05  # split over mp
    gen = report["generation"]
    if gen_tokens == "0":
        assert gen is None
    else:  # null only while meshlm.generate is missing
        assert gen is None or all(_positive(gen[k]) for k in ("prefill_tokens_per_s", "decode_tokens_per_s"))
    assert json.loads((tmp_path / "bench.json").read_text())["config"] == config
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        (BenchSettings(steps=4, seq_len=8), "--steps"),
        (BenchSettings(batch_size=3, seq_len=8), "multiple of dp"),
        (BenchSettings(seq_len=65), "--seq-len"),
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


def test_group_size_formats():
    assert group_size("x = f32[] all-reduce(y), replica_groups={{0,1},{2,3}}, to_apply=%a") == 2
    assert group_size("x = f32[] all-reduce(y), replica_groups={{0},{1},{2},{3}}, to_apply=%a") == 1
    assert group_size("x = f32[] all-reduce(y), replica_groups=[4,1]<=[4], to_apply=%a") == 1
    mesh_line = "x = f32[] all-reduce(y), replica_groups=mesh['axis_0'=1,'axis_1'=4] {'axis_1'}, to_apply=%a"
    assert group_size(mesh_line) == 4
    assert group_size(mesh_line.replace("{'axis_1'}", "{'axis_0'}")) == 1
    assert group_size("x = f32[] add(y, z)") is None


def test_per_step_counts_loop_bodies_times_trips():
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), (DP, MP))

    def body(x):  # the sine keeps the three psums from being merged or hoisted
        return jax.lax.fori_loop(0, 3, lambda i, a: jnp.sin(jax.lax.psum(a, MP)), x)

    f = jax.shard_map(body, mesh=mesh, in_specs=P(DP, MP), out_specs=P(DP, MP), check_vma=False)
    text = jax.jit(f).lower(jnp.ones((8, 16), jnp.float32)).compile().as_text()
    counts = collectives_per_step(text)
    assert counts["all-reduce"] == {"count": 3, "bytes": 3 * 4 * 8 * 4}
    assert counts["trivial"] == 0
