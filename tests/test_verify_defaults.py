"""``meshlm verify``'s default shapes expose the classic bugs the old ones hid (issue 36,
``meshlm.proof.defaults``): more micro-batches than stages, an interleaved V other than pp, one row per
data shard, several attention blocks per shard with a last block of one row. Flags given are kept.
(The bugs themselves, planted and caught by verify with these defaults: scripts/plant_*_bugs.sh.)"""

import jax
import jax.numpy as jnp

from meshlm.cli.verify import _shapes, _with_defaults
from meshlm.cli.verify_settings import VerifySettings
from meshlm.model.config import get_config
from meshlm.parallel.layout import Layout
from meshlm.proof import cp_controls, defaults, format_report, model_problem, verify
from meshlm.proof.control_record import Where


def test_pipeline_defaults_more_microbatches_than_stages_and_v_not_pp():
    def options(**given):
        return _with_defaults(VerifySettings(**given)).layout_options()

    got = options(config="tiny-llama", pp=2)
    assert got["microbatches"] == 4 > got["pp"] == 2
    got = options(config="tiny-deep", pp=2, pp_schedule="interleaved")
    assert (got["virtual_stages"], got["microbatches"]) == (4, 4)  # 8 layers: V 3 does not split them
    twelve = get_config("tiny-deep").replace(n_layers=12)
    assert defaults.virtual_stages(3, twelve) == 2 and defaults.virtual_stages(2, twelve) == 3
    # 40 layers: V 4 would make chunks of 5, which a hybrid with periods of 4 layers cannot run; V 5: of 4
    hybrid = get_config("tiny-qwen3.5").replace(n_layers=40, full_attn_every=4)
    assert (
        defaults.virtual_stages(2, hybrid) == 5
        and defaults.virtual_stages(2, twelve.replace(n_layers=40)) == 4
    )
    assert options(pp=2, microbatches=2)["microbatches"] == 2  # given: kept
    assert (options()["microbatches"], options()["virtual_stages"]) == (1, 1)  # no pipeline: none


def test_one_row_per_data_shard_per_microbatch():
    assert defaults.batch_rows(dp=2, microbatches=1) == 2 and defaults.batch_rows(2, 4) == 8


