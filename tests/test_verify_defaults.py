"""``meshlm verify``'s default shapes expose the classic bugs the old ones hid (issue 36,
``meshlm.proof.defaults``): more micro-batches than stages, an interleaved V other than pp, one row per
data shard, several attention blocks per shard with a last block of one row. Flags given are kept.
(The bugs themselves, planted and caught by verify with these defaults: scripts/plant_*_bugs.sh.)"""

from meshlm.cli.verify import _shapes, _with_defaults
from meshlm.cli.verify_settings import VerifySettings
from meshlm.model.config import get_config
from meshlm.parallel.layout import Layout
from meshlm.proof import defaults


def test_pipeline_defaults_more_microbatches_than_stages_and_v_not_pp():
    def options(**given):
        return _with_defaults(VerifySettings(**given)).layout_options()

    got = options(config="tiny-llama", pp=2)
    assert got["microbatches"] == 4 > got["pp"] == 2
    got = options(config="tiny-deep", pp=2, pp_schedule="interleaved")
    assert (got["virtual_stages"], got["microbatches"]) == (4, 4)  # 8 layers: V 3 does not split them
    assert defaults.virtual_stages(3, 12) == 2 and defaults.virtual_stages(2, 12) == 3
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
