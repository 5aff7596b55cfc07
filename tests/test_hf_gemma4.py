"""Gemma 4 (text) from transformers: a tiny random ``Gemma4ForCausalLM`` (eager attention, no download,
every weight and each layer's ``layer_scalar`` perturbed) with local and global layers (a window of 4 on
16 tokens; the global layers' "proportional" RoPE rotating a quarter of each head), per-layer input
embeddings, keys as values on the global layers and the last 2 layers reading the KV of layers 3 and 2
converts with float32 logits within 1e-5 of transformers' (unsharded and on 2x2; of its float64 run
where its own float32 run is 1e-5 off), `meshlm generate --temperature 0` prints transformers' greedy
text on 1x1 and 1x2 (past several windows; the shared layers keep no cache of their own), and the
export loads back with equal logits. Each new piece, broken in code both verify's runs would share,
fails the comparison (shown). The MoE block
(``enable_moe_block``: the 26B-A4B's) the same, on the same model with 4 experts, 2 per token."""

from contextlib import ExitStack, contextmanager
from unittest import mock

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_harness import Case, Comparison, GreedyText, drift, family_fixture  # noqa: E402
from hf_helpers import RTOL, TINY, hf_logits, our_logits, rel  # noqa: E402

from meshlm.errors import ConfigError, ShardingError  # noqa: E402
from meshlm.io import hf_config  # noqa: E402
from meshlm.model import per_layer  # noqa: E402
from meshlm.model.config import get_config  # noqa: E402
from meshlm.parallel.layout import Layout  # noqa: E402
from meshlm.sharding.rules import check_uniform_stack  # noqa: E402

NEW = 16  # 4 windows: the local layers' rolling caches wrap several times
WINDOW = 4
LOCAL, GLOBAL = "sliding_attention", "full_attention"
KINDS = [LOCAL, LOCAL, GLOBAL] * 2


def _config(**changes):
    """6 layers (5 local, 1 global), heads of 16, 2 KV heads shared by the last 2 layers, keys as values."""
    kw = dict(head_dim=16, global_head_dim=16, intermediate_size=64, num_hidden_layers=6, layer_types=KINDS)
    kw |= dict(
        sliding_window=WINDOW, hidden_size_per_layer_input=8, vocab_size_per_layer_input=TINY["vocab_size"]
    )
    kw |= dict(num_kv_shared_layers=2, attention_k_eq_v=True, final_logit_softcapping=3.0, pad_token_id=0)
    rope = {
        LOCAL: {"rope_type": "default", "rope_theta": 1e4},
        GLOBAL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
    }
    return transformers.Gemma4TextConfig(
        **{**TINY, "num_key_value_heads": 2}, rope_parameters=rope, **kw | changes
    )


def _global_config():
    """Global layers of their own shape (as the real checkpoints: twice the head width, fewer KV heads,
    keys as values): 4 layers local, global twice, heads of 16 and 32, KV heads 2 and 1, the last 2
    layers reading the KV of layers 0 (local) and 1 (global)."""
    layers = dict(num_hidden_layers=4, layer_types=[LOCAL, GLOBAL] * 2)
    return _config(global_head_dim=32, num_global_key_value_heads=1, **layers)


def _rotary64(self, x, position_ids, layer_type):
    """transformers' rotary (its inverse frequencies and angles in float32) in float64."""
    theta = self.config.rope_parameters[layer_type]["rope_theta"]
    dim = getattr(self, f"{layer_type}_inv_freq").shape[0] * 2
    inv = (1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)) * (
        getattr(self, f"{layer_type}_inv_freq") != 0
    )
    angles = torch.cat([position_ids[..., None].double() * inv] * 2, dim=-1)
    return angles.cos().to(x.dtype), angles.sin().to(x.dtype)


@contextmanager
def _lifted():
    """transformers' Gemma 4 computing in its model's dtype what its code casts to float32 (the rotary
    angles and frequencies, its norms' and softmax's casts): in float64, the model to rounding."""
    from transformers.models.gemma4 import modeling_gemma4 as gemma4

    softmax = torch.nn.functional.softmax
    norm = lambda self, x: self._norm(x) * (self.weight if self.with_scale else 1)
    with ExitStack() as patches:
        patches.enter_context(mock.patch.object(gemma4.Gemma4TextRotaryEmbedding, "forward", _rotary64))
        patches.enter_context(mock.patch.object(gemma4.Gemma4RMSNorm, "forward", norm))
        lift = lambda x, dim=-1, dtype=None: softmax(x, dim=dim)
        patches.enter_context(mock.patch.object(torch.nn.functional, "softmax", lift))
        yield


def _moe_config():
    """``_config`` with the MoE block beside every layer's MLP: 4 experts of 32 units, 2 per token."""
    return _config(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)