def test_blocks_leave_a_last_block_of_one_row():
    cfg = get_config("tiny-llama")  # 64 tokens
    blockwise = VerifySettings(config="tiny-llama", attention="blockwise")
    assert _shapes(blockwise, cfg, Layout()) == (64, 21)  # 3 blocks of 21 and one of 1
    assert _shapes(VerifySettings(config="tiny-llama", cp=2), cfg, Layout(cp=2)) == (64, 31)  # 32 a shard
    assert _shapes(VerifySettings(config="tiny-llama", cp=4), cfg, Layout(cp=4)) == (64, 5)
    given = VerifySettings(config="tiny-llama", attention="blockwise", attn_block=16)
    assert _shapes(given, cfg, Layout()) == (49, 16)  # --attn-block given: a ragged length
    t, block = _shapes(VerifySettings(config="tiny-llama", cp=2, attn_block=8), cfg, Layout(cp=2))
    assert (t, block) == (60, 8) and (t // 2) % 8  # even shard lengths cannot leave one row: ragged
    both = VerifySettings(config="tiny-llama", attention="blockwise", attn_block=16, seq_len=64)
    assert _shapes(both, cfg, Layout()) == (64, 16)  # both given: kept
    assert _shapes(VerifySettings(config="tiny-llama"), cfg, Layout()) == (64, 512)  # no kernel: unused


def _edge_met(cfg, vs: VerifySettings, layout: Layout, t: int, block: int) -> bool:
    """Whether the block-skip control applies (``cp_controls._skip_edge_met``) at these shapes."""
    at = cfg.replace(
        attention=vs.attention_kind("cpu", 64), attn_block=block
    )  # as verify resolves "auto" on CPU
    return cp_controls._skip_edge_met(Where(cfg=at, layout=layout, has_row_bias=False, seq_len=t))


def test_windowed_models_get_blocks_that_meet_the_window_edge():
    """A sliding window W's block skip has an edge of its own: a K/V block whose last key is a query
    block's first query - W + 1 (visible to that query alone). The default blocks put one there, as
    they put the causal skip's edge (a last block of one row) and keep that one too where they can
    (Gemma 2 and 3: local and global layers, both skips). The old default, 21 at T = 64, met neither
    tiny-mistral-w10's window edge; --seq-len given is kept and the block chosen for it."""
    cfg = get_config("tiny-mistral-w10")  # W = 10
    vs = VerifySettings(config="tiny-mistral-w10", attention="blockwise")
    t, block = _shapes(vs, cfg, Layout())
    assert (t, block) == (57, 8)  # 7 blocks of 8 and one of 1
    starts = range(0, t, block)  # by hand: the query block at 16 sees key 7 = 16 - 10 + 1, block 0..7's last
    assert {q0 - 10 + 1 for q0 in starts} & {k0 + block - 1 for k0 in starts}
    assert not _edge_met(cfg, vs, Layout(), 64, 21)  # the old default
    kept = VerifySettings(config="tiny-mistral-w10", attention="blockwise", seq_len=64)
    assert _shapes(kept, cfg, Layout()) == (64, 8)
    ring, gather = Layout(cp=2), Layout(cp=2, cp_strategy="allgather")
    for name in ("tiny-mistral-w10", "tiny-mistral", "tiny-gemma2", "tiny-gemma3"):
        cfg = get_config(name)
        for given, layout in (
            (dict(attention="blockwise"), Layout()),
            (dict(attention="blockwise", seq_len=64), Layout()),
            (dict(cp=2), ring),
            (dict(cp=2, cp_strategy="allgather", attention="blockwise"), gather),
            (dict(cp=4), Layout(cp=4)),
        ):
            vs = VerifySettings(config=name, **given)
            t, block = _shapes(vs, cfg, layout)
            assert _edge_met(cfg, vs, layout, t, block), (name, given, t, block)
            if cfg.global_every and "seq_len" not in given:  # the global layers' causal edge too
                assert t // layout.cp % block == 1, (name, given, t, block)
    cfg, vs = get_config("tiny-mistral-w10"), VerifySettings(config="tiny-mistral-w10", attention="blockwise")
    for layout in (Layout(), ring, gather, Layout(cp=4)):  # numpy, before the devices: as the control's
        for t, block in ((t, b) for t in (56, 57, 63, 64) for b in range(3, 12)):
            mine = defaults.window_edge_met(t, block, window=10, layout=layout)
            assert mine == _edge_met(cfg, vs, layout, t, block), (layout.label(), t, block)
    llama = VerifySettings(config="tiny-llama", attention="blockwise")
    assert _shapes(llama, get_config("tiny-llama"), Layout()) == (64, 21)  # no window: as before


def test_the_window_skip_mutant_fails_verify_at_the_default_shapes():
    """Mutant caught (issue 47, round 5): in ``model/blockwise.py``'s ``_needed``, ``last_key >
    first_query - w`` planted as ``last_key > first_query - w + 1`` (the control "block-skip rule off by
    one" plants the same rule: window - 1). Through the prover's comparison at verify's default shapes
    for tiny-mistral-w10 (blockwise, float64, 1x2): detected. (The whole ``meshlm verify --config
    tiny-mistral-w10 --mesh 1x2 --devices 2 --x64 --steps 2 --attention blockwise`` with the mutant in
    the source fails, worst relative error 4.0e-1, and passes without it, 2.3e-14.)"""
    cfg = get_config("tiny-mistral-w10")
    t, block = _shapes(VerifySettings(config="tiny-mistral-w10", attention="blockwise"), cfg, Layout(mp=2))
    cfg = cfg.replace(attention="blockwise", attn_block=block, n_layers=1)  # one layer: the shapes are W's
    (control,) = [c for c in cp_controls.CP_CONTROLS if c.name == "block-skip rule off by one"]
    with jax.enable_x64(True):
        problem = model_problem(cfg, "tiny-mistral-w10", 2, 1, t)
        report = verify(problem, Layout(mp=2), dtype=jnp.float64, controls=(control,))
    assert report.ok, format_report(report)
    assert [c["name"] for c in report.controls] == [control.name] and report.controls[0]["detected"]
