"""The compiled programs of generation: prefill and one decode step, as ``jax.shard_map`` functions
over the (DP, MP) mesh, with sampling inside them.

Prefill runs the whole padded prompt batch [B, S] in ONE pass and samples each row's first new token
from the logits at that row's own last prompt position; ``decode_step`` feeds one token per row at
the row's own position, and ``decode_chunk`` runs a chunk of such steps in one program (a scan: each
step feeds the token the one before sampled) and hands the next chunk what it starts from (the last
token, positions, document starts, step index) on the device, so the host dispatches each chunk
before it reads the one before (``generator._decode``): no round trip between chunks. All are compiled
ahead of time once per global batch size (``Programs``), so neither prompt lengths nor the number of
new tokens ever trigger a compilation.

The "ff" family has no attention and no positions: the logits at a position depend on that token
alone, so running the model on the last token IS the full recomputation (exact, O(1) per step). It
needs no cache (an empty dict).

Sampling (inside the same ``shard_map``, on full-vocabulary logits replicated over MP): temperature 0
is greedy (argmax); otherwise logits / temperature, restricted to the top-k tokens (0: all) and to the
smallest set of most likely tokens whose probability reaches top-p (1.0: all). Ties at a cut-off are
kept; greedy decoding skips the cut-offs' sort (``lax.cond``). Row r at step s draws with
``fold_in(fold_in(PRNGKey(seed), s), r)``: reproducible, and the same on every mesh. Settings are
traced values: changing them does not recompile.
"""

from __future__ import annotations

import json
import os
from functools import partial

import haiku as hk
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshlm.errors import ConfigError
from meshlm.generate.cache import cache_dtypes, cache_shapes, cache_specs, empty_cache, keep_window
from meshlm.generate.inputs import Sampling
from meshlm.model.attention import values_apart
from meshlm.model.blockwise import varying_like
from meshlm.model.cache_kernel import write_mode
from meshlm.model.config import ModelConfig
from meshlm.model.kv_kinds import mixed_kinds
from meshlm.model.layers import upcast
from meshlm.model.transformer import check_context, local_logits
from meshlm.parallel.context import Parallel
from meshlm.parallel.layout import Layout

# Decode steps per program (``decode_chunk``; ``Generator(chunk=...)``): each chunk is dispatched
# while the one before runs, so the host's transfers and streaming hide behind the device's chunk
# when a chunk outlasts them. Generation streams its tokens a chunk at a time, and a generation that
# ends mid-chunk (its last chunk, or every row stopped) wastes the rest of it: at most one chunk more
# (the next, dispatched before the stop was read) and DECODE_CHUNK - 1 steps.
DECODE_CHUNK = 16

# Cache slots come in multiples of this (a bf16 sublane tile): XLA:TPU lays the flat cache's [S, Kc * E]
# planes out in (16, 128) tiles, and at S = 577 (prompt 512 + 65 tokens) it copied every layer's slice
# of the cache out before attention read it: llama-100m, batch 64, bf16, 6.0 ms a decode step against
# 2.6 at S = 576 by the v5e compiler's estimate (scripts/decode_hlo.py, docs/benchmarks.md).
SLOT_TILE = 16


