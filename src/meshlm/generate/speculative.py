"""Self-speculative decoding with the MTP depths (``generate --speculative mtp``; DeepSeek-V3's
multi-token prediction, ``model.mtp``): the compiled prefill and verify step, inside ``jax.shard_map``.

Notation, per row: the tokens t_0 .. t_{n-1} are committed (prompt and output); the main cache holds
positions 0 .. n-2 (t_{n-1} is not fed yet) and q_1 .. q_D are the D depths' drafts of t_n .. t_{n+D-1}.

Verify: ONE main forward over [t_{n-1}, q_1, .., q_D] at positions n-1 .. n-1+D (the main cache holds
the earlier ones) gives the greedy g_0 .. g_D (g_i: the main model's t_{n+i}, its argmax as
``programs.sample``'s at temperature 0). The accepted count a is the longest prefix with q_i = g_{i-1};
the step commits q_1 .. q_a (= g_0 .. g_{a-1}) and g_a: a + 1 tokens, exactly the main model's greedy
ones, so the output equals generation without speculation token for token.

Drafting (the same program, after the main forward): depth 1 at position j joins h^0_j (the main
model's last layer output) with Emb(t_{j+1}); at positions n-1+i, i <= a, t_{n+i} = g_i, so depth 1
runs over the D+1 positions with ids g (the ``known`` rule below). Its output at the newest committed
position n-1+a drafts t_{n+a+1}; depth d+1 embeds depth d's ids one further ahead, with the draft just
made at that position (DeepSeek's sequential chain). Each depth keeps a cache of its own block's keys
("mtp_k", "mtp_v" [D, B, S', Kc * E], the main cache's layout: MLA's latent for DeepSeek-V3).

Rejected tokens are not rolled back: their cache entries are OVERWRITTEN before any query sees them.
Proof: a step writes positions P .. P+D (P = n-1) in the main cache and in every depth's; the entries
valid afterwards are those below n' - 1 = P + a + 1 (the tokens fed at P .. P+a were committed, and the
cached keys below P were valid before). The stale ones, P+a+1 .. P+D, lie at or after n' - 1, the next
step's first position, and that step writes n'-1 .. n'-1+D >= P+D before it attends: every stale slot
is rewritten first. A query at position p sees only slots <= p (the causal mask on absolute positions),
so queries of this step at i <= a see only valid slots and the ones written by this step; queries at
i > a may see stale ones, and their outputs are discarded. For depth 1 the entry at P+i (i <= a) is
(h^0_{P+i}, Emb(g_i)) = the full forward's on the committed tokens, so its draft equals the full
forward's depth-1 prediction there (``tests/test_speculative.py`` compares them in float64). Depth
d >= 2 needs t_{j+d}, not yet known at the d-1 newest positions: those entries hold the chain's
drafted ids (a draft's quality, not the output's exactness, depends on them).

Slots: the caches hold S' = max_len + D positions, so the D draft positions past the last budgeted one
are written in bounds (a row stops advancing once it finishes: its n - 1 <= max_len - 2).

Refused (``check_speculative``): sampling (greedy only: the exact rejection-sampling rule is not
built), a prefill over cp, windows or chunks (a rolling cache's slot p % W would be overwritten by a
rejected token while a later query still sees it), layer kinds, per-layer inputs, the document mask.
"""

from __future__ import annotations

from functools import partial

import haiku as hk
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from meshlm.errors import ConfigError
from meshlm.generate.cache import cache_dtypes, cache_shapes, cache_specs, empty_cache
from meshlm.generate.programs import _full_vocab
from meshlm.model import mtp
from meshlm.model.attention import values_apart
from meshlm.model.cache_kernel import write_mode
from meshlm.model.config import ModelConfig
from meshlm.model.layers import upcast, varying_like
from meshlm.model.transformer import local_logits_stats
from meshlm.parallel.context import Parallel
from meshlm.parallel.layout import Layout

