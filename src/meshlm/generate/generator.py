"""Text generation: KV-cached incremental decoding inside ``jax.shard_map``, and sampling.

Flow. Prompts (text, or lists of token ids) are right-padded to one fixed length ``S`` (``max_len``,
default ``max_seq_len``) and prefilled in ONE pass, which also samples each row's first new token from
the logits at that row's own last prompt position. ``decode_step`` then feeds one token per row at the
row's own position. Both are ``shard_map`` functions compiled ahead of time once per batch size, so
neither prompt lengths nor the number of new tokens ever trigger a compilation.

KV cache ``{"k", "v"}``: global [L, B, S, Kc, E], spec ``P(None, DP, None, MP, None)``, per shard
[L, B/dp, S, Kc/mp, E]. ``Kc = n_kv_heads`` when mp divides them, so each device holds total/(dp*mp)
bytes. When KV heads are replicated (mp > n_kv_heads, see ``attention.kv_replicated``) ``Kc = mp``:
each shard stores only the one KV head its query heads use (per shard Kc/mp = 1). Prefill writes all
S slots, padding included; a padding slot is either overwritten by ``decode_step`` before any query
can see it (a step writes slot p, then attends to slots <= p) or stays masked.

The "ff" family has no attention and no positions: the logits at a position depend on that token
alone, so running the model on the last token IS the full recomputation (exact, O(1) per step). It
needs no cache (an empty dict).

Sampling (inside the same ``shard_map``, on full-vocabulary logits replicated over MP): temperature 0
is greedy (argmax); otherwise logits / temperature, restricted to the top-k tokens (0: all) and to the
smallest set of most likely tokens whose probability reaches top-p (1.0: all). Ties at a cut-off are
kept. Row r at step s draws with ``fold_in(fold_in(PRNGKey(seed), s), r)``: reproducible, and the same
on every mesh. Settings are traced values: changing them does not recompile.

Stopping (host side, per step): ``max_new_tokens``, the end-of-document id (``data.EOD``; kept in
``tokens``, not in ``text``), or a stop string (``text`` ends before it; generation stops at the step
that completes it). Text streams through ``on_token(index, token, piece)``: bytes are decoded
incrementally (a multi-byte UTF-8 character arrives whole) and text that could begin a stop string is
held back until it cannot, so the pieces of a row always join to exactly its ``text``.
"""

from __future__ import annotations

import codecs
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from numbers import Integral
from pathlib import Path

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshlm.data.corpus import EOD
from meshlm.data.corpus import decode as byte_decode
from meshlm.data.corpus import encode as byte_encode
from meshlm.data.tokens import check_token_range
from meshlm.errors import ConfigError, GenerationError
from meshlm.model.attention import kv_replicated
from meshlm.model.config import ModelConfig
from meshlm.model.layers import upcast
from meshlm.model.transformer import local_logits
from meshlm.parallel.axes import DP, MP
from meshlm.parallel.context import Parallel
from meshlm.parallel.placement import to_host
from meshlm.parallel.rules import model_specs, shardings
from meshlm.parallel.spmd import mesh_parallel

OnToken = Callable[[int, int, str], None]  # (prompt index, token id, newly printable text)
CACHE_SPEC = P(None, DP, None, MP, None)  # [L, B, S, Kc, E]


# --- the KV cache ------------------------------------------------------------------------------


def cache_specs(cfg: ModelConfig) -> dict:
    return {} if cfg.family == "ff" else {"k": CACHE_SPEC, "v": CACHE_SPEC}


def cache_heads(cfg: ModelConfig, mp: int) -> tuple[int, int]:
    """(global Kc, per-shard Kc/mp) of the cache's KV-head dimension."""
    if kv_replicated(cfg.kv_heads, mp):
        return mp, 1  # one stored KV head per shard: the one its queries use
    return cfg.kv_heads, cfg.kv_heads // mp


def _cache_tail(cfg: ModelConfig, mesh) -> tuple[int, int]:
    return cache_heads(cfg, mesh.shape[MP])[0], cfg.dim_per_head


