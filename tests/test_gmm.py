"""The "gmm" dispatch (``parallel.gmm_kernel``: JAX's Pallas megablox grouped matmul on the sorted rows).

The float64 proof runs the dispatch with the kernel's reference path (``tests/test_ep.py``'s gmm cases,
``meshlm verify --moe-dispatch gmm``); here the kernel itself, in Pallas interpret mode on CPU (the
TPU's kernel code, run by the interpreter), inside ``shard_map`` over ep and dp, against the all-local
reference in float32, value and gradients; the tiles it is given; and the control that puts its group
offsets one row off."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_ep import local, routing

from meshlm.errors import ConfigError
from meshlm.model.moe import Experts
from meshlm.parallel.axes import EP
from meshlm.parallel.context import Parallel
from meshlm.parallel.gmm_tiling import parse_tiling, row_tile, tiles
from meshlm.parallel.layout import Layout
from meshlm.proof.moe_controls import GroupOffsetsOneRowOff

E, K, N, D, H = 8, 2, 6, 3, 5  # test_ep's shapes: experts, choices per token, tokens per shard, widths


def test_tiles():
    """tm: the largest of 512, 256, 128 whose group-boundary tiles add at most half (qwen3-moe-100m at
    8 x 512: 16384 rows over 32 experts -> 256; qwen3-30b-a3b's 32768 over 128 -> 128); tk, tn: the
    largest multiple of 128 up to 512 dividing the dimension (768: 384; 2048: 512; below 128 whole;
    640: 128); --gmm-tiling fixes tm and caps tk, tn; bad text is one line."""
    assert row_tile(16384, 32) == 256 and row_tile(32768, 128) == 128 and row_tile(65536, 8) == 512
    assert row_tile(48, 8) == 128
    assert tiles(256, 768, 256, None) == (256, 384, 256) and tiles(128, 2048, 768, None) == (128, 512, 384)
    assert tiles(128, 3, 640, None) == (128, 3, 128)
    fixed = parse_tiling("256,256,1024")
    assert row_tile(16384, 32, fixed) == 256 and tiles(256, 2048, 1024, fixed) == (256, 256, 1024)
    assert parse_tiling("auto") is None
    for bad in ("128,512", "128,100,512", "a,b,c"):
        with pytest.raises(ConfigError, match="--gmm-tiling"):
            parse_tiling(bad)


def test_the_kernel_in_shard_map_equals_the_reference():
    """dp 2 x ep 2 (each ep shard 4 experts, the group's 2 x 6 tokens), expert biases, every token's
    choices among experts 0 and 1: ep shard 1's groups are all empty (every row in the group of no
    expert: zeros out, zero weight gradients). Float32, the kernel in interpret mode."""
    dispatch = "gmm"
    layout = Layout(dp=4, ep=2)
    par = Parallel.on(layout)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(4 * N, D)), jnp.float32)
    ids = jnp.asarray(routing(rng, 4 * N, True, 0))
    cw = jnp.asarray(rng.uniform(size=(4 * N, K)), jnp.float32)
    shapes = ((E, D, H), (E, D, H), (E, H, D), (E, H), (E, H))
    weights = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes]
    cot = jnp.asarray(rng.normal(size=(4 * N, D)), jnp.float32)

    def body(x, ids, cw, *weights):
        return par.experts(x, ids, cw, Experts(*weights[:3], dispatch, 0, *weights[3:]))

    rows = P(layout.rows)
    sharded = jax.shard_map(body, mesh=layout.mesh, in_specs=(rows,) * 3 + (P(EP),) * 5, out_specs=rows)
    loss = lambda f: lambda x, cw, *w: jnp.sum(f(x, ids, cw, *w) * cot)
    got = jax.jit(jax.value_and_grad(loss(sharded), argnums=tuple(range(7))))(x, cw, *weights)
    reference = lambda x, ids, cw, *w: local(x, ids, cw, w)
    want = jax.jit(jax.value_and_grad(loss(reference), argnums=tuple(range(7))))(x, cw, *weights)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * max(1.0, float(jnp.max(jnp.abs(b))))


def test_offsets_one_row_off_change_the_output():
    """The control's plant, float64 (the reference path): the first expert with rows hands one to the
    next; the output is no longer the reference's, and the plain dispatch's still is."""
    rng = np.random.default_rng(1)
    with jax.enable_x64(True):
        x = jnp.asarray(rng.normal(size=(N, D)))
        ids = jnp.asarray(routing(rng, N, False, 0))
        cw = jnp.asarray(rng.uniform(size=(N, K)))
        weights = [jnp.asarray(rng.normal(size=s)) for s in ((E, D, H), (E, D, H), (E, H, D))]
        # jitted: each one program, as the layer runs (not one per operation)
        want = jax.jit(lambda x, ids, cw, *w: local(x, ids, cw, w))(x, ids, cw, *weights)
        plain, planted = (
            jax.jit(lambda x, ids, cw, *w, par=par: par.experts(x, ids, cw, Experts(*w, "gmm")))(
                x, ids, cw, *weights
            )
            for par in (Parallel(), GroupOffsetsOneRowOff())
        )
        assert float(jnp.max(jnp.abs(plain - want))) <= 1e-12 * float(jnp.max(jnp.abs(want)))
        assert float(jnp.max(jnp.abs(planted - want))) > 1e-3


# ~60 s on a loaded 2-core machine (a proof, every control compiled); gmm's values and gradients in
# float64, quickly: tests/test_ep.py::test_dispatch_equals_all_local (its gmm cases); its offsets control:
# test_offsets_one_row_off_change_the_output
@pytest.mark.slow
def test_gmm_is_proven_in_float64_on_cpu_with_its_controls():
    """tiny-qwen2-moe (a dense layer 0, a MoE layer with a shared expert) on 2x2 in float64 by gmm (the
    kernel's reference path), the reference "dense" as always: loss and every gradient equal the
    unsharded model's, and gmm's own control, its group offsets one row off, is detected beside the
    sorted dispatch's rows control."""
    from helpers import verify_preset

    from meshlm.model.config import get_config
    from meshlm.proof import format_report
    from meshlm.proof.moe_controls import MOE_CONTROLS

    cfg = get_config("tiny-qwen2-moe").replace(n_layers=2, moe_dispatch="gmm")
    with jax.enable_x64(True):
        report = verify_preset(
            "tiny-qwen2-moe", 2, 2, batch=2, seq=8, dtype=jnp.float64, cfg=cfg, controls=MOE_CONTROLS
        )
    assert report.ok and max(p.max_rel_err for p in report.params) <= 1e-12, format_report(report)
    names = {c["name"] for c in report.controls}
    assert {"MoE gmm group offsets one row off", "MoE rows sent to the wrong expert after sorting"} <= names
