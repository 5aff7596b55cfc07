"""Gemma 4's global layers of their own attention shape (``model.per_layer_runs``: transformers'
``global_head_dim`` and ``num_global_key_value_heads``), proven: float64, the sharded model against the
unsharded one on 1x4, where the local layers' 4 KV heads split over mp and the global layers' 2 (of
twice the width) are replicated (a window of 4 on 8 tokens), the KV-sharing and keys-as-values across
the kinds' own carries; every Gemma 4 control and the replicated-KV one detected (on the global layers
alone here). The transformers comparison of the same shapes is tests/test_hf_gemma4.py's
"gemma4-global" case."""

import jax
import jax.numpy as jnp
import pytest

from meshlm.errors import ConfigError, ShardingError
from meshlm.model.config import get_config
from meshlm.parallel.layout import Layout
from meshlm.proof import model_problem, verify
from meshlm.proof.controls import CONTROLS
from meshlm.proof.per_layer_controls import PER_LAYER_CONTROLS

# 4 layers (local, global, twice: the last two read layers 0 and 1's keys and values); local heads of
# 32 with 4 KV heads, global ones of 64 with 2, keys as values on them, a quarter of their pairs rotated
GLOBAL = dict(n_layers=4, global_every=2, n_kv_heads=4, global_head_dim=64, global_kv_heads=2)
GLOBAL |= dict(sliding_window=4)


def _cfg(**changes):
    return get_config("tiny-gemma4").replace(**{**GLOBAL, **changes})


def _prove_global(names=None) -> set:
    """The proof on 1x4 with the controls ``names`` of Gemma 4's and the replicated-KV one (None: every
    one), each detected; the names of the controls run."""
    cfg = _cfg()
    kv = [c for c in CONTROLS if c.name == "KV heads not replicated per query group"]
    controls = tuple(c for c in PER_LAYER_CONTROLS + tuple(kv) if names is None or c.name in names)
    problem = model_problem(cfg, "gemma4-global", Layout(mp=4), 1, 8)
    with jax.enable_x64(True):
        report = verify(problem, Layout(mp=4), dtype=jnp.float64, controls=controls)
    assert report.ok and all(c["detected"] for c in report.controls), (report.checks, report.controls)
    return {c["name"] for c in report.controls}


# The quick tier: the two faults of the global layers' own shape, their 2 KV heads replicated over mp = 4
# and their keys as values (each other control recompiles the train step)
QUICK_GLOBAL = ("KV heads not replicated per query group", "keys-as-values layer reading its own values")


def test_global_layers_of_their_own_shape_proven_with_their_shape_controls():
    assert _prove_global(QUICK_GLOBAL) == set(QUICK_GLOBAL)


# slow: the same proof with every Gemma 4 control (the KV sharing and the per-layer inputs too, each
# proven on its own in tests/test_gemma4.py): its cost is its scale; the global layers' bug class is
# caught quick by test_global_layers_of_their_own_shape_proven_with_their_shape_controls
@pytest.mark.slow
def test_global_layers_of_their_own_shape_proven_with_controls():
    dense = [c for c in PER_LAYER_CONTROLS if not c.name.startswith("MoE")]  # no experts here
    assert _prove_global() == {c.name for c in dense} | {"KV heads not replicated per query group"}


def test_stacks_and_shapes():
    """Two stacks: the local layers' [2, ...] of heads 32, the global layers' [2, ...] of 64; the
    global rotary of their own width (a quarter of 32 pairs: 8 rotate)."""
    from meshlm.model.attention import kind_tables
    from meshlm.model.params import flat_params
    from meshlm.model.transformer import param_shapes

    cfg = _cfg()
    shapes = {k: v.shape for k, v in flat_params(param_shapes(cfg)).items()}
    assert shapes["layers/attn/wk"] == (2, 64, 4, 32) and shapes["global_layers/attn/wk"] == (2, 64, 2, 64)
    assert shapes["global_layers/attn/wo"] == (2, 4, 64, 64) and "layers/attn/q_norm/scale" in shapes
    freqs = kind_tables(cfg.global_view())[1][1]
    assert freqs.shape == (32,) and int((freqs != 0).sum()) == 8


