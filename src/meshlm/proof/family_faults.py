"""Planted faults of the newer families' parts (``proof.controls`` runs them): Qwen2's q/k/v biases, tied
embeddings, Mistral's sliding window, Gemma's embedding scale. Each changes one thing in the sharded run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from meshlm.model.params import param_path
from meshlm.parallel.axes import MP
from meshlm.proof.taps import Tapped


class HeadBiasOfNextShard(Tapped):
    """Qwen2's q/k/v biases not sliced with their heads: each shard adds the next shard's slice."""

    def head_bias(self, b):
        return lax.ppermute(b, MP, [(i, (i + 1) % self.layout.mp) for i in range(self.layout.mp)])


class TiedHeadOtherSlice(Tapped):
    """A tied head projects onto the next shard's embedding slice: its logits' columns are the wrong
    vocabulary ids (the lookup still reads the right rows)."""

    def tied_table(self, table):
        return lax.ppermute(table, MP, [(i, (i + 1) % self.layout.mp) for i in range(self.layout.mp)])


class TiedHeadGradDropped(Tapped):
    """A tied head's gradient is not added to the embedding's (the head uses a detached copy, as when
    the tied copies' gradients are never summed): the table learns from the lookup alone."""

    def tied_table(self, table):
        return lax.stop_gradient(table)


def window_off_by_one(cfg):
    """The sliding window one key wider (i - window <= j) in the sharded run."""
    return cfg.replace(sliding_window=cfg.sliding_window + 1)


def embedding_scaled_twice(cfg, params):
    """The embedding table times sqrt(d_model) in the sharded run: Gemma's scale applied twice (as a
    converter folding it into the weights while the model still applies it), the tied head's logits
    scaled once."""
    from meshlm.model.transformer import embed_scale

    def plant(path, x):
        if path != "embed/embeddings":
            return x
        return jax.device_put(x * jnp.asarray(embed_scale(cfg.d_model), x.dtype), x.sharding)

    return {m: {n: plant(param_path(m, n), x) for n, x in leaves.items()} for m, leaves in params.items()}
