"""Planted faults of linear attention (Gated DeltaNet, ``model.linear_attention``; ``proof.controls``
runs them): the classic bugs of a delta-rule layer, each changing one thing in the sharded run. The
rule's hooks are ``model.deltanet``'s module functions, replaced while the sharded run traces; the
head pairing is a tap (``proof.taps``)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

import meshlm.model.deltanet as deltanet
from meshlm.parallel.axes import MP
from meshlm.proof.control_record import Control, Where, replaced
from meshlm.proof.taps import Tapped


def _in_deltanet(name: str, value):
    """``model.deltanet``'s ``name`` set to ``value`` while the sharded run traces."""
    return replaced(vars(deltanet), name, value)


def write_then_decay(state, a, k, v, beta):
    """One step with the decay after the delta write: the write decays with the old state, and the
    prediction S^T k reads the undecayed state."""
    predicted = (k[..., :, None] * state).sum(-2)
    state = state + k[..., :, None] * ((v - predicted) * beta[..., None])[..., None, :]
    return state * a[..., None, None]


def decay_after_write():
    """The layer's rule (chunked) replaced by the token-by-token one whose step writes, then decays."""
    rule = lambda q, k, v, g, beta, state, chunk, reset=None: deltanet.recurrent_rule(
        q, k, v, g, beta, state, reset, update=write_then_decay
    )
    return _in_deltanet("chunked_rule", rule)


def beta_without_sigmoid():
    """The write strength beta the raw projection b, not sigmoid(b): writes outside (0, 1)."""
    return _in_deltanet("write_strength", lambda b: b)


def state_not_reset():
    """Under --doc-mask the recurrent state carried across a document start (the conv still restarts)."""
    return _in_deltanet("document_resets", lambda positions, starts: None)


class KeyHeadsOfNextShard(Tapped):
    """Each shard's value heads read the next mp shard's key heads (q, k): key and value heads split
    inconsistently, so a key head meets value heads it does not serve."""

    def linear_key_heads(self, qk):
        pairs = [(i, (i + 1) % self.layout.mp) for i in range(self.layout.mp)]
        return tuple(lax.ppermute(x, MP, pairs) for x in qk)


class StateNotPassed(Tapped):
    """Under cp every chunk's delta rule starts from a zero state: the maps of the chunks before it
    (another shard's, or this shard's first chunk for its second) never reach it."""

    def chunk_states(self, x):
        return jnp.zeros_like(super().chunk_states(x))


class ConvTailNotSent(Tapped):
    """Under cp every chunk's conv starts from zeros: the last K-1 inputs of the chunk before it
    (held by another shard) never reach it."""

    def conv_tails(self, x):
        return jnp.zeros_like(super().conv_tails(x))


def _linear(w: Where) -> bool:
    """The model has linear-attention layers."""
    return w.attention and bool(w.cfg.full_attn_every) and bool(w.cfg.linear_layers)


LINEAR_CONTROLS: tuple[Control, ...] = (
    Control(name="delta rule decays after its write", applies=_linear, plant=decay_after_write),
    Control(name="delta rule's beta without its sigmoid", applies=_linear, plant=beta_without_sigmoid),
    Control(
        name="delta rule's state not reset at a document start",
        applies=lambda w: _linear(w) and w.cfg.doc_mask >= 0,
        plant=state_not_reset,
    ),
    Control(
        name="linear attention's key heads paired with another shard's value heads",
        applies=lambda w: _linear(w) and w.layout.mp > 1,
        par_cls=KeyHeadsOfNextShard,
    ),
    Control(
        name="delta rule's state not passed between cp chunks",
        applies=lambda w: _linear(w) and w.layout.context_parallel,
        par_cls=StateNotPassed,
    ),
    Control(
        name="linear attention's conv history not passed between cp chunks",
        applies=lambda w: _linear(w) and w.layout.context_parallel and w.cfg.linear_conv > 1,
        par_cls=ConvTailNotSent,
    ),
)
