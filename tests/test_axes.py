"""Each mesh axis declared once (``parallel.axes.AXES``) and read by the layout; the step's strategy
chosen once by it; ``Parallel`` and the proof's ``Where`` holding a ``Layout``; the planted-fault taps
living in the proof, not in the ground-floor ``Parallel``. No device work: all cheap."""

from __future__ import annotations

import dataclasses

import pytest

from meshlm.errors import ConfigError
from meshlm.parallel.axes import AXES, LOGICAL_DIMS
from meshlm.parallel.context import Parallel
from meshlm.parallel.layout import Layout, devices_layout, early_layout
from meshlm.proof.control_record import Where
from meshlm.proof.taps import Tapped
from meshlm.sharding.strategy import Pipelined, Sharded, strategy

# Checkpoint metadata written before the axes were declarations: each reads back to itself.
OLD_RECORDS = (
    {"dp": 2, "mp": 2, "fsdp": False, "sp": False},
    {"dp": 4, "mp": 1, "fsdp": True, "sp": False},
    {
        "pp": 2,
        "dp": 1,
        "mp": 2,
        "fsdp": False,
        "sp": False,
        "microbatches": 4,
        "pp_schedule": "1f1b",
        "virtual_stages": 1,
    },
    {"dp": 2, "cp": 2, "mp": 1, "fsdp": True, "sp": False, "cp_strategy": "allgather"},
    {"dp": 4, "ep": 2, "mp": 2, "fsdp": True, "sp": True},  # ep: the batch shards dp, ep of them experts
)


@pytest.mark.parametrize("record", OLD_RECORDS, ids=lambda r: Layout.from_dict(r).label())
def test_checkpoint_records_read_back_the_same(record):
    layout = Layout.from_dict(record)
    assert layout.to_dict() == record and list(layout.to_dict()) == list(record)  # same keys, same order


def test_every_axis_is_a_layout_field_with_its_options_and_flags():
    fields = {f.name for f in dataclasses.fields(Layout)}
    for axis in AXES:
        assert {axis.name, *axis.options} <= fields
        assert axis.flags[0] == f"--{axis.name}"
        assert set(axis.dims) <= set(LOGICAL_DIMS)
    assert [a.name for a in AXES] == ["pp", "dp", "ep", "cp", "mp"]  # the mesh order
    assert Layout(dp=2, mp=2, cp=2, fsdp=True).label() == "2x2 + CP2 ring + FSDP"
    assert Layout(mp=2, pp=2, microbatches=4, sp=True).label() == "pp2x1x2 + SP (1f1b, M=4)"


def test_the_layout_picks_the_strategy_once():
    assert isinstance(strategy(Layout(dp=2, mp=2)), Sharded) and strategy(Layout()).generates
    piped = Layout(mp=2, pp=2, microbatches=2)
    assert isinstance(strategy(piped), Pipelined) and not strategy(piped).generates
    # what the proof asks of the strategy, not of the layout (``proof.prover``, ``proof.routing``)
    facts = lambda s: (s.proof_collectives, s.probes_routing, s.engine_faults)
    assert facts(strategy(piped)) == ("permutes", False, True)
    assert facts(strategy(Layout(dp=2, ep=2, cp=2))) == ("all-reduces", True, False)
    assert piped.pipelined and piped.extra_axes == ("pp",) and piped.pipeline_microbatches == 2
    ctx = Layout(dp=2, cp=2, cp_strategy="allgather")
    assert ctx.context_parallel and not ctx.cp_ring and ctx.batch_axes == ("dp", "cp")
    assert Layout(dp=2).batch_axes == ("dp",) and not Layout(dp=2).extra_axes
    assert Layout(mp=2, pp=2).logical_axes()["layers"] == "pp" and "layers" not in Layout().logical_axes()
    assert Layout(dp=2, fsdp=True).option_axes() == {"embed": "dp"} and Layout(dp=2).option_axes() == {}


def test_axis_checks_run_where_the_layout_is_built():
    with pytest.raises(ConfigError, match="--cp-strategy 'spiral' is not one of ring, allgather"):
        Layout(cp=2, cp_strategy="spiral")
    with pytest.raises(ConfigError, match="--microbatches needs a pipeline"):
        Layout(microbatches=2)


def test_parallel_and_where_hold_a_layout_and_restate_none_of_it():
    restated = {"dp", "mp", "sp", "fsdp", "pp", "cp", "cp_strategy"}
    assert {f.name for f in dataclasses.fields(Parallel)} == {"layout", "sharded"}
    assert not restated & {f.name for f in dataclasses.fields(Where)}
    layout = Layout(dp=2, mp=4, sp=True)
    assert Parallel.on(layout).layout is layout and Parallel().layout == Layout()


def test_fault_taps_live_in_the_proof():
    """The ground floor keeps real behaviour: a tap is the identity there; the proof's ``Tapped``
    names every tap, and a tap without a method is an error, not a silent identity."""
    for hook in ("norm_param", "own_heads", "tied_table", "head_bias", "doc_starts"):
        assert not hasattr(Parallel, hook) and hasattr(Tapped, hook)
    x = object()
    assert Parallel().tap("own_heads", x) is x and Tapped().tap("own_heads", x) is x
    with pytest.raises(AttributeError):
        Tapped().tap("own_head", x)


def test_every_spec_by_role_comes_from_the_axes_uses():
    """``Layout.spec``: a use's axes are the axes on that declare it, in mesh order; FSDP's axes and the
    batch's rows and loss axes are those uses (one decision), on every kind of layout."""
    from jax.sharding import PartitionSpec as P

    from meshlm.parallel.specs import USES

    assert {u for a in AXES for u in a.uses} == set(USES)
    ep = Layout(dp=4, ep=2, mp=2, fsdp=True)
    assert ep.spec("batch", "length") == P(("dp", "ep"), None) and ep.batch_axes == ("dp", "ep")
    assert (ep.fsdp_axes(), ep.fsdp_shards(), ep.fsdp_axes(expert=True), ep.fsdp_shards(expert=True)) == (
        ("dp", "ep"), 4, "dp", 2
    )  # fmt: skip
    ctx = Layout(dp=2, cp=2, mp=2)
    assert ctx.spec("model", None, "batch", "length") == P("mp", None, "dp", "cp")
    assert ctx.spec(None, "batch", None, "kv_heads", None) == P(None, "dp", None, "mp", None)
    assert Layout(dp=2).fsdp_axes() == Layout(dp=2).fsdp_axes(expert=True) == "dp"
    with pytest.raises(ValueError, match="unknown axis use 'rows'"):
        Layout().spec("rows")


def test_bench_baselines_and_default_layouts_come_from_the_axis_entries():
    piped = Layout(dp=2, mp=2, pp=2, microbatches=2, ep=2, cp=2, fsdp=True, sp=True)
    assert piped.baselines() == ("no-pp", "no-ep")
    assert piped.flat == Layout(dp=2, mp=2, cp=2, fsdp=True)  # sp off, as bench's yardsticks were
    assert Layout(dp=2, cp=2).blockwise and not Layout(dp=2).blockwise
    with pytest.raises(ConfigError, match="--microbatches needs a pipeline"):  # before any device
        early_layout({"microbatches": 2})
    assert early_layout({"pp": 2, "ep": 2}).pp == 2 and early_layout({"fsdp": True}) is None
    assert devices_layout(8, {"ep": 2}, default_dp=1).label() == "2x4 + EP2"
    assert devices_layout(8, {"pp": 2}, default_dp=2).label() == "pp2x1x4 (1f1b, M=1)"
