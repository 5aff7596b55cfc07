"""Planted faults of multi-head latent attention (``model.mla``; ``proof.controls`` runs them), each
replacing one of ``model.mla``'s points while the sharded run traces: the rotary key taken per head
instead of the one shared key, the latent norm's gradient not summed over mp, the key's non-rotary and
rotary halves joined in the other order than the queries', and YaRN's attention factor on the queries'
rotary part only."""

from __future__ import annotations

import haiku as hk
import jax.numpy as jnp

from meshlm.model import mla
from meshlm.model.layers import RMSNorm
from meshlm.model.rope import attention_scale
from meshlm.proof.control_record import Control, Where, replaced
from meshlm.proof.family_faults import _grad_of_shard0


def _in_mla(name: str, value, table: dict | None = None):
    """``model.mla``'s ``name`` (or ``table[name]``) set to ``value`` while the sharded run traces."""
    return replaced(vars(mla) if table is None else table, name, value)


def _per_head_rotary_key(k_rope, k_nope, rotate):
    """Each head rotates the last R dims of its own up-projected key (an MHA-style rotary key) instead of
    the one k_rope every head shares."""
    return rotate(k_nope[..., -k_rope.shape[-1] :])


class _LatentNormGradOfShard0(RMSNorm):
    """The latent's RMSNorm whose replicated weight keeps shard 0's gradient, not the sum over mp."""

    def __call__(self, x):
        with hk.custom_getter(_grad_of_shard0):
            return super().__call__(x)


def _halves_swapped(nope, rope):
    return jnp.concatenate([rope, nope], axis=-1)


def _factor_on_queries_only(rotate_pair):
    def planted(x, cos, sin, scale, style, query):
        return rotate_pair(x, cos, sin, scale if query else 1.0, style, query)

    return planted


def _mla(w: Where) -> bool:
    return w.attention and w.cfg.mla


MLA_CONTROLS = (
    Control(
        name="MLA rotary key taken per head",
        applies=lambda w: _mla(w) and w.cfg.head_dim >= 2 * w.cfg.rot_dim,
        plant=lambda: _in_mla("rotary_key", _per_head_rotary_key),
    ),
    Control(
        name="MLA latent norm gradient not summed over mp",
        applies=lambda w: _mla(w) and w.layout.mp > 1,
        plant=lambda: _in_mla("latent", _LatentNormGradOfShard0, mla.NORMS),
    ),
    Control(
        name="MLA key halves joined rope first",
        applies=_mla,
        plant=lambda: _in_mla("key_halves", _halves_swapped),
    ),
    Control(
        name="YaRN attention factor on the queries only",
        applies=lambda w: _mla(w) and attention_scale(w.cfg.rope_scaling) != 1.0,
        plant=lambda: _in_mla("rotate_pair", _factor_on_queries_only(mla.rotate_pair)),
    ),
)
