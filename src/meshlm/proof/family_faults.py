"""Planted faults of the newer families' parts (``proof.controls`` runs them): Qwen2's q/k/v biases, tied
embeddings, Mistral's sliding window, Gemma's embedding scale, Qwen3's, OLMo 2's and Gemma 3's q/k norms,
Gemma 2's soft-caps, Gemma 2/3's local and global layers, SmolLM3's NoPE layers, sinks, chunks, Llama 4's
temperature. Each changes one thing in the sharded run (the q/k norms', the soft-cap's order, the layer
kinds', the sinks' and the temperature's are planted in ``model.attention``, ``model.context_parallel``
or ``model.attention_variants`` while it is traced)."""

from __future__ import annotations

from contextlib import contextmanager

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshlm.model import attention, attention_variants, context_parallel
from meshlm.model.layers import RMSNorm
from meshlm.model.params import param_path
from meshlm.parallel.axes import DP, MP
from meshlm.proof.control_record import Control, Where, replaced
from meshlm.proof.taps import Tapped


class HeadBiasOfNextShard(Tapped):
    """Qwen2's q/k/v biases not sliced with their heads: each shard adds the next shard's slice."""

    def head_bias(self, b):
        return lax.ppermute(b, MP, [(i, (i + 1) % self.layout.mp) for i in range(self.layout.mp)])


class TiedHeadOtherSlice(Tapped):
    """A tied head projects onto the next shard's embedding slice: its logits' columns are the wrong
    vocabulary ids (the lookup still reads the right rows). An all-gather over mp, not a permute: under
    pp the head runs on the last stage only (a branch of a ``cond``), and XLA:CPU runs a permute over mp
    as one collective of every device, which the other stages never join (a deadlock)."""

    def tied_table(self, table):
        every = lax.all_gather(table, MP, axis=0, tiled=False)  # [mp, V/mp, D]
        return every[(self.shard_index() + 1) % self.layout.mp]


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


def _in_attention(name: str, value, table: dict | None = None):
    """``model.attention``'s ``name`` (or ``table[name]``) set to ``value`` while the sharded run traces."""
    return replaced(vars(attention) if table is None else table, name, value)


def qk_norm_after_rotary():
    """Qwen3's q/k norm applied to the rotated heads (rotary keeps a head's norm, not its coordinates:
    the weights meet the wrong ones)."""
    return _in_attention("norm_then_rotary", lambda x, norm, rotate: norm(rotate(x)))


def _grad_of_shard0(next_getter, value, context):
    """A Haiku getter: the parameter's value, its gradient kept from shard 0 only."""
    value = next_getter(value)
    keep = lax.axis_index(MP) == 0
    return lax.stop_gradient(value) + jnp.where(keep, value - lax.stop_gradient(value), 0.0)


def _head_norm_grad_of_shard0(norm: type[RMSNorm]) -> type[RMSNorm]:
    """``norm`` (a per-head q/k norm) whose replicated weights take the gradient of shard 0's heads only."""

    class Planted(norm):
        def __call__(self, x):
            with hk.custom_getter(_grad_of_shard0):
                return super().__call__(x)

    return Planted


@contextmanager
def qk_norm_grad_not_summed():
    """Qwen3's (and Gemma 3's) replicated q/k norm weights keep one shard's gradient, not the sum over
    mp's heads."""
    table = attention.QK_NORMS
    with _in_attention("head", _head_norm_grad_of_shard0(table["head"]), table):
        with _in_attention("head_plus_one", _head_norm_grad_of_shard0(table["head_plus_one"]), table):
            yield


class _ProjNormLocalStatistic(attention.ProjRMSNorm):
    """OLMo 2's whole-projection q/k norm with the mean square of this shard's heads only."""

    def mean_square(self, x32):
        return jnp.mean(jnp.square(x32), axis=(-2, -1), keepdims=True)


def proj_norm_local_statistic():
    """OLMo 2's q/k norm statistics not gathered over mp: each shard normalizes by its own heads."""
    return _in_attention("proj", _ProjNormLocalStatistic, attention.QK_NORMS)


def attn_softcap_off(cfg):
    """The attention scores not soft-capped in the sharded run (Gemma 2's ``attn_softcap`` ignored)."""
    return cfg.replace(attn_softcap=0.0)


def final_softcap_off(cfg):
    """The output logits not soft-capped in the sharded run (``final_softcap`` ignored)."""
    return cfg.replace(final_softcap=0.0)


def softcap_after_softmax():
    """The attention soft-cap applied to the probabilities after the softmax, not to the scores before it."""

    def capped_after(scores, visible, softcap):
        probs = jax.nn.softmax(jnp.where(visible, scores, jnp.finfo(scores.dtype).min), axis=-1)
        return attention.soft_cap(probs, softcap)

    return _in_attention("capped_softmax", capped_after)


def layer_kinds_swapped():
    """Gemma 2/3's local and global layers swapped: each local layer computed as a global one (no window,
    the global rotary frequencies) and each global one as a local one."""
    kinds = attention.layer_kinds
    return _in_attention("layer_kinds", lambda cfg: None if kinds(cfg) is None else 1 - kinds(cfg))


def local_rotary_on_global():
    """Gemma 3's global layers rotated with the local layers' base (and unscaled): both kinds' tables
    the local one."""
    tables = attention.kind_tables

    def planted(cfg):
        windows, freqs = tables(cfg)
        return windows, np.stack([freqs[0], freqs[0]])

    return _in_attention("kind_tables", planted)


