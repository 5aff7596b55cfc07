"""The rotary embedding on whole vectors (``layers.apply_rotary``: x * [c, c] + (x @ P) * [s, s]) against
the pairs formula it replaced (x1 c - x2 s, x2 c + x1 s on [.., r/2]-wide halves, kept here as the
reference): bit for bit, op by op and compiled by XLA:CPU, in bfloat16, float32 and float64, for both
styles, the whole head and a partial ``rot_dim``, the YaRN-scaled cos/sin too. Controls: a rotation with
a wrong sign, and one pairing the wrong dims, are each caught by the same comparison."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.model import layers

ROTATION = layers.rotation  # the real one: the controls plant theirs over it


def pairs_formula(x, cos, sin, rot_dim: int, style: str):
    """The rotary embedding as it was written before (meshlm 7 December 2026): on the pairs' halves."""
    rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    c, s = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    if style == "interleaved":
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = jnp.stack([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).reshape(rot.shape)
    else:
        x1, x2 = rot[..., : rot_dim // 2], rot[..., rot_dim // 2 :]
        out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return jnp.concatenate([out, rest], axis=-1)


def _inputs(dtype, rot_dim: int, e: int = 16, seed: int = 0):
    """x [2, 7, 3, e] and cos, sin [2, 7, rot_dim / 2] of real rotary angles (positions 0..6 and beyond)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((2, 7, 3, e)) * 3, dtype)
    positions = jnp.asarray(rng.integers(0, 4096, (2, 7)), jnp.int32)
    freq = 1.0 / 10000 ** (np.arange(0, rot_dim, 2) / rot_dim)
    cos, sin = layers.rotary_angles(
        positions, freq, dtype, scale=1.37 if rot_dim == 12 else 1.0
    )  # YaRN's factor
    return x, cos, sin


def _bits(a):
    a = np.asarray(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a)
    return a.view(np.uint64 if a.dtype == np.float64 else np.uint32)


CASES = [(style, rot) for style in ("half", "interleaved") for rot in (16, 12, 8)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
@pytest.mark.parametrize("style,rot_dim", CASES)
def test_whole_vectors_equal_the_pairs_formula_bit_for_bit(style, rot_dim, dtype):
    with jax.enable_x64(dtype == "float64"):
        x, cos, sin = _inputs(jnp.dtype(dtype), rot_dim)
        want = pairs_formula(x, cos, sin, rot_dim, style)
        got = layers.apply_rotary(x, cos, sin, rot_dim, style)  # op by op: each op rounded to its dtype
        assert got.dtype == want.dtype == x.dtype
        np.testing.assert_array_equal(_bits(got), _bits(want))
        # compiled by XLA:CPU, each against the other compiled (bf16: XLA may keep a product in float32
        # inside a fusion, the same in both here; XLA:TPU's fusions differ: docs/benchmarks.md)
        jitted = lambda f: jax.jit(f, static_argnums=(3, 4))(x, cos, sin, rot_dim, style)
        np.testing.assert_array_equal(_bits(jitted(layers.apply_rotary)), _bits(jitted(pairs_formula)))
        np.testing.assert_array_equal(_bits(jitted(layers.apply_rotary)), _bits(want))


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_rotation_is_a_signed_permutation(style):
    p = layers.rotation(8, style)
    assert (np.abs(p).sum(axis=0) == 1).all() and (np.abs(p).sum(axis=1) == 1).all()
    np.testing.assert_array_equal(p @ p, -np.eye(8))  # a quarter turn of every pair: twice is -1


def _wrong_sign(rot_dim, style):
    return np.abs(ROTATION(rot_dim, style))


def _wrong_pairs(rot_dim, style):
    return ROTATION(rot_dim, "interleaved" if style == "half" else "half")


@pytest.mark.parametrize("plant", [_wrong_sign, _wrong_pairs], ids=["wrong sign", "wrong pairs"])
@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_control_a_wrong_rotation_is_caught(monkeypatch, plant, style):
    """The comparison above fails on a rotation with every sign +1, and on one pairing each dim with the
    other style's partner."""
    monkeypatch.setattr(layers, "rotation", lambda r, s: plant(r, s))
    x, cos, sin = _inputs(jnp.float32, 16)
    got = layers.apply_rotary(x, cos, sin, 16, style)
    assert not np.array_equal(_bits(got), _bits(pairs_formula(x, cos, sin, 16, style)))