def slots_for(cfg: ModelConfig, max_len: int, prefill_cp: bool = False) -> int:
    """The cache's slots (and the prefill's padded width) for prompts plus new tokens of ``max_len``:
    rounded up to ``SLOT_TILE`` where the context allows it (never past ``max_seq_len``: learned
    positions) and the prefill is not split over cp (its chunks divide ``max_len``). No query of a
    generation within ``max_len`` sees the extra slots (the causal mask: they hold positions past it)."""
    padded = -(-max_len // SLOT_TILE) * SLOT_TILE
    return max_len if prefill_cp or padded > cfg.max_seq_len else padded


# --- sharded functions ---------------------------------------------------------------------------


def _full_vocab(par: Parallel, vocab: int, local):
    """[B, V/mp] per shard -> [B, V] replicated. A psum of disjoint slices rather than all_gather,
    whose result shard_map types as still varying over MP; adding zeros is exact."""
    if not par.sharded:
        return local
    full = jnp.zeros((*local.shape[:-1], vocab), local.dtype)
    full = lax.dynamic_update_slice_in_dim(full, local, par.vocab_start(local.shape[-1]), axis=-1)
    return par.g(full)


def _forward(cfg: ModelConfig, par: Parallel, tokens, positions, last, cache, starts=None):
    """Haiku fn. tokens, positions [B, T] per shard; last [B]: the column whose logits each row needs;
    starts [B, T] or None: where each token's document starts (``--doc-mask``; None: from ``tokens``).
    Returns (logits [B, V] float32 replicated over MP, new cache): V is the real vocabulary, the
    padding stripped, so a padded id is never sampled."""
    local, cache = local_logits(cfg, par, tokens, positions, cache or None, starts)  # [B, T, Vpad/mp]
    picked = jnp.take_along_axis(local, last[:, None, None], axis=1)[:, 0]  # [B, Vpad/mp]
    return _full_vocab(par, cfg.padded_vocab, upcast(picked))[:, : cfg.vocab_size], cache or {}


def _forward_cp(cfg: ModelConfig, par: Parallel, tokens, lengths, cache):
    """Haiku fn: a prefill over cp. tokens [B, S] (the whole rows on every cp shard), lengths [B]; each
    cp shard runs its two load-balanced chunks (``parallel.cp``) at their global positions, attending
    across cp as in training; ``cache`` (zeros [.., S, ..]) comes back whole and in sequence order on
    every cp shard (``attention.cp_prefill_cache``). The last prompt position's logits are on one shard,
    zeros on the others: summed over cp, exact. Returns what ``_forward`` does."""
    t = tokens.shape[1] // par.layout.cp
    positions = jnp.broadcast_to(par.positions(t), (tokens.shape[0], t))  # [B, S/cp] global
    local, cache = local_logits(cfg, par, par.seq_local(tokens), positions, cache or None)
    mine = (positions == (lengths - 1)[:, None])[..., None]  # [B, S/cp, 1]
    picked = par.cp_sum(jnp.sum(jnp.where(mine, upcast(local), 0), axis=1))  # [B, Vpad/mp]
    return _full_vocab(par, cfg.padded_vocab, picked)[:, : cfg.vocab_size], cache or {}


def _filter(logits, top_k, top_p):
    """Logits outside the top-k / top-p set -> -inf. One sort serves both cut-offs."""
    v = logits.shape[-1]
    desc = -jnp.sort(-logits, axis=-1)  # [B, V]
    in_k = jnp.arange(v) < jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    probs = jax.nn.softmax(jnp.where(in_k, desc, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly more likely tokens
    keep = in_k & ((before < top_p) | (top_p >= 1.0))  # the most likely token is always kept
    cutoff = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits >= cutoff, logits, -jnp.inf)


def sample(logits, key, rows, step, sampling):
    """logits [B, V] float32; rows [B] global row ids; sampling (temperature, top_k, top_p) -> [B]. The
    draw (a sort of the vocabulary for the cut-offs, a categorical) only runs with a temperature: a
    greedy decode step does not pay for it (``lax.cond``; the settings are replicated values)."""
    temperature, top_k, top_p = sampling

    def drawn():
        scaled = _filter(logits / jnp.maximum(temperature, 1e-6), top_k, top_p)
        keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(key, step), r))(rows)
        return jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)

    return lax.cond(temperature > 0, drawn, lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32))


def _lengths(cache: dict, lengths) -> dict:
    """The linear layers' row lengths [L_lin, B] set to ``lengths`` [B] (the tokens each row has after
    this call; ``model.linear_cache``: the prefill's padding must not reach the state); other caches
    as they are."""
    if "length" not in cache:
        return cache
    return {**cache, "length": jnp.broadcast_to(lengths.astype(jnp.int32), cache["length"].shape)}