@pytest.mark.parametrize(
    "changes, layout, message",
    [
        (dict(global_kv_heads=3, n_heads=6, n_kv_heads=2), Layout(mp=2), "global_kv_heads=3 and mp=2"),
        (dict(global_kv_heads=3), None, "n_heads=4 is not a multiple of global_kv_heads=3"),
        (dict(sliding_window=0), None, "global_head_dim and global_kv_heads need"),
    ],
)  # fmt: skip
def test_refusals_are_one_line(changes, layout, message):
    from meshlm.model.transformer import param_shapes
    from meshlm.sharding.rules import model_specs

    with pytest.raises((ConfigError, ShardingError), match=message) as e:
        cfg = _cfg(**changes)
        model_specs(cfg, param_shapes(cfg), layout)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("preset", ["gemma4-e4b", "gemma4-31b"])
def test_real_presets_count_as_transformers_builds_them(preset):
    """`meshlm configs`' totals are transformers' own: its Gemma4ForCausalLM of the exported config
    built on the meta device (no memory), its layer scalars (buffers) included; the config reads back."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from meshlm.io import hf_config
    from meshlm.model.accounting import param_counts

    cfg = get_config(preset)
    hf = hf_config.config_to_hf(cfg)
    fields = {k: v for k, v in hf.items() if k not in ("dtype", "torch_dtype")}
    hf_cfg = transformers.Gemma4TextConfig(**fields)
    with torch.device("meta"):
        model = transformers.Gemma4ForCausalLM(hf_cfg)
    theirs = sum(p.numel() for p in model.parameters())
    theirs += sum(b.numel() for name, b in model.named_buffers() if name.endswith("layer_scalar"))
    assert param_counts(cfg).total == theirs
    assert hf_config.config_from_hf(hf_cfg.to_dict()) == cfg  # through transformers' per_layer_config


def test_the_periods_scan_is_the_runs_of_each_kind():
    """The stack's one scan over whole periods (local, global) computes what a scan per run of one
    kind computes, on 5 layers (2 periods, then a local layer after the last global one) with the last
    2 layers sharing KV: the logits agree to float32 rounding."""
    import haiku as hk
    import numpy as np

    from meshlm.model import per_layer_runs
    from meshlm.model.transformer import logits_fn
    from meshlm.parallel.context import Parallel

    cfg = _cfg(n_layers=5, kv_shared_layers=2)
    tokens = jnp.asarray(np.arange(24).reshape(2, 12) % cfg.vocab_size)
    model = hk.transform(logits_fn(cfg, Parallel()))  # jitted: op by op, each scan compiles a program
    params = jax.jit(model.init)(jax.random.PRNGKey(0), tokens)
    periods = jax.jit(lambda p, t: model.apply(p, None, t))(params, tokens)
    real = per_layer_runs._periods
    try:
        per_layer_runs._periods = lambda cfg, params, apply, xs, carry: (carry, 0, None)  # each run a scan
        runs = jax.jit(lambda p, t: model.apply(p, None, t))(params, tokens)  # a new function: traced anew
    finally:
        per_layer_runs._periods = real
    np.testing.assert_allclose(periods, runs, rtol=1e-5, atol=1e-5 * float(jnp.abs(runs).max()))


# slow: FSDP over the per-layer input table (its cost); FSDP's proof with its controls:
# tests/test_memory_options.py, the per-layer stack's: the proof above, both quick
@pytest.mark.slow
def test_fsdp_splits_the_per_layer_input_table_proven():
    """--fsdp splits the per-layer input table [V', L x P] over dp beside its vocabulary over mp (2.82B
    of the E4B's 7.46B parameters: without it the E4B's 2x4 FSDP plan held 1/5.5 of the whole per
    device, now 1/7.4); proven on 2x2 in float64 with the split stack, both FSDP controls detected."""
    from meshlm.model.transformer import param_shapes
    from meshlm.sharding.rules import model_specs

    layout = Layout(dp=2, mp=2, fsdp=True)
    cfg = _cfg(n_kv_heads=2, global_kv_heads=1)
    assert tuple(model_specs(cfg, param_shapes(cfg), layout)["embed_per_layer"]["embeddings"]) == ("mp", "dp")
    fsdp = tuple(c for c in CONTROLS if c.name.startswith("FSDP"))
    problem = model_problem(cfg, "gemma4-fsdp", layout, 2, 8)
    with jax.enable_x64(True):
        report = verify(problem, layout, dtype=jnp.float64, controls=fsdp)
    assert len(report.controls) == 2 and report.ok, (report.checks, report.controls)