def cache_bytes(cfg: ModelConfig, mesh, batch: int, max_len: int, dtype=jnp.float32) -> dict:
    """{"total", "per_device"} bytes of the K and V caches for a global ``batch`` on ``mesh``."""
    if cfg.family == "ff":
        return {"total": 0, "per_device": 0}
    kc, _ = cache_heads(cfg, mesh.shape[MP])
    total = 2 * cfg.n_layers * batch * max_len * kc * cfg.dim_per_head * jnp.dtype(dtype).itemsize
    return {"total": total, "per_device": total // (mesh.shape[DP] * mesh.shape[MP])}


def _empty_cache(cfg: ModelConfig, par: Parallel, batch: int, max_len: int, dtype) -> dict:
    """Zeros of the per-shard shape [L, B/dp, S, Kc/mp, E] (made on device, inside shard_map)."""
    if cfg.family == "ff":
        return {}
    shape = (cfg.n_layers, batch, max_len, cache_heads(cfg, par.mp)[1], cfg.dim_per_head)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


# --- sharded functions ---------------------------------------------------------------------------


def _full_vocab(par: Parallel, vocab: int, local):
    """[B, V/mp] per shard -> [B, V] replicated. A psum of disjoint slices rather than all_gather,
    whose result shard_map types as still varying over MP; adding zeros is exact."""
    if not par.sharded:
        return local
    full = jnp.zeros((*local.shape[:-1], vocab), local.dtype)
    full = lax.dynamic_update_slice_in_dim(full, local, par.vocab_start(local.shape[-1]), axis=-1)
    return par.g(full)


def _forward(cfg: ModelConfig, par: Parallel, tokens, positions, last, cache):
    """Haiku fn. tokens, positions [B, T] per shard; last [B]: the column whose logits each row needs.
    Returns (logits [B, V] float32 replicated over MP, new cache)."""
    local, cache = local_logits(cfg, par, tokens, positions, cache or None)  # [B, T, V/mp]
    picked = jnp.take_along_axis(local, last[:, None, None], axis=1)[:, 0]  # [B, V/mp]
    return _full_vocab(par, cfg.vocab_size, upcast(picked)), cache or {}


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
    """logits [B, V] float32; rows [B] global row ids; sampling (temperature, top_k, top_p) -> [B]."""
    temperature, top_k, top_p = sampling
    greedy = jnp.argmax(logits, axis=-1)
    scaled = _filter(logits / jnp.maximum(temperature, 1e-6), top_k, top_p)
    keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(key, step), r))(rows)
    drawn = jax.vmap(jax.random.categorical)(keys, scaled)
    return jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)


def sharded_fns(cfg: ModelConfig, mesh, specs, cache_dtype):
    """(prefill, decode_step): ``shard_map`` functions over ``mesh``; params laid out by ``specs``.

    prefill(params, tokens [B, S], lengths [B], rows [B], key, sampling) -> (next [B], logits [B, V], cache)
    decode_step(params, tokens [B], positions [B], rows [B], cache, key, step, sampling) -> same
    Global shapes; rows split over DP. Only params and the cache are sharded over MP.
    """
    par = mesh_parallel(mesh)
    apply = hk.without_apply_rng(hk.transform(partial(_forward, cfg, par))).apply

    def prefill(params, tokens, lengths, rows, key, sampling):  # tokens [B/dp, S], lengths [B/dp] per shard
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        cache = _empty_cache(cfg, par, tokens.shape[0], tokens.shape[1], cache_dtype)
        logits, cache = apply(params, tokens, positions, lengths - 1, cache)
        return sample(logits, key, rows, 0, sampling), logits, cache

    def decode_step(params, tokens, positions, rows, cache, key, step, sampling):  # tokens [B/dp] per shard
        last = jnp.zeros_like(positions)
        logits, cache = apply(params, tokens[:, None], positions[:, None], last, cache)
        return sample(logits, key, rows, step, sampling), logits, cache

    row, cspec = P(DP), cache_specs(cfg)
    out = (row, P(DP, None), cspec)
    prefill_in = (specs, P(DP, None), row, row, P(), P())
    decode_in = (specs, row, row, row, cspec, P(), P(), P())
    return (
        jax.shard_map(prefill, mesh=mesh, in_specs=prefill_in, out_specs=out),
        jax.shard_map(decode_step, mesh=mesh, in_specs=decode_in, out_specs=out),
    )