def sharded_fns(
    cfg: ModelConfig,
    layout: Layout,
    specs,
    cache_dtype,
    prefill_cp: bool = False,
    *,
    max_len: int,
    chunk: int = DECODE_CHUNK,
):
    """(prefill, decode_step, decode_chunk): ``shard_map`` functions over the layout's mesh; params laid
    out by ``specs``.

    prefill(params, tokens [B, S], lengths [B], rows [B], key, sampling) -> (next [B], logits [B, V], cache)
    decode_step(params, tokens [B], positions [B], rows [B], cache, key, step, sampling, starts [B]) -> same
    (``starts``: where each row's current document starts, for ``--doc-mask``; the prefill finds the
    prompt's documents in its tokens).
    decode_chunk(params, tokens [B], positions [B], rows [B], cache, key, step, sampling, starts [B]) ->
    (tokens [B, chunk], (last token [B], positions + chunk [B], cache, starts [B], step + chunk)):
    ``decode_step`` ``chunk`` times, step i feeding step i - 1's token at the next position (clamped
    below ``max_len``, as the host clamps one step's) and moving ``starts`` past an EOD it feeds
    (``inputs.next_doc_starts``), with step index step + i: the tokens the host loop of single steps
    draws. The second part is the next chunk's (tokens, positions, cache, starts, step), on the device.
    Global shapes; rows split over DP. Only params and the cache are sharded over MP.
    ``prefill_cp``: the prefill splits the prompt over the layout's cp axis (``_forward_cp``); the
    decode runs without cp either way (each cp shard a copy).
    """
    # A training layout's cp axis, if any, holds copies: a prompt is not split over the sequence.
    par, mesh = Parallel.on(Layout.of(layout, cp=1, cp_strategy="ring")), layout.mesh
    apply = hk.without_apply_rng(hk.transform(partial(_forward, cfg, par))).apply
    apply_cp = hk.without_apply_rng(hk.transform(partial(_forward_cp, cfg, Parallel.on(layout)))).apply

    def prefill(params, tokens, lengths, rows, key, sampling):  # tokens [B/dp, S], lengths [B/dp] per shard
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        cache = _lengths(empty_cache(cfg, par, tokens.shape[0], tokens.shape[1], cache_dtype), lengths)
        # typed as the keys it will hold (a carry: ``kv_kinds.carried_stack``); over cp each layer's
        # slice is summed before it is written (``cp_prefill_cache``), so the cache never varies over cp
        cache = varying_like(cache, tokens, params)
        if prefill_cp:
            logits, cache = apply_cp(params, tokens, lengths, cache)
        else:
            logits, cache = apply(params, tokens, positions, lengths - 1, cache)
        cache = _lengths(keep_window(cfg, cache, lengths), lengths)  # the lengths as given: rows', not mp's
        return sample(logits, key, rows, 0, sampling), logits, cache

    def decode_step(params, tokens, positions, rows, cache, key, step, sampling, starts):  # [B/dp] per shard
        last, cache = jnp.zeros_like(positions), _lengths(cache, positions + 1)
        logits, cache = apply(params, tokens[:, None], positions[:, None], last, cache, starts[:, None])
        cache = _lengths(cache, positions + 1)  # again: typed as the rows, not as mp's layers' output
        return sample(logits, key, rows, step, sampling), logits, cache

    def decode_chunk(params, tokens, positions, rows, cache, key, step, sampling, starts):  # [B/dp] per shard
        def one(carry, i):
            fed, at, cache, starts = carry
            starts = jnp.where((fed == cfg.doc_mask) & (cfg.doc_mask >= 0), at, starts)  # next_doc_starts
            nxt, _, cache = decode_step(
                params, fed, jnp.minimum(at, max_len - 1), rows, cache, key, step + i, sampling, starts
            )
            return (nxt, at + 1, cache, starts), nxt

        carry = (tokens, positions, cache, starts)
        (nxt, at, cache, starts), out = lax.scan(one, carry, jnp.arange(chunk, dtype=step.dtype))
        return jnp.swapaxes(out, 0, 1), (nxt, at, cache, starts, step + chunk)  # out [B/dp, chunk]

    # rows over the data shards: DP, or (DP, EP) (ep's shards are data shards: ``Layout.rows``)
    row, tokens, cspec = layout.spec("batch"), layout.spec("batch", None), cache_specs(cfg, layout)
    out = (row, tokens, cspec)
    prefill_in = (specs, tokens, row, row, P(), P())
    decode_in = (specs, row, row, row, cspec, P(), P(), P(), row)
    return (
        jax.shard_map(prefill, mesh=mesh, in_specs=prefill_in, out_specs=out),
        jax.shard_map(decode_step, mesh=mesh, in_specs=decode_in, out_specs=out),
        jax.shard_map(
            decode_chunk, mesh=mesh, in_specs=decode_in, out_specs=(tokens, (row, row, cspec, row, P()))
        ),
    )


