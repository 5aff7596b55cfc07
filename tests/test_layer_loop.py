"""The straight-line layer stack as a Python loop (``model.layer_loop``, ``MESHLM_LAYER_LOOP=python``: a
form to measure against) and the fully unrolled scan (every backend's): the same parameters bit for bit,
the same float64 loss and gradients, and what the loop is: no residual stacked over the layers (the
scan's are [L, B, ...])."""

import re

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals  # print_saved_residuals' list (not re-exported)

from meshlm.errors import ConfigError
from meshlm.model.config import get_config
from meshlm.model.layer_loop import ENV, straight_line_form
from meshlm.parallel.context import Parallel
from meshlm.parallel.layout import Layout
from meshlm.train.step import init_model, loss_fn

B, T = 2, 16
# one preset per stack path: layer_stack (dense), its per-layer inputs (kinds), the MoE stack, the
# hybrid's runs of two kinds (``_mixed_stack``), Gemma 4's periods (``per_layer_runs``)
# slow, every stack path: the loop is no backend's form (``straight_line_form``), an option to measure
# with, so its proofs and its residuals' test are the slow tier's (their cost: 9-45 s each); quick: the
# form each backend picks, below
SLOW = pytest.mark.slow
PRESETS = (
    pytest.param("tiny-llama", marks=SLOW),
    pytest.param("tiny-gemma3", marks=SLOW),
    pytest.param("tiny-mixtral", marks=SLOW),
    pytest.param("tiny-qwen3.5", marks=SLOW),
    pytest.param("tiny-gemma4", marks=SLOW),
)


def _loss_and_grads(name: str, form: str, monkeypatch):
    monkeypatch.setenv(ENV, form)
    cfg = get_config(name).replace(unroll=0)
    layout = Layout.of(jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("dp", "mp")))
    params, _ = init_model(cfg, layout, 0, dtype=jnp.float64 if jax.config.jax_enable_x64 else None)
    rng = np.random.default_rng(0)
    batch = {
        k: jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)), jnp.int32) for k in ("inputs", "targets")
    }
    apply = hk.without_apply_rng(hk.transform(loss_fn(cfg, Parallel(), False))).apply
    loss = lambda p: apply(p, batch)
    return cfg, params, jax.value_and_grad(loss)(params), loss


@pytest.mark.parametrize("name", PRESETS)
def test_python_loop_equals_the_scan_in_float64(name, monkeypatch):
    with jax.enable_x64(True):
        _, p_scan, (l_scan, g_scan), _ = _loss_and_grads(name, "scan", monkeypatch)
        _, p_loop, (l_loop, g_loop), _ = _loss_and_grads(name, "python", monkeypatch)
    assert jax.tree.structure(p_scan) == jax.tree.structure(p_loop)
    for a, b in zip(jax.tree.leaves(p_scan), jax.tree.leaves(p_loop), strict=True):
        np.testing.assert_array_equal(a, b)  # Haiku's own init: checkpoints and seeds unchanged
    assert abs(float(l_loop) - float(l_scan)) <= 1e-12 * abs(float(l_scan))
    for a, b in zip(jax.tree.leaves(g_scan), jax.tree.leaves(g_loop), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-11, atol=1e-13)


def _layer_stacked_residuals(form: str, monkeypatch) -> list:
    cfg, params, _, loss = _loss_and_grads("tiny-llama", form, monkeypatch)
    shapes = [aval.shape for aval, _ in saved_residuals(loss, params)]
    return [s for s in shapes if len(s) >= 3 and s[0] == cfg.n_layers and s[1] == B]


@SLOW
def test_python_loop_saves_no_residual_stacked_over_layers(monkeypatch):
    assert _layer_stacked_residuals("python", monkeypatch) == []
    # the control: the scan's residuals are [L, B, ...] (what this test exists to catch)
    assert len(_layer_stacked_residuals("scan", monkeypatch)) >= 4


def test_the_backend_picks_the_form_and_a_bad_override_is_refused(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert straight_line_form() == "scan"
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")  # the form measured faster on the chip
    assert straight_line_form() == "scan"
    monkeypatch.setenv(ENV, "python")
    assert straight_line_form() == "python"
    monkeypatch.setenv(ENV, "unrolled")
    with pytest.raises(ConfigError, match="MESHLM_LAYER_LOOP='unrolled' is not a layer-loop form"):
        straight_line_form()


IN_PLACE = ("dynamic-update-slice", "scatter")  # write into their operand's buffer
PASSED = ("parameter", "get-tuple-element", "tuple", "bitcast", *IN_PLACE)  # make no new [L, ...] value


def _cache_copies(hlo: str, shape: tuple, dtype: str = "f32") -> list:
    """The instructions of an HLO module whose value has the stacked cache's ``shape`` and is a new
    one: not a parameter, an in-place write, or a fusion rooted in one (a concatenate, a copy, a
    fusion stacking slices: the cache copied)."""
    full = f"{dtype}[{','.join(map(str, shape))}]"
    roots, ops = {}, []
    computation = None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and "{" in line:  # a computation's header
            computation = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
        op = line.split(" = ", 1)[1] if " = " in line else ""
        kind = m.group(1) if (m := re.search(r"([a-z][a-z\-]*)\(", op)) else ""  # the opcode
        if line.strip().startswith("ROOT "):
            roots[computation] = kind
        if op.startswith(full):
            ops.append((kind, op.split("calls=%", 1)[1].split(",")[0] if "calls=%" in op else None))
    return [(k, c) for k, c in ops if k not in PASSED and not (k == "fusion" and roots.get(c) in IN_PLACE)]


@pytest.mark.parametrize("form", ["scan", pytest.param("python", marks=SLOW)])
def test_a_decode_step_writes_the_stacked_cache_in_place(form, monkeypatch):
    """A decode step (the scan, every backend's form; the loop's in the slow tier) writes each layer's
    new token into the donated stacked cache [L, B, S, Kc * E] (``kv_kinds.carried_stack``): no op
    copies it (per-layer inputs and outputs sliced it apart and stacked it again, a copy per step)."""
    from meshlm.generate.cache import cache_shapes
    from meshlm.generate.generator import Generator

    monkeypatch.setenv(ENV, form)
    cfg = get_config("tiny-llama")
    layout = Layout.of(jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("dp", "mp")))
    params, _ = init_model(cfg, layout, 0)
    gen = Generator(cfg, params, layout, max_len=64, eod=None)
    hlo = gen._executables(2, ("decode",))["decode"].as_text()  # the decode step alone
    shape = cache_shapes(cfg, 1, 2, 64)["k"]
    assert f"f32[{','.join(map(str, shape))}]" in hlo  # the cache is there, as the step's parameter
    assert _cache_copies(hlo, shape) == []
