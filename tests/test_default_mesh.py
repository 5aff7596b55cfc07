"""The default mesh fits the model (issue 59, item 7): without --mesh, the largest mp (at most the
devices' default) that every mp-sharded dimension admits, the rest dp, with one note when that is not
the default; an explicit --mesh that does not fit stays a one-line error; convert splits nothing.
Shapes only (``jax.eval_shape``): quick."""

from __future__ import annotations

import json

import pytest
from helpers import run_cli

from meshlm.errors import ShardingError
from meshlm.model.config import get_config
from meshlm.sharding.fit import fitted_layout

# tiny-qwen3.5 with a tiny Qwen3.5's 2 linear-attention key heads (4 value heads): mp 4 cannot split them
TWO_KEY_HEADS = dict(linear_key_heads=2, linear_value_heads=4)


def test_the_default_is_kept_where_it_fits():
    for name, n, dp, want in (
        ("tiny-qwen3", 8, 1, "1x8"),
        ("tiny-lm", 4, 2, "2x2"),
        ("tiny-qwen3.5", 4, 1, "1x4"),
    ):
        layout, note = fitted_layout(get_config(name), n, {}, dp)
        assert (layout.label(), note) == (want, None)


def test_a_model_the_default_mp_does_not_divide_gets_the_largest_mp_that_does():
    cfg = get_config("tiny-qwen3.5").replace(**TWO_KEY_HEADS)
    layout, note = fitted_layout(cfg, 4, {}, 1)
    assert (layout.dp, layout.mp) == (2, 2)
    assert note.startswith("note: no --mesh given: running on 2x2 (mp=2, the largest mp")
    assert (
        "the default 1x4 does not fit: parameter 'linear_layers/linear/conv_k' dimension 2 (size 2)" in note
    )
    assert "\n" not in note
    layout, _ = fitted_layout(get_config("tiny-lm"), 8, {}, 1)  # 4 heads on 8 devices
    assert (layout.dp, layout.mp) == (2, 4)
    layout, note = fitted_layout(cfg, 8, {"cp": 2}, 1)  # options kept: dp x cp x mp = 2 x 2 x 2
    assert (layout.dp, layout.cp, layout.mp) == (2, 2, 2) and "2x2 + CP2" in note


def test_no_mp_fits_is_the_default_error():
    """A dimension no mp changes (FSDP's over dp) is refused as the default was: with its own error."""
    cfg = get_config("tiny-lm").replace(d_model=30, n_heads=3)
    with pytest.raises(ShardingError, match="not divisible by dp=8 under --fsdp"):
        fitted_layout(cfg, 8, {"fsdp": True}, 8)


def test_an_explicit_mesh_that_does_not_fit_stays_one_line(capsys):
    argv = ("memory", "--config", "tiny-lm", "--mesh", "1x8", "--devices", "8")
    assert run_cli(*argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "n_heads=4 is not divisible by mp=8" in err[0], err
    assert run_cli("memory", "--config", "tiny-lm", "--devices", "8", "--json") == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["mesh"] == {"dp": 2, "mp": 4}
    assert out.err.startswith("note: no --mesh given: running on 2x4 (mp=4,") and out.err.count("\n") == 1