# --- compiled, per batch size --------------------------------------------------------------------


KINDS = ("prefill", "decode", "chunk")  # the programs of a batch size


# XLA:TPU (libtpu) options for generation's decode programs, a JSON object (unset: none), to measure a
# compiler setting against the default: '{"xla_vf_vmem_min_overlap_to_async_copy_ratio": 10}' kept a v5e's
# compiler from copying the whole KV cache into VMEM and back every decode step (compile-only;
# docs/benchmarks.md, "Decode: the values apart"). The compiler rejects a name it does not know.
XLA_OPTIONS_ENV = "MESHLM_DECODE_XLA_OPTIONS"


def decode_xla_options() -> tuple:
    """``MESHLM_DECODE_XLA_OPTIONS`` as sorted (name, value) pairs; a bad value is one line."""
    text = os.environ.get(XLA_OPTIONS_ENV, "")
    try:
        options = json.loads(text) if text else {}
    except json.JSONDecodeError:
        options = None
    if not isinstance(options, dict) or not all(
        isinstance(v, (bool, int, float, str)) for v in options.values()
    ):
        raise ConfigError(
            f"{XLA_OPTIONS_ENV}={text!r}: give a JSON object of compiler option names to numbers, booleans "
            "or strings, e.g. '{\"xla_vf_vmem_min_overlap_to_async_copy_ratio\": 10}' (or leave it unset)"
        )
    return tuple(sorted(options.items()))


class Programs:
    """The jitted prefill and decode of one (config, layout, max_len, parameter dtypes, chunk length),
    and their executables per global batch size. Shared by every Generator of that model
    (``programs_for``)."""

    def __init__(
        self,
        cfg: ModelConfig,
        layout: Layout,
        specs,
        max_len: int,
        cache_dtype,
        prefill_cp=False,
        chunk=DECODE_CHUNK,
    ):
        self.cfg, self.layout, self.max_len, self.cache_dtype = cfg, layout, max_len, cache_dtype
        self.chunk = chunk  # decode steps a "chunk" program (0: generation runs single steps)
        self.xla_options = decode_xla_options()  # the decode programs' compiler options (a measurement's)
        fns = sharded_fns(cfg, layout, specs, cache_dtype, prefill_cp, max_len=max_len, chunk=max(chunk, 1))
        self.jit = {
            "prefill": jax.jit(fns[0]),
            "decode": jax.jit(fns[1], donate_argnums=(4,)),
            "chunk": jax.jit(fns[2], donate_argnums=(4,)),
        }
        self.by_batch: dict[int, dict] = {}  # global batch -> {kind: its executable}, as compiled

    def _abstract(self, shape, dtype, spec):
        """A global ``shape`` laid out by ``spec`` on the mesh, for lowering."""
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(self.layout.mesh, spec))

    def executables(self, params, batch: int, kinds=KINDS) -> dict:
        """The executables of a global ``batch`` (prefill, a decode step, a chunk of them), ``kinds`` of
        them compiled if not yet (ahead of time: a generation asks for the ones it will run before its
        timing starts; a short one never compiles the chunk)."""
        done = self.by_batch.setdefault(batch, {})
        missing = [kind for kind in kinds if kind not in done]
        if not missing:
            return done
        row = self._abstract((batch,), jnp.int32, self.layout.spec("batch"))
        key = self._abstract(jax.eval_shape(jax.random.PRNGKey, 0).shape, jnp.uint32, P())
        sampling = tuple(self._abstract((), x.dtype, P()) for x in Sampling().args())
        if "prefill" in missing:
            tokens = self._abstract((batch, self.max_len), jnp.int32, self.layout.spec("batch", None))
            done["prefill"] = self.jit["prefill"].lower(params, tokens, row, row, key, sampling).compile()
        decodes = [kind for kind in missing if kind != "prefill"]
        if decodes:
            cshapes = cache_shapes(self.cfg, self.layout.mp, batch, self.max_len)
            dtypes = cache_dtypes(self.cfg, self.cache_dtype)
            specs = cache_specs(self.cfg, self.layout)
            cache = {k: self._abstract(cshapes[k], dtypes[k], s) for k, s in specs.items()}
            decode_in = (params, row, row, row, cache, key, self._abstract((), jnp.int32, P()), sampling, row)
            for kind in decodes:
                lowered = self.jit[kind].lower(*decode_in)
                done[kind] = (
                    lowered.compile(dict(self.xla_options)) if self.xla_options else lowered.compile()
                )
        return done