DEPTH_KEYS = {"mtp_k": "k", "mtp_v": "v"}  # each depth's block cache [D, ...], beside the main "k", "v"


FIX = "drop --speculative mtp"


def check_speculative_run(temperature: float, prefill_cp: bool = False) -> None:
    """The run's options ``--speculative mtp`` cannot combine with, as one line (sampling: before the
    devices start; a prefill over cp: once the layout says, ``check_speculative``)."""
    if temperature > 0:
        raise ConfigError(
            f"--speculative mtp is greedy only (the exact rejection-sampling rule is not built): "
            f"use --temperature 0 (got {temperature}) or {FIX}"
        )
    if prefill_cp:
        raise ConfigError(f"--speculative mtp with --cp (a prefill over cp) is not built: drop --cp or {FIX}")


def check_speculative(cfg: ModelConfig, params, temperature: float, prefill_cp: bool) -> None:
    """What ``--speculative mtp`` cannot run, as one line before any work (``params``: None before
    they load)."""
    if not cfg.mtp_layers:
        raise ConfigError(
            f"--speculative mtp needs MTP depths (mtp_layers >= 1: num_nextn_predict_layers); this "
            f"{cfg.family} model has none: {FIX}"
        )
    if params is not None and not any(str(k).startswith(mtp.MODULE.format(d=0)) for k in params):
        raise ConfigError(f"--speculative mtp: the checkpoint has no MTP weights (mtp_0/...): {FIX}")
    check_speculative_run(temperature, prefill_cp)
    refused = {
        "windowed or chunked attention (a rolling cache: a rejected token would overwrite a visible slot)": (
            cfg.local_span or cfg.global_every
        ),
        "per-layer inputs": cfg.per_layer,
        "the document mask (doc_mask)": cfg.doc_mask >= 0,
    }
    for what, on in refused.items():
        if on:
            raise ConfigError(f"--speculative mtp with {what} is not built: {FIX}")


def spec_cache_shapes(cfg: ModelConfig, mp: int, batch: int, slots: int, shard: bool = False) -> dict:
    """Global (``shard``: per-shard Kc/mp) shapes of the main cache and the depths' ("mtp_k", "mtp_v":
    [D, B, slots, Kc * E], each depth one layer of the main cache's kind)."""
    main = cache_shapes(cfg, mp, batch, slots, slots=slots if shard else None)
    return main | {name: (cfg.mtp_layers, *main[key][1:]) for name, key in DEPTH_KEYS.items()}


class CachedDepth(mtp.Depth):
    """``mtp.Depth`` with its block's cache (the same parameters: one module, ``mtp.MODULE``'s name):
    (h [B, T, D], the embedded ids [B, T, D], positions, cache) -> (h^d, its head input, new cache)."""

    def __call__(self, h, e, positions, starts, cache=None):
        joined = jnp.concatenate([self.norm("enorm")(e), self.norm("hnorm")(h)], axis=-1)
        x = mtp.EHProj(par=self.par, stddev=self.stddev)(joined)
        out = self.block(x, positions, cache, starts)
        return out[0], self.norm("head_norm")(out[0]), out[1]


def accepted(fed, greedy):
    """[B]: the longest prefix of the drafts fed[:, 1:] equal to the main model's greedy[:, :-1]."""
    match = (fed[:, 1:] == greedy[:, :-1]).astype(jnp.int32)
    return jnp.sum(jnp.cumprod(match, axis=1), axis=1)


def _greedy(cfg: ModelConfig, par: Parallel, local):
    """Per-shard logits [B, T, Vpad/mp] -> (argmax [B, T] int32, full logits [B, T, V] float32)."""
    full = _full_vocab(par, cfg.padded_vocab, upcast(local))[..., : cfg.vocab_size]
    return jnp.argmax(full, axis=-1).astype(jnp.int32), full


