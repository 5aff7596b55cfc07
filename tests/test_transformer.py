"""Transformers (gptj, llama with GQA): the proof on data x model meshes, its attention controls,
parameter bytes per device, and the rules' errors for meshes that cannot split the heads."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import verify_preset

from meshlm.errors import ShardingError
from meshlm.model.config import get_config
from meshlm.parallel.mesh import make_mesh
from meshlm.proof import format_report, model_problem, verify
from meshlm.proof.controls import CONTROLS

ATTENTION_CONTROLS = {"shard uses another shard's heads", "wrong rotary convention"}


# One global batch on every mesh (8 rows: dp up to 8 divides it): the unsharded reference of a preset is
# then the same program on every mesh, a hit in the compilation cache after its first mesh.
BATCH = 8


def _verify(name, dp, mp, dtype=jnp.float32, steps=0, **kw):
    return verify_preset(name, dp, mp, batch=BATCH, dtype=dtype, steps=steps, **kw)


# float32 only where the controls run (float64 proves the values exactly on the other meshes, below): where
# the set of controls that apply is new: 2x2 (dp > 1 and mp > 1: every control of the family) and
# tiny-llama on 1x8 (its 4 KV heads replicated: the KV-replication control). On other meshes the controls
# that apply are a subset of 2x2's, the same planted programs on another dp or mp (each control compiles a
# program of its own); a float32 proof there without controls repeated a float64 one at 10^8 the tolerance.
#
# Two tiers: tiny-llama on 2x2 with the attention controls (ATTENTION_CONTROLS) is quick; the others that
# apply on 2x2 (the all-reduce's, the vocab slice's, dp's mean, the clipping's, the padded logits') are the
# ff model's on 2x2, quick in tests/test_core.py::test_verify_ff_float32_with_controls. Slow: tiny-llama on
# 2x2 with every control, tiny-gptj on 2x2 (the same controls on another family; its values: the float64
# cells below) and tiny-llama on 1x8 (the KV-replication control:
# tests/test_prover.py::test_kv_heads_replicated_on_four_devices catches it, quick).
@pytest.mark.parametrize(
    "name,dp,mp,every",
    [
        pytest.param("tiny-gptj", 2, 2, True, marks=pytest.mark.slow),
        ("tiny-llama", 2, 2, False),
        pytest.param("tiny-llama", 2, 2, True, marks=pytest.mark.slow),
        pytest.param("tiny-llama", 1, 8, True, marks=pytest.mark.slow),
    ],
)
def test_transformer_float32(name, dp, mp, every):
    attention = tuple(c for c in CONTROLS if c.name in ATTENTION_CONTROLS)
    report = _verify(name, dp, mp) if every else _verify(name, dp, mp, controls=attention)
    assert report.ok, format_report(report)
    names = {c["name"] for c in report.controls}
    assert ATTENTION_CONTROLS <= names and all(c["detected"] for c in report.controls)
    if dp > 1 and every:
        assert "missing data-parallel mean" in names
    if name == "tiny-llama" and mp == 8:  # 4 KV heads on 8 shards: replicated, one per query group
        assert "KV heads not replicated per query group" in names


@functools.cache
def _exact(name, dp, mp):
    """The float64 proof without controls, once per (preset, mesh): several tests read one report."""
    with jax.enable_x64(True):
        return _verify(name, dp, mp, jnp.float64, controls=())


# tiny-gptj's 8 heads one head a shard on 1x8 (tiny-llama's 1x8 is proven in float32 above, with controls).
# Quick: gptj on 1x8 and llama on 2x4; slow: the same proof on more meshes (its cost is its scale; every
# mesh is proven quick on the ff model, tests/test_core.py).
@pytest.mark.parametrize(
    "name,dp,mp",
    [
        ("tiny-gptj", 1, 8),
        pytest.param("tiny-llama", 1, 4, marks=pytest.mark.slow),
        pytest.param("tiny-gptj", 4, 2, marks=pytest.mark.slow),
    ]
    + [("tiny-llama", 2, 4)]
    + [pytest.param(name, 8, 1, marks=pytest.mark.slow) for name in ("tiny-gptj", "tiny-llama")],
)
def test_transformer_float64_exact(name, dp, mp):
    report = _exact(name, dp, mp)
    assert report.ok, format_report(report)
    assert max(p.max_rel_err for p in report.params) <= 1e-12


# Only the control that depends on the training steps' optimizer: every other control runs on 2x2 in
# float32 above, where the tolerance is 10^8 times wider than float64's.
STEP_CONTROLS = tuple(c for c in CONTROLS if c.per_shard_clip)


# slow: the steps' proof and its one control are tests/test_core.py's
# test_verify_with_adamw_steps_on_data_x_model_mesh (quick); a transformer's steps are proven quick under
# FSDP + SP (tests/test_memory_options.py) and pp (tests/test_pp_verify.py): this is their cost on 2x2
@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-gptj", "tiny-llama"])
def test_transformer_training_steps_float64_on_2x2(name):
    with jax.enable_x64(True):
        report = _verify(name, 2, 2, jnp.float64, steps=3, controls=STEP_CONTROLS)
    assert report.ok, format_report(report)
    assert max(p.max_rel_err for p in report.params) <= 1e-12
    assert [c["name"] for c in report.controls] == ["per-shard gradient-norm clipping"]


def test_param_bytes_per_device_is_total_over_mp_plus_replicated():
    """1xMP: per-device bytes are exactly total/mp + the replicated norms (KV heads >= mp); the float64
    proof's report on 1x4 (8 bytes a value)."""
    j = _exact("tiny-llama", 1, 4).to_json()
    norms = sum(
        np.prod(p["shape"]) * 8 for p in j["params"] if p["path"].split("/")[-2] in ("ln", "ln2", "final_ln")
    )
    ideal = (j["param_bytes_total"] - norms) / 4 + norms
    assert j["param_bytes_per_device"] == ideal


def test_mesh_that_cannot_split_heads_is_a_clear_error():
    with pytest.raises(ShardingError, match="n_heads=8 is not divisible by mp=3"):
        _verify("tiny-gptj", 1, 3)
    cfg = get_config("tiny-llama").replace(n_heads=6, n_kv_heads=3, d_model=48)
    with pytest.raises(ShardingError, match="n_kv_heads=3 and mp=2"):
        verify(model_problem(cfg, "x", 2, 2, 8), make_mesh(1, 2))


# gptj-6b: 6_050_882_784 in transformers, + 262_176 for its vocabulary 50400 padded to 50432 (a multiple
# of 128): 32 rows of the embedding and 32 columns of the head (w and b).
@pytest.mark.parametrize("name,count", [("llama2-7b", 6_738_415_616), ("gptj-6b", 6_051_144_960)])
def test_real_size_presets_in_memory_reports(name, count):
    """The real shapes: exact parameter counts, sharded bytes = total/mp + replicated (no allocation)."""
    from meshlm.perf.memory import memory_report

    report = memory_report(get_config(name), make_mesh(2, 4))
    assert report["params"] == count
    assert report["param_bytes_per_device"] == report["param_bytes_ideal_per_device"]


def test_remat_layers_are_proven_too():
    cfg = get_config("tiny-llama").replace(remat=True)
    report = verify(model_problem(cfg, "remat", 2, 8, 16), make_mesh(2, 2), controls=())
    assert report.ok, format_report(report)