# --- host side: settings, tokenizers, streaming ---------------------------------------------------


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1.0: no nucleus cut
    seed: int = 0

    def check(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise GenerationError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k < 0:
            raise GenerationError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise GenerationError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")

    def args(self) -> tuple:
        return np.float32(self.temperature), np.int32(self.top_k), np.float32(self.top_p)


class ByteTokenizer:
    """meshlm's tokenizer: one id per UTF-8 byte (``meshlm.data``)."""

    encode = staticmethod(byte_encode)
    decode = staticmethod(byte_decode)


class _ByteStream:
    """Incremental UTF-8: a multi-byte character comes out once its last byte arrives."""

    def __init__(self):
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        return self._dec.decode(bytes([token])) if 0 <= token < 256 else "\ufffd"

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class _DiffStream:
    """Any tokenizer with ``decode(ids) -> str``: emit what decoding all ids adds; wait while the
    text ends in U+FFFD (a partial character) or earlier text changed."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.out = tokenizer, [], ""

    def feed(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self.out):
            return ""
        new, self.out = text[len(self.out) :], text
        return new

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids)
        return text[len(self.out) :] if text.startswith(self.out) else ""


def _holdback(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


class _Row:
    """One prompt's output: its ids, its text so far, why it ended; streams through ``on_token``."""

    def __init__(self, index: int, stream, stops: Sequence[str], eod: int | None, on_token):
        self.index, self.stream, self.stops, self.eod, self.on_token = index, stream, stops, eod, on_token
        self.ids: list[int] = []
        self.text, self.sent, self.finish = "", 0, None

    def push(self, token: int, last: bool) -> None:
        self.ids.append(token)
        start = len(self.text)
        if token == self.eod:
            self.finish = "eod"
        else:
            self.text += self.stream.feed(token)
        if last and self.finish is None:
            self.finish = "length"
        if self.finish:
            self.text += self.stream.flush()
        self._find_stop(start)
        end = len(self.text) if self.finish else len(self.text) - _holdback(self.text, self.stops)
        piece, self.sent = self.text[self.sent : end], max(self.sent, end)
        if self.on_token is not None:
            self.on_token(self.index, token, piece)

    def _find_stop(self, start: int) -> None:
        hits = [self.text.find(s, max(0, start - len(s) + 1)) for s in self.stops]
        hits = [i for i in hits if i >= 0]
        if hits:
            self.text, self.finish = self.text[: min(hits)], "stop"


@dataclass
class GenerationResult:
    prompt: str | list[int]
    tokens: list[int]  # generated ids (a final EOD included)
    text: str  # generated text (without EOD, ending before a stop string)
    prefill_tokens_per_s: float  # whole batch: real prompt tokens / prefill wall time
    decode_tokens_per_s: float  # whole batch: tokens made by decode steps / their wall time (0: none)
    finish_reason: str  # "length", "eod" or "stop"

    def to_json(self) -> dict:
        return asdict(self)


def read_prompt_file(path: str | Path) -> str:
    """The whole file as one prompt, verbatim; an error names the file and the first bad byte."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise GenerationError(f"cannot read prompt file {path}: {e.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GenerationError(
            f"prompt file {path} is not UTF-8: byte offset {e.start} (0x{data[e.start]:02x}) {e.reason}; "
            "re-encode it as UTF-8 (e.g. iconv -t UTF-8)"
        ) from None


def _check_stops(stop) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if any(not isinstance(s, str) or not s for s in stops):
        raise GenerationError(f"stop strings must be non-empty strings, got {stops!r}")
    return stops


# --- the generator -------------------------------------------------------------------------------


class _Programs:
    """The jitted prefill and decode of one (config, mesh, max_len, parameter dtypes), and their
    executables per global batch size. Shared by every Generator of that model (module cache)."""

    def __init__(self, cfg: ModelConfig, mesh, specs, max_len: int, cache_dtype):
        self.cfg, self.mesh, self.max_len, self.cache_dtype = cfg, mesh, max_len, cache_dtype
        prefill, decode = sharded_fns(cfg, mesh, specs, cache_dtype)
        self.jit = {"prefill": jax.jit(prefill), "decode": jax.jit(decode, donate_argnums=(4,))}
        self.by_batch: dict[int, dict] = {}  # global batch -> {"prefill", "decode"} executables

    def _abstract(self, shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(self.mesh, spec))

    def executables(self, params, batch: int) -> dict:
        """Compile prefill and decode for a global ``batch`` (ahead of time: never inside a timing)."""
        if batch not in self.by_batch:
            row = self._abstract((batch,), jnp.int32, P(DP))
            key = self._abstract(jax.eval_shape(jax.random.PRNGKey, 0).shape, jnp.uint32, P())
            sampling = tuple(self._abstract((), x.dtype, P()) for x in Sampling().args())
            tokens = self._abstract((batch, self.max_len), jnp.int32, P(DP, None))
            cshape = (self.cfg.n_layers, batch, self.max_len, *_cache_tail(self.cfg, self.mesh))
            cache = {k: self._abstract(cshape, self.cache_dtype, s) for k, s in cache_specs(self.cfg).items()}
            step = self._abstract((), jnp.int32, P())
            prefill = self.jit["prefill"].lower(params, tokens, row, row, key, sampling)
            decode = self.jit["decode"].lower(params, row, row, row, cache, key, step, sampling)
            self.by_batch[batch] = {"prefill": prefill.compile(), "decode": decode.compile()}
        return self.by_batch[batch]


_PROGRAMS: dict[tuple, _Programs] = {}


def _programs(cfg: ModelConfig, mesh, specs, max_len: int, params) -> _Programs:
    dtypes = tuple(str(p.dtype) for p in jax.tree.leaves(params))
    key = (cfg, mesh, max_len, dtypes)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = _Programs(cfg, mesh, specs, max_len, params["embed"]["embeddings"].dtype)
    return _PROGRAMS[key]


class Generator:
    """Sharded KV-cached generation for a model ``cfg`` with ``params`` on ``mesh`` (axes dp, mp).

    ``max_len``: the cache length S (default ``cfg.max_seq_len``): prompt + new tokens must fit in it.
    ``tokenizer``: ``encode(str) -> ids`` / ``decode(ids) -> str`` (default: bytes). ``eod``: the id
    that ends generation (None: never stop on a token). Compiled programs are shared by Generators of
    the same config, mesh, max_len and parameter dtypes.
    """

    def __init__(self, cfg: ModelConfig, params, mesh, *, max_len=None, tokenizer=None, eod=EOD):
        self.cfg, self.mesh, self.eod = cfg, mesh, eod
        self.max_len = cfg.max_seq_len if max_len is None else int(max_len)
        if not 1 <= self.max_len <= cfg.max_seq_len:
            raise ConfigError(f"max_len={max_len} must be in [1, max_seq_len={cfg.max_seq_len}]")
        self.tokenizer = tokenizer or ByteTokenizer()
        self.dp = mesh.shape[DP]
        specs = model_specs(cfg, params, mesh.shape[MP])
        self.params = jax.device_put(params, shardings(specs, mesh))  # a no-op when already laid out
        self._prog = _programs(cfg, mesh, specs, self.max_len, self.params)
        self._last_constants: tuple = (None, None)

    @property
    def compilations(self) -> int:
        """Executables built so far for this model: two per batch size, never per length or step."""
        return 2 * len(self._prog.by_batch)

    def _put(self, x, spec):
        return jax.device_put(x, NamedSharding(self.mesh, spec))

    def _executables(self, batch: int) -> dict:
        return self._prog.executables(self.params, batch)

    def _constants(self, sampling: Sampling, batch: int) -> tuple:
        """(rows, key, sampling) on device for this call: placed once per generate, not per step."""
        if self._last_constants[0] != (sampling, batch):
            rows = self._put(np.arange(batch, dtype=np.int32), P(DP))
            key = self._put(jax.random.PRNGKey(sampling.seed), P())
            self._last_constants = ((sampling, batch), (rows, key, self._put(sampling.args(), P())))
        return self._last_constants[1]

    def prefill(self, tokens: np.ndarray, lengths: np.ndarray, sampling: Sampling):
        """tokens [B, S] right-padded host ids, lengths [B] -> device (next [B], logits [B, V], cache)."""
        rows, key, settings = self._constants(sampling, tokens.shape[0])
        tokens_d = self._put(tokens.astype(np.int32), P(DP, None))
        lengths_d = self._put(lengths.astype(np.int32), P(DP))
        run = self._executables(tokens.shape[0])["prefill"]
        return run(self.params, tokens_d, lengths_d, rows, key, settings)

    def decode_step(self, tokens, positions, cache, sampling: Sampling, step: int):
        """tokens, positions [B] host ids -> device (next [B], logits [B, V], cache). ``cache`` is donated."""
        tokens = np.asarray(tokens, np.int32)
        rows, key, settings = self._constants(sampling, tokens.shape[0])
        tokens_d = self._put(tokens, P(DP))
        positions_d = self._put(np.minimum(positions, self.max_len - 1).astype(np.int32), P(DP))
        run = self._executables(tokens.shape[0])["decode"]
        return run(
            self.params, tokens_d, positions_d, rows, cache, key, self._put(np.int32(step), P()), settings
        )

    # --- inputs ----------------------------------------------------------------------------------

    def encode_prompt(self, index: int, prompt) -> np.ndarray:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        ids = np.asarray(ids)
        if ids.ndim != 1:
            raise GenerationError(f"prompt {index} must be a string or a flat list of token ids")
        if ids.size == 0:
            raise GenerationError(f"prompt {index} is empty; give at least one token to continue from")
        check_token_range(ids, self.cfg.vocab_size, f"prompt {index}")
        return ids.astype(np.int32)

    def _check_budget(self, ids: list[np.ndarray], max_new_tokens: int) -> None:
        s = self.max_len
        if not ids:
            raise GenerationError("no prompts given; pass at least one")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, Integral) or max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        for i, row in enumerate(ids):
            if len(row) > s:
                raise GenerationError(f"prompt {i} has {len(row)} tokens, longer than the context of {s}")
            if len(row) + max_new_tokens > s:
                raise GenerationError(
                    f"prompt {i} ({len(row)} tokens) + max_new_tokens={max_new_tokens} exceeds the "
                    f"context of {s} tokens; use max_new_tokens <= {s - len(row)} or a shorter prompt"
                )

    def _pad(self, ids: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Right-pad to [B', S], B' the next multiple of dp (extra rows: one EOD token, ignored)."""
        b = -(-len(ids) // self.dp) * self.dp
        tokens = np.zeros((b, self.max_len), np.int32)
        lengths = np.ones(b, np.int32)
        for i, row in enumerate(ids):
            tokens[i, : len(row)], lengths[i] = row, len(row)
        return tokens, lengths

    # --- generation ------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop: str | Sequence[str] | None = None,
        on_token: OnToken | None = None,
    ) -> list[GenerationResult]:
        """Continue every prompt (one batch); see the module docstring for sampling and stopping."""
        sampling = Sampling(float(temperature), int(top_k), float(top_p), int(seed))
        sampling.check()
        ids = [self.encode_prompt(i, p) for i, p in enumerate(prompts)]
        self._check_budget(ids, max_new_tokens)
        stops = _check_stops(stop)
        rows = [_Row(i, self._stream(), stops, self.eod, on_token) for i in range(len(ids))]
        tokens, lengths = self._pad(ids)
        self._executables(len(tokens))
        t0 = time.perf_counter()
        nxt, _, cache = self.prefill(tokens, lengths, sampling)
        nxt = to_host(nxt)
        t1 = time.perf_counter()
        self._push(rows, nxt, max_new_tokens == 1)
        steps, decoded = 1, 0
        while steps < max_new_tokens and any(r.finish is None for r in rows):
            nxt, _, cache = self.decode_step(nxt, lengths + steps - 1, cache, sampling, steps)
            nxt = to_host(nxt)
            steps += 1
            decoded += self._push(rows, nxt, steps == max_new_tokens)
        t2 = time.perf_counter()
        rates = (sum(map(len, ids)) / (t1 - t0), decoded / (t2 - t1) if decoded else 0.0)
        return [self._result(p, r, rates) for p, r in zip(prompts, rows, strict=True)]

    def _stream(self):
        return _ByteStream() if isinstance(self.tokenizer, ByteTokenizer) else _DiffStream(self.tokenizer)

    @staticmethod
    def _push(rows: list[_Row], nxt: np.ndarray, last: bool) -> int:
        """Give each unfinished row its new token; returns how many rows were still running."""
        live = [r for r in rows if r.finish is None]
        for r in live:
            r.push(int(nxt[r.index]), last)
        return len(live)

    @staticmethod
    def _result(prompt, row: _Row, rates: tuple[float, float]) -> GenerationResult:
        prompt = prompt if isinstance(prompt, str) else [int(t) for t in prompt]
        return GenerationResult(prompt, row.ids, row.text, rates[0], rates[1], row.finish)

    def logits_with_cache(self, tokens, lengths) -> list[np.ndarray]:
        """Teacher-forced cached logits. Row b is prefilled with tokens[b, :lengths[b]], then fed
        tokens[b, t] one decode step at a time. Returns per row [T - lengths[b] + 1, V] float32: the
        next-token logits at positions lengths[b] - 1 ... T - 1 (a full forward's logits there)."""
        tokens, lengths = np.asarray(tokens), np.asarray(lengths, np.int64)
        if tokens.ndim != 2 or lengths.shape != tokens.shape[:1]:
            raise GenerationError(
                f"tokens must be [B, T] with lengths [B]; got {tokens.shape}, {lengths.shape}"
            )
        check_token_range(tokens, self.cfg.vocab_size, "tokens")
        t = tokens.shape[1]
        if t > self.max_len or lengths.min() < 1 or lengths.max() > t:
            raise GenerationError(f"need 1 <= lengths <= T={t} <= max_len={self.max_len}; got {lengths}")
        ids = [self.encode_prompt(b, tokens[b, :n]) for b, n in enumerate(lengths)]
        padded, lens = self._pad(ids)
        feed = np.zeros_like(padded)
        feed[: len(ids), :t] = tokens
        greedy = Sampling()
        _, logits, cache = self.prefill(padded, lens, greedy)
        out = [to_host(logits)]
        for j in range(t - int(lengths.min())):
            pos = np.minimum(lens + j, self.max_len - 1)
            _, logits, cache = self.decode_step(feed[np.arange(len(pos)), pos], pos, cache, greedy, j + 1)
            out.append(to_host(logits))
        stacked = np.stack(out, axis=1)  # [B', steps + 1, V]
        return [stacked[b, : t - n + 1] for b, n in enumerate(lengths)]


def bench_generation(cfg: ModelConfig, params, mesh, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """Throughput of ``batch`` random prompts of ``prompt_len`` tokens, ``new_tokens`` each, with the
    cache sized to exactly prompt_len + new_tokens (prefill runs over all of it: fixed shapes). A first
    short run compiles and warms up outside the timing. Never stops early (no EOD)."""
    gen = Generator(cfg, params, mesh, max_len=prompt_len + new_tokens, eod=None)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, prompt_len).tolist() for _ in range(batch)]
    gen.generate(prompts, min(2, new_tokens))
    r = gen.generate(prompts, new_tokens)[0]
    return {"prefill_tokens_per_s": r.prefill_tokens_per_s, "decode_tokens_per_s": r.decode_tokens_per_s}
