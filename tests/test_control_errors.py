"""A control that crashes is a verifier failure (exit 3), never a detection, whatever it raises: only
JAX's varying-axis type errors count as "rejected by the type system". A broader ``except`` (any
``ValueError``, any JAX error) would turn a broken control into a passing proof."""

import jax.numpy as jnp
import pytest
from helpers import run_cli

from meshlm.proof.control_runs import is_vma_rejection

ARGS = ("verify", "--config", "tiny", "--mesh", "1x2", "--seq-len", "8", "--no-collectives")


def _raises(error):
    def row_out(self, partial, bias=None):
        raise error

    return row_out


def _jax_value_error(self, partial, bias=None):
    """JAX's own ValueError (the type of its varying-axis errors), without their wording."""
    return jnp.split(partial, 3, axis=-1)[0]


def _jax_type_error(self, partial, bias=None):
    """JAX's own error class (TracerBoolConversionError, a TypeError)."""
    return partial if partial.sum() > 0 else -partial


CRASHES = {
    "ValueError": _raises(ValueError("a bug in the control")),
    "TypeError": _raises(TypeError("a bug in the control")),
    "RuntimeError": _raises(RuntimeError("a bug in the control")),
    "jax ValueError": _jax_value_error,
    "jax TracerBoolConversionError": _jax_type_error,
}


@pytest.mark.parametrize("kind", list(CRASHES))
def test_a_crashing_control_exits_3(monkeypatch, capsys, kind):
    monkeypatch.setattr("meshlm.proof.controls.DroppedAllReduce.row_out", CRASHES[kind])
    assert run_cli(*ARGS) == 3
    err = capsys.readouterr().err
    assert "verifier error: control 'dropped all-reduce' crashed" in err and "not a detection" in err


def test_only_the_varying_axis_wording_is_a_rejection():
    assert is_vma_rejection(ValueError("Primitive add requires varying manual axes to match, but got ..."))
    assert not is_vma_rejection(ValueError("array split does not result in an equal division"))
    assert not is_vma_rejection(TypeError("requires varying manual axes"))  # only JAX's ValueError