def nope_layer_rotated():
    """SmolLM3's NoPE layers rotated as the others (``global_nope`` ignored): the global kind's table
    the rotary frequencies it would have."""
    tables = attention.kind_tables

    def planted(cfg):
        windows, freqs = tables(cfg)
        return windows, np.stack([freqs[0], cfg.inv_freq()])

    return _in_attention("kind_tables", planted)


def sink_on_every_ring_step():
    """Learned sinks added to each ring step's partial, then once more after the merge (the sink counted
    once per K/V chunk: mistral.rs #1872), not once after the ring's last merge."""
    real = context_parallel.attend_partial

    def planted(*args, variant, **kw):
        return variant.finish(real(*args, variant=variant, **kw))

    return _in_attention("attend_partial", planted, vars(context_parallel))


def _grad_of_data_shard0(next_getter, value, context):
    """A Haiku getter: the sinks' value, their gradient kept from data shard 0 only."""
    value = next_getter(value)
    if context.name != "sinks":
        return value
    keep = lax.axis_index(DP) == 0
    return lax.stop_gradient(value) + jnp.where(keep, value - lax.stop_gradient(value), 0.0)


def sink_grad_not_summed():
    """The sinks' gradient one data shard's, not the sum over the data shards (as a parameter made outside
    the model's parameters, whose gradient no all-reduce meets)."""
    real = attention.layer_variant

    def planted(*args):
        with hk.custom_getter(_grad_of_data_shard0):
            return real(*args)

    return _in_attention("layer_variant", planted)


def chunk_off_by_one(cfg):
    """Llama 4's chunks one position longer in the sharded run: every boundary after the first moves."""
    return cfg.replace(attn_chunk=cfg.attn_chunk + 1)


def temperature_on_rotated_layers():
    """Llama 4's attention temperature applied on every layer, the rotated ones too (not on its NoPE
    layers only): ``attention_variants.query_rules`` without it, then every query times it."""
    real = attention_variants.query_rules

    def planted(variant, q, k, positions):
        if not variant.temperature:
            return real(variant, q, k, positions)
        q, k = real(variant.replace(temperature=()), q, k, positions)
        floor, scale = variant.temperature
        t = jnp.log1p(jnp.floor((positions.astype(q.dtype) + 1.0) / floor)) * scale + 1.0
        return q * t[..., None, None], k

    return _in_attention("query_rules", planted, vars(attention_variants))


FLASH = "flash"  # ``--attention flash``


def _plain_softmax(w: Where) -> bool:
    """Plain attention's softmax (``attention.capped_softmax``) runs: plain attention, and not the cp
    ring, which runs the blockwise kernel's steps whatever the attention (their soft-cap order is
    ``cp_controls``' "soft-cap applied after the softmax")."""
    return w.cfg.attention == "plain" and not w.layout.cp_ring


def _kinds(w: Where) -> bool:
    return w.attention and 0 < w.cfg.global_every <= w.cfg.n_layers


def _two_rotaries(w: Where) -> bool:  # (NoPE layers: their own control)
    freqs = attention.kind_tables(w.cfg)[1]
    return _kinds(w) and not w.cfg.global_nope and not np.array_equal(freqs[0], freqs[1])


GEMMA_CONTROLS = (  # ``proof.controls`` runs them
    # Gemma 2's soft-capping: the cap must matter (as the document mask's control)
    Control(
        name="attention soft-cap off",
        applies=lambda w: w.attention and w.cfg.attn_softcap > 0,
        cfg_change=attn_softcap_off,
    ),
    Control(
        name="final-logit soft-cap off",
        applies=lambda w: w.cfg is not None and w.cfg.final_softcap > 0,
        cfg_change=final_softcap_off,
    ),
    Control(  # plain attention's order (``attention.capped_softmax``): cap, mask, softmax
        name="attention soft-cap applied after the softmax",
        applies=lambda w: w.attention and w.cfg.attn_softcap > 0 and _plain_softmax(w),
        plant=softcap_after_softmax,
    ),
    Control(name="local and global layers swapped", applies=_kinds, plant=layer_kinds_swapped),
    Control(
        name="local rotary base used on a global layer", applies=_two_rotaries, plant=local_rotary_on_global
    ),
    Control(  # the sinks' normaliser term, ``Variant.finish``: once, after the ring's merge
        name="sink added on every ring step",
        # (the blockwise steps' partials: flash's ring steps, ``flash_ring``, take no sinks)
        applies=lambda w: w.attention and w.cfg.attn_sinks and w.layout.cp_ring and w.cfg.attention != FLASH,
        plant=sink_on_every_ring_step,
    ),
    Control(
        name="sink's gradient not summed over the data shards",
        # the mesh's DP axis (dp / ep: ep takes the rest) split: the plant keeps DP shard 0's gradient
        applies=lambda w: w.attention and w.cfg.attn_sinks and w.layout.data_axis_split,
        plant=sink_grad_not_summed,
    ),
    Control(
        name="chunk boundary off by one",
        applies=lambda w: w.attention and 0 < w.cfg.attn_chunk < w.seq_len,
        cfg_change=chunk_off_by_one,
    ),
    Control(  # Llama 4's query rule (``attention_variants.query_rules``): on NoPE layers only
        name="temperature applied on a rotated layer",
        applies=lambda w: bool(w.cfg.attn_floor_scale),
        plant=temperature_on_rotated_layers,
    ),
    Control(
        name="NoPE layer rotated", applies=lambda w: _kinds(w) and w.cfg.global_nope, plant=nope_layer_rotated
    ),
)