def _scalars(model):
    """transformers' ``layer_scalar`` buffers (perturbed_model leaves buffers at 1): 0.8 ... 1.3; with
    the MoE block each layer's ``per_expert_scale`` 0.5 ... 2 (not near its 1: a scale not applied shows)."""
    for i, layer in enumerate(model.model.layers):
        layer.layer_scalar.fill_(0.8 + i / 10)
        if getattr(layer, "enable_moe_block", False):
            layer.router.per_expert_scale.copy_(
                torch.linspace(0.5, 2.0, layer.router.per_expert_scale.numel())
            )


def _kv_cache(out):
    """generate --json's ``kv_cache``: the local layers' caches roll over the window; the 2 shared
    layers keep none: the bytes are layers 0-3's, 3 local and 1 global (of 2 KV heads of 16, float32,
    one row), where all 6 layers' would be 4 local and 2 global."""
    cache = out["kv_cache"]
    assert cache.get("local_slots") == WINDOW and cache["slots"] > 3 * WINDOW
    assert cache["total"] == 2 * (3 * WINDOW + 1 * cache["slots"]) * 2 * 16 * 4


def _global_kv_cache(out):
    """The global layer's cache holds its own KV head of 32 (layers 0 and 1 keep one; 2 and 3 share):
    2 x (4 slots x 2 heads x 16 + S slots x 1 head x 32) x 4 bytes."""
    cache = out["kv_cache"]
    assert cache.get("local_slots") == WINDOW and cache["slots"] > WINDOW
    assert cache["total"] == 2 * (WINDOW * 2 * 16 + cache["slots"] * 1 * 32) * 4


family = family_fixture(
    [
        Case(
            "gemma4",
            "Gemma4ForCausalLM",
            _config,
            reads=dict(
                global_every=3,
                sliding_window=WINDOW,
                rope_global_fraction=0.25,
                ple_dim=8,
                kv_shared_layers=2,
                k_eq_v=True,
                final_softcap=3.0,
                attn_scalar=1.0,
            ),
            init=0.3,
            seed=1,
            # against transformers' model in float64 (its float32 steps lifted): its own float32 logits
            # are 1.0e-5 off those here, ours 5.3e-6 (3.3e-6 on 2x2); ours - theirs in float32 1.2e-5
            reference64=True,
            lifted=_lifted,
            eager=True,
            new=NEW,
            prepare=_scalars,
            generated=_kv_cache,
        ),
        Case(
            "gemma4-global",
            "Gemma4ForCausalLM",
            _global_config,
            reads=dict(family="gemma4", global_every=2, global_head_dim=32, global_kv_heads=1, k_eq_v=True),
            init=0.3,
            seed=2,
            eager=True,
            new=NEW,
            prepare=_scalars,
            generated=_global_kv_cache,
        ),
        Case(
            "gemma4-moe",
            "Gemma4ForCausalLM",
            _moe_config,
            reads=dict(
                family="gemma4_moe",
                n_experts=4,
                experts_per_token=2,
                moe_d_ff=32,
                router_norm=True,
                expert_scale=True,
                expert_glu="geglu",
            ),
            init=0.3,
            seed=3,
            # measured 1.7e-5 unsharded, 1.1e-5 on 2x2 (against transformers' float64 run, its float32
            # steps lifted, 2.8e-5: the two float32 programs share part of their error here); exact in
            # float64 (below)
            tol=2e-5,
            eager=True,
            new=NEW,
            prepare=_scalars,
            generated=_kv_cache,
        ),
    ]
)


class TestTransformers(Comparison, GreedyText):
    """Logits unsharded and on 2x2, the export, greedy text on 1x1 and 1x2 (tests/hf_harness.py)."""


# gemma4 quick; its global-shape and MoE variants slow: the same float64 comparison on two more cases
# (scale; each is compared in float32 quick by the harness)
@pytest.mark.parametrize(
    "family",
    [
        "gemma4",
        pytest.param("gemma4-global", marks=pytest.mark.slow),
        pytest.param("gemma4-moe", marks=pytest.mark.slow),
    ],
    indirect=True,
)
def test_logits_exact_in_float64(family):
    """In float64, with transformers' own float32 steps lifted (``_lifted``), our logits are
    transformers' to rounding: the float32 comparison's difference is the two programs' float32
    rounding, not a difference of model."""
    import jax
    import numpy as np

    load = dict(attn_implementation="eager", experts_implementation="eager")  # torch's grouped_mm: no float64
    model = transformers.Gemma4ForCausalLM.from_pretrained(family["hf"], **load).double()
    cfg, flat = family["case"].load(family["hf"])
    with jax.enable_x64(True):
        ours = our_logits(cfg, {k: np.asarray(v, np.float64) for k, v in flat.items()}, family["tokens"])
    with _lifted():
        assert rel(ours, hf_logits(model, family["tokens"])) < 1e-12