def kinds_for(max_new_tokens: int, chunk: int = DECODE_CHUNK) -> tuple[str, ...]:
    """The programs a generation of ``max_new_tokens`` runs (``generator._decode``'s schedule): the
    prefill (the first token), then chunks (the last one's steps past ``max_new_tokens`` dropped), or
    with ``chunk`` 0 single steps."""
    if max_new_tokens <= 1:
        return ("prefill",)
    return ("prefill", "chunk" if chunk else "decode")


def check_prefill_cp(cfg: ModelConfig, layout: Layout, max_len: int, prefill_cp: bool = True) -> None:
    """What a prefill over cp cannot run, as one line before any compile. With ``prefill_cp`` the
    prefill splits the (padded) prompts over the layout's cp axis as training does, each cp shard its
    two load-balanced chunks (``programs._forward_cp``): max_len must split into 2 x cp chunks. The
    decode then runs without cp (each cp shard repeats it on its dp x mp part of the mesh). Without
    ``prefill_cp`` a layout's cp shards hold copies throughout."""
    if not prefill_cp:
        return
    chunks = 2 * layout.cp
    if layout.cp < 2:
        raise ConfigError(f"prefill over cp needs a layout with cp >= 2 (it has cp={layout.cp}); add --cp")
    if not cfg.arch.attention:
        raise ConfigError(f"family {cfg.family!r} has no attention: nothing to split over cp; drop --cp")
    if max_len % chunks:
        raise ConfigError(
            f"prefill over --cp {layout.cp} splits the padded prompt (cache length {max_len}, the model's "
            f"context by default) into 2 x cp = {chunks} chunks, which do not divide it: use a --cp N with "
            f"2N dividing {max_len}"
        )
    check_context(cfg, layout)  # --doc-mask: refused with cp
    if cfg.full_attn_every and max_len // chunks < cfg.linear_conv - 1:  # (``model.linear_context``)
        raise ConfigError(
            f"prefill over --cp {layout.cp}: chunks of {max_len // chunks} tokens are shorter than the "
            f"linear layers' conv history ({cfg.linear_conv - 1} inputs, from the chunk before): "
            "use a smaller --cp"
        )
    if mixed_kinds(cfg):
        raise ConfigError(
            f"prefill over --cp does not fill {cfg.family}'s local and global caches yet (local layers "
            "keep a window or a chunk, global ones the context); drop --cp"
        )


_PROGRAMS: dict[tuple, Programs] = {}


def programs_for(
    cfg: ModelConfig,
    layout: Layout,
    specs,
    max_len: int,
    params,
    prefill_cp: bool = False,
    chunk: int = DECODE_CHUNK,
) -> Programs:
    """The shared ``Programs`` of this model and chunk length (made on first use); ``params`` give the
    dtypes. Programs traced under another cache-write mode (``cache_kernel.write_mode``), values mode
    (``attention.values_apart``) or decode compiler options (``decode_xla_options``), a measurement's,
    are others."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise ConfigError(f"chunk={chunk!r}: give decode steps a program as a whole number >= 0")
    dtypes = tuple(str(p.dtype) for p in jax.tree.leaves(params))
    check_prefill_cp(cfg, layout, max_len, prefill_cp)
    modes = (write_mode(), values_apart(), decode_xla_options())
    key = (cfg, layout, layout.mesh, max_len, dtypes, prefill_cp, modes, chunk)
    if key not in _PROGRAMS:
        dtype = params["embed"]["embeddings"].dtype
        _PROGRAMS[key] = Programs(cfg, layout, specs, max_len, dtype, prefill_cp, chunk)
    return _PROGRAMS[key]