def known(tokens, at, bonus):
    """[B, T]: at position i the committed token after it, t_{i+1}: the next fed token before ``at``
    (prompt tokens, or accepted drafts), ``bonus`` [B] (the main model's token) at ``at``; positions
    after ``at`` get the bonus too (never committed: their entries are stale)."""
    i = jnp.arange(tokens.shape[1])[None, :]
    return jnp.where(i < at[:, None], mtp.ahead(tokens, 1), bonus[:, None])


def _drafts(cfg: ModelConfig, par: Parallel, x, ids, at, positions, parts, caches):
    """The depths' chain from the main model's hidden x [B, T, D]: ids [B, T] depth 1's tokens, at [B]
    the newest committed column -> (drafts [B, D], their logits [B, D, V], the depths' new caches)."""
    h, drafts, logits, new = x, [], [], {name: [] for name in DEPTH_KEYS}
    column = at[:, None, None]
    for d in range(cfg.mtp_layers):
        depth = CachedDepth(
            par=par,
            block=parts["block"](),
            norm=parts["norm"],
            stddev=parts["stddev"],
            name=mtp.MODULE.format(d=d),
        )
        own = {key: caches[name][d] for name, key in DEPTH_KEYS.items()}
        h, y, own = depth(h, parts["embed"](ids), positions, None, own)
        draft, full = _greedy(cfg, par, parts["head"](jnp.take_along_axis(y, column, axis=1)))  # [B, 1]
        drafts.append(draft[:, 0])
        logits.append(full[:, 0])
        for name, key in DEPTH_KEYS.items():
            new[name].append(own[key])
        i = jnp.arange(ids.shape[1])[None, :]
        ids = jnp.where(i == at[:, None], draft, mtp.ahead(ids, 1))  # the next depth's: one further ahead
    return jnp.stack(drafts, 1), jnp.stack(logits, 1), {n: jnp.stack(c) for n, c in new.items()}


def _forward(cfg: ModelConfig, par: Parallel, tokens, positions, lengths, cache):
    """Haiku fn: the main forward over tokens [B, T] at positions [B, T] with ``cache`` (main and
    depths'), then the depths' drafts. ``lengths`` [B]: a prefill's prompt lengths (the committed
    column is length - 1); None: a verify step (the committed column is the accepted count, and
    tokens[:, 1:] are the drafts). Returns (new tokens [B, T'], their count [B], drafts [B, D], draft
    logits [B, D, V], cache)."""
    main = {k: v for k, v in cache.items() if k not in DEPTH_KEYS}

    def after(x, local, parts):
        if lengths is None:
            greedy, _ = _greedy(cfg, par, local)  # [B, D + 1]: the main model's t_n .. t_{n+D}
            at = accepted(tokens, greedy)
        else:
            at = lengths - 1
        bonus = _greedy(cfg, par, jnp.take_along_axis(local, at[:, None, None], axis=1))[0][:, 0]
        made = greedy if lengths is None else bonus[:, None]
        out = _drafts(cfg, par, x, known(tokens, at, bonus), at, positions, parts, cache)
        return made, at + 1 if lengths is None else jnp.ones_like(at), *out

    _, main, _, (made, count, drafts, logits, depths) = local_logits_stats(
        cfg, par, tokens, positions, main, after=after
    )
    return made, count, drafts, logits, main | depths