@pytest.mark.parametrize("family", ["gemma4"], indirect=True)
def test_each_piece_broken_fails_the_transformers_comparison(family, monkeypatch):
    """A bug both verify's runs would share shows against transformers: a global layer's own values
    (not its keys'), a shared layer's own keys and values, the per-layer inputs a layer off."""
    plants = {
        "keys_as_values": lambda kind, k, v: v,
        "read_shared": lambda shared, k, v, kind, reuse: per_layer_read(shared, k, v, kind, False),
        "in_layer_order": lambda ple: ple[::-1],
    }
    per_layer_read = per_layer.read_shared
    for name, planted in plants.items():
        with monkeypatch.context() as m:
            m.setattr(per_layer, name, planted)
            assert drift(family) > 100 * RTOL, name


# slow: a planted MoE-block bug against transformers (its cost); the same check of every other piece quick:
# test_each_piece_broken_fails_the_transformers_comparison
@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma4-moe"], indirect=True)
def test_moe_block_broken_fails_the_transformers_comparison(family, monkeypatch):
    """The MoE block's classic bugs show against transformers: the router reading the experts' normed
    input (not the residual), SiLU experts (not gelu-tanh), the per-expert scales or the router's input
    norm and scale left out; the correct block does not drift."""
    assert drift(family) < 100 * RTOL
    with monkeypatch.context() as m:
        m.setattr(per_layer, "router_input", lambda residual, experts_in: experts_in)
        assert drift(family) > 100 * RTOL
    for change in ({"expert_glu": "swiglu"}, {"expert_scale": False}, {"router_norm": False}):
        assert drift(family, **change) > 100 * RTOL, change


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"enable_moe_block": True, "top_k_experts": 2, "moe_intermediate_size": 8}, "num_experts"),
        ({"use_double_wide_mlp": True}, "double-wide"),
        ({"per_layer_config": {"0": {"head_dim": 64}}}, "per_layer_config"),
        ({"per_layer_config": {"2": {"head_dim": 64, "sliding_window": 2}, "5": {}}}, "per_layer"),
        ({"layer_types": [GLOBAL, LOCAL, LOCAL, LOCAL, LOCAL, GLOBAL]}, "repeating"),
    ],
)  # fmt: skip
def test_unsupported_config_is_one_line(changes, message):
    base = hf_config.config_to_hf(get_config("tiny-gemma4"))
    with pytest.raises(ConfigError, match=message) as e:
        hf_config.config_from_hf({**base, **changes})
    assert "\n" not in str(e.value)


def test_global_shape_read_as_transformers():
    """transformers' rules (``Gemma4TextConfig.__post_init__``): global_head_dim 512 where left out,
    num_global_key_value_heads only with keys as values; its saved per_layer_config the same shape."""
    base = hf_config.config_to_hf(get_config("tiny-gemma4"))
    read = lambda **changes: hf_config.config_from_hf({**base, **changes})
    no_width = {k: v for k, v in base.items() if k != "global_head_dim"}
    assert hf_config.config_from_hf(no_width).global_view().dim_per_head == 512
    assert read(num_global_key_value_heads=1).global_kv_heads == 1
    assert read(num_global_key_value_heads=1, attention_k_eq_v=False).global_kv_heads == 0
    saved = {"2": {"head_dim": 64, "num_key_value_heads": 1}, "5": {"head_dim": 64, "num_key_value_heads": 1}}
    assert read(per_layer_config=saved) == read(global_head_dim=64, num_global_key_value_heads=1)
    assert read(per_layer_config=saved).global_shape and not read().global_shape


def test_global_kv_heads_without_keys_as_values_refused_on_export():
    cfg = get_config("tiny-gemma4").replace(global_kv_heads=1, k_eq_v=False)
    with pytest.raises(ConfigError, match="only with keys as values"):
        hf_config.config_to_hf(cfg)


@pytest.mark.parametrize("preset", ["tiny-gemma4", "tiny-gemma4-moe"])
def test_preset_config_round_trip(preset):
    cfg = get_config(preset)
    assert hf_config.config_from_hf(hf_config.config_to_hf(cfg)) == cfg


@pytest.mark.parametrize("layout", [Layout(pp=2), Layout(mp=2, sp=True)], ids=["pp", "sp"])
def test_pipeline_and_sequence_split_refused_in_one_line(layout):
    """The stack's carry (shared keys and values) and per-layer inputs: no pipeline stage passes them on,
    and no sequence split slices them; each a one-line error before any work."""
    with pytest.raises(ShardingError, match="drop --") as e:
        check_uniform_stack(get_config("tiny-gemma4"), layout)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "config", [_config, _global_config, _moe_config], ids=["gemma4", "gemma4-global", "gemma4-moe"]
)
def test_parameter_count_is_transformers(config):
    """`meshlm configs`' count (``accounting.param_counts``) is transformers' (its layer scalars, buffers
    there, included): the never-read ``wk``, ``wv`` of each uniform stack are not counted."""
    from meshlm.model.accounting import param_counts

    model = transformers.Gemma4ForCausalLM(config())
    theirs = sum(p.numel() for p in model.parameters())
    theirs += sum(b.numel() for name, b in model.named_buffers() if name.endswith("layer_scalar"))
    assert param_counts(hf_config.config_from_hf(config().to_dict())).total == theirs
