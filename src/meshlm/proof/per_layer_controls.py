"""Planted faults of Gemma 4's pieces (``model.per_layer``; ``proof.controls`` runs them): a global layer
reading its own values where its keys' projection is its values, a KV-shared layer computing and writing
its own keys and values, a layer reading another layer's slice of the per-layer inputs, the MoE block's
router reading the experts' normed input (not the residual stream). Each replaces one of
``model.per_layer``'s functions while the sharded run traces."""

from __future__ import annotations

import jax.numpy as jnp

from meshlm.model import per_layer
from meshlm.proof.control_record import Control, replaced


def _in_per_layer(name: str, value):
    return replaced(vars(per_layer), name, value)


def own_values_on_keys_as_values():
    """A keys-as-values (global) layer reads its own ``wv`` projection, not its keys'."""
    return _in_per_layer("keys_as_values", lambda kind, k, v: v)


def shared_layer_computes_its_own():
    """A KV-shared layer computes and writes its own keys and values (from its never-read ``wk``,
    ``wv``), as if it were not shared: the next shared layer of its kind reads them too."""
    real = per_layer.read_shared
    return _in_per_layer("read_shared", lambda shared, k, v, kind, reuse: real(shared, k, v, kind, False))


def per_layer_input_of_the_next_layer():
    """Each layer reads the next layer's slice of the per-layer inputs (the last the first's)."""
    return _in_per_layer("in_layer_order", lambda ple: jnp.roll(ple, -1, axis=0))


def router_on_the_experts_input():
    """The MoE block's router reads the experts' normed input (``pre_feedforward_layernorm_2``'s), not
    the residual stream (a port that routes on the MLP's input, as other MoE families do)."""
    return _in_per_layer("router_input", lambda residual, experts_in: experts_in)


def _on(field: str):
    return lambda w: w.cfg is not None and bool(getattr(w.cfg, field, 0))


PER_LAYER_CONTROLS = (
    Control(
        name="keys-as-values layer reading its own values",
        applies=lambda w: _on("k_eq_v")(w) and w.cfg.global_every <= w.cfg.n_layers,
        plant=own_values_on_keys_as_values,
    ),
    Control(
        name="KV-shared layer computing and writing its own keys and values",
        applies=_on("kv_shared_layers"),
        plant=shared_layer_computes_its_own,
    ),
    Control(
        name="per-layer input from the wrong layer's slice",
        applies=_on("ple_dim"),
        plant=per_layer_input_of_the_next_layer,
    ),
    Control(
        name="MoE router reading the experts' normed input, not the residual",
        applies=lambda w: w.cfg is not None and w.cfg.arch.moe and w.cfg.per_layer,
        plant=router_on_the_experts_input,
    ),
)