def spec_fns(cfg: ModelConfig, layout: Layout, specs, cache_dtype):
    """(prefill, verify): ``shard_map`` functions over the layout's mesh (rows over its data shards,
    the caches laid out as ``cache.cache_specs``; global shapes).

    prefill(params, tokens [B, S'], lengths [B]) -> (first token [B, 1], ones [B], drafts [B, D],
        draft logits [B, D, V], cache)
    verify(params, fed [B, D + 1], first position [B], cache) -> (g [B, D + 1], committed count [B],
        drafts, draft logits, cache): the committed tokens are g[:, :count]
    """
    par, mesh = Parallel.on(Layout.of(layout, cp=1, cp_strategy="ring")), layout.mesh
    apply = hk.without_apply_rng(hk.transform(partial(_forward, cfg, par))).apply
    d = cfg.mtp_layers

    def prefill(params, tokens, lengths):  # tokens [B/dp, S'] per shard
        b, s = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(s), tokens.shape)
        shapes = spec_cache_shapes(cfg, layout.mp, b, s, shard=True)
        cache = {n: jnp.zeros(shape, cache_dtypes(cfg, cache_dtype)["k"]) for n, shape in shapes.items()}
        cache = varying_like(cache | empty_cache(cfg, par, b, s, cache_dtype), tokens, params)
        return apply(params, tokens, positions, lengths, cache)

    def verify(params, fed, first, cache):  # fed [B/dp, D + 1], first [B/dp] per shard
        positions = first[:, None] + jnp.arange(d + 1)
        return apply(params, fed, positions, None, cache)

    row, rows2 = layout.spec("batch"), layout.spec("batch", None)
    cspec = cache_specs(cfg, layout)
    cspec = cspec | {name: cspec[key] for name, key in DEPTH_KEYS.items()}
    out = (rows2, row, rows2, layout.spec("batch", None, None), cspec)
    return (
        jax.shard_map(prefill, mesh=mesh, in_specs=(specs, rows2, row), out_specs=out),
        jax.shard_map(verify, mesh=mesh, in_specs=(specs, rows2, row, cspec), out_specs=out),
    )


class SpecPrograms:
    """The jitted speculative prefill and verify of one (config, layout, max_len, parameter dtypes),
    compiled ahead of time per global batch size (as ``programs.Programs``)."""

    def __init__(self, cfg: ModelConfig, layout: Layout, specs, max_len: int, cache_dtype):
        self.cfg, self.layout, self.cache_dtype = cfg, layout, cache_dtype
        self.slots = max_len + cfg.mtp_layers  # S': the draft positions past the budget in bounds
        prefill, verify = spec_fns(cfg, layout, specs, cache_dtype)
        self.jit = {"prefill": jax.jit(prefill), "verify": jax.jit(verify, donate_argnums=(3,))}
        self.by_batch: dict[int, dict] = {}

    def _abstract(self, shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(self.layout.mesh, spec))

    def executables(self, params, batch: int) -> dict:
        if batch not in self.by_batch:
            lay, d = self.layout, self.cfg.mtp_layers
            row = self._abstract((batch,), jnp.int32, lay.spec("batch"))
            tokens = self._abstract((batch, self.slots), jnp.int32, lay.spec("batch", None))
            fed = self._abstract((batch, d + 1), jnp.int32, lay.spec("batch", None))
            shapes = spec_cache_shapes(self.cfg, lay.mp, batch, self.slots)
            specs = cache_specs(self.cfg, lay)
            specs |= {name: specs[key] for name, key in DEPTH_KEYS.items()}
            dtype = cache_dtypes(self.cfg, self.cache_dtype)["k"]
            cache = {k: self._abstract(shapes[k], dtype, s) for k, s in specs.items()}
            self.by_batch[batch] = {
                "prefill": self.jit["prefill"].lower(params, tokens, row).compile(),
                "verify": self.jit["verify"].lower(params, fed, row, cache).compile(),
            }
        return self.by_batch[batch]


_PROGRAMS: dict[tuple, SpecPrograms] = {}


def spec_programs_for(cfg: ModelConfig, layout: Layout, specs, max_len: int, params) -> SpecPrograms:
    """The shared ``SpecPrograms`` of this model (made on first use); ``params`` give the dtypes.
    Programs traced under another cache-write or values mode (a measurement's) are others."""
    dtypes = tuple(str(p.dtype) for p in jax.tree.leaves(params))
    key = (cfg, layout, layout.mesh, max_len, dtypes, write_mode(), values_apart())
    if key not in _PROGRAMS:
        _PROGRAMS[key] = SpecPrograms(cfg, layout, specs, max_len, params["embed"]["embeddings"].dtype)
    return _PROGRAMS[key]
