"""Text generation: KV-cached incremental decoding inside ``jax.shard_map``, and sampling.

Flow. Prompts (text, or lists of token ids) are right-padded to one fixed length ``S`` (``max_len``,
default ``max_seq_len``) and prefilled in ONE pass, which also samples each row's first new token from
the logits at that row's own last prompt position. ``decode_step`` then feeds one token per row at the
row's own position, ``chunk`` steps a program (``programs.decode_chunk``), each chunk dispatched from
the one before's outputs on the device before the host reads that one's tokens: the host's transfer,
streaming and stop checks run while the device decodes. All are ``shard_map``
functions compiled ahead of time once per batch size, so neither prompt lengths nor the number of new
tokens ever trigger a compilation. The decode programs take the cache donated, and each layer writes
its new tokens into it in place (``kv_kinds.carried_stack``): a step reads the parameters and the
cache, it does not copy the cache.

The parts: ``cache`` (the KV cache's layout and size), ``programs`` (the sharded prefill and decode
step, sampling, their executables), ``inputs`` (sampling settings, prompts, padding) and ``streaming``
(text decoding, stop strings, results). ``Generator`` ties them together.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshlm.data.tokenizer import EOD
from meshlm.errors import ConfigError
from meshlm.generate.cache import cache_bytes
from meshlm.generate.inputs import (
    Sampling,
    check_budget,
    check_stops,
    check_teacher_forced,
    encode_prompt,
    next_doc_starts,
    pad_prompts,
    prompt_doc_starts,
)
from meshlm.generate.programs import DECODE_CHUNK, KINDS, kinds_for, programs_for, slots_for
from meshlm.generate.streaming import (
    ByteTokenizer,
    GenerationResult,
    OnToken,
    OutputRow,
    make_stream,
    push_steps,
    push_tokens,
)
from meshlm.model.config import ModelConfig
from meshlm.parallel.layout import Layout
from meshlm.parallel.placement import to_host
from meshlm.settings import dispatch_for
from meshlm.sharding.rules import model_specs, shardings


def as_run_here(cfg: ModelConfig) -> ModelConfig:
    """A loaded checkpoint's config as it runs on this backend: its mixture of experts' dispatch is
    "auto"'s (``settings.dispatch_for``: ragged_dot on TPU and GPU, blocks on CPU), whatever the
    saved config says ("blocks", or nothing before the field): the dispatch is not a model fact."""
    return cfg.replace(moe_dispatch=dispatch_for("auto", jax.default_backend()))


class Generator:
    """Sharded KV-cached generation for a model ``cfg`` with ``params`` on ``where``: a Layout or a jax
    Mesh (axes dp, mp; generation keeps whole weights: a layout's memory options do not apply).
    ``max_len``: prompt + new tokens must fit in it (default ``cfg.max_seq_len``); the cache holds
    ``slots`` = max_len rounded up to ``programs.SLOT_TILE`` (``slots_for``: XLA:TPU's tiles).
    ``tokenizer``: ``encode(str) -> ids`` / ``decode(ids) -> str`` (default: bytes). ``eod``: the id(s)
    ending generation (default: the tokenizer's ``eod_id``; a list: any; None: none). Compiled
    programs are shared by Generators of the same config, mesh, max_len, parameter dtypes and chunk.
    ``prefill_cp``: prefill over the layout's cp axis, decode without it (``programs.check_prefill_cp``).
    ``chunk``: decode steps a program (default ``DECODE_CHUNK``); 0 runs one step a program with the
    host between steps (the single steps chunks are checked against, ``_single_steps``).
    """

    def __init__(
        self,
        cfg,
        params,
        where,
        *,
        max_len=None,
        tokenizer=None,
        eod="tokenizer",
        prefill_cp=False,
        chunk=DECODE_CHUNK,
    ):
        self.cfg, self.layout = cfg, Layout.of(where, fsdp=False, sp=False)
        self.mesh, self.dp, self.prefill_cp = self.layout.mesh, self.layout.dp, bool(prefill_cp)
        self.tokenizer = tokenizer = tokenizer or ByteTokenizer()
        self.eod = getattr(tokenizer, "eod_id", EOD) if eod == "tokenizer" else eod
        self.max_len = cfg.max_seq_len if max_len is None else int(max_len)
        if not 1 <= self.max_len <= cfg.max_seq_len:
            raise ConfigError(f"max_len={max_len} must be in [1, max_seq_len={cfg.max_seq_len}]")
        self.chunk = chunk  # checked by ``programs_for``
        specs = model_specs(cfg, params, self.layout)
        self.params = jax.device_put(params, shardings(specs, self.mesh))  # a no-op when already laid out
        self.slots = slots_for(cfg, self.max_len, self.prefill_cp)  # the cache's S: prompts padded to it
        self._prog = programs_for(cfg, self.layout, specs, self.slots, self.params, self.prefill_cp, chunk)
        self._last_constants: tuple = (None, None)

    @property
    def compilations(self) -> int:
        """Executables built so far for this model and chunk length: up to three per batch size (prefill,
        a chunk of decode steps, one step: each when first needed), never per length or step."""
        return sum(map(len, self._prog.by_batch.values()))

    def _put(self, x, spec):
        return jax.device_put(x, NamedSharding(self.mesh, spec))

    def _executables(self, batch: int, kinds=KINDS) -> dict:
        return self._prog.executables(self.params, batch, kinds)

    def _constants(self, sampling: Sampling, batch: int) -> tuple:
        """(rows, key, sampling) on device for this call: placed once per generate, not per step."""
        if self._last_constants[0] != (sampling, batch):
            rows = self._put(np.arange(batch, dtype=np.int32), self.layout.spec("batch"))
            key = self._put(jax.random.PRNGKey(sampling.seed), P())
            self._last_constants = ((sampling, batch), (rows, key, self._put(sampling.args(), P())))
        return self._last_constants[1]

    def prefill(self, tokens: np.ndarray, lengths: np.ndarray, sampling: Sampling):
        """tokens [B, S] right-padded host ids, lengths [B] -> device (next [B], logits [B, V], cache)."""
        rows, key, settings = self._constants(sampling, tokens.shape[0])
        tokens_d = self._put(tokens.astype(np.int32), self.layout.spec("batch", None))
        lengths_d = self._put(lengths.astype(np.int32), self.layout.spec("batch"))
        run = self._executables(tokens.shape[0], ("prefill",))["prefill"]
        return run(self.params, tokens_d, lengths_d, rows, key, settings)

    def decode_step(self, tokens, positions, cache, sampling: Sampling, step: int, starts, kind="decode"):
        """tokens, positions, doc starts [B] host ids -> device (next [B], logits [B, V], cache: donated);
        ``kind`` "chunk": ``chunk`` steps from there -> (tokens [B, chunk], the next chunk's state:
        ``decode_chunk``)."""
        put = lambda x: self._put(np.asarray(x, np.int32), self.layout.spec("batch"))
        at = positions if kind == "chunk" else np.minimum(positions, self.max_len - 1)  # chunk: clamps inside
        state = (put(tokens), put(at), cache, put(starts), self._put(np.int32(step), P()))
        return self._run(kind, sampling, state)

    def decode_chunk(self, sampling: Sampling, state):
        """A chunk from the device ``state`` (tokens, positions, cache: donated, starts, step) the chunk
        before returned: (tokens [B, chunk], the next state), with no host value in between."""
        return self._run("chunk", sampling, state)

    def _run(self, kind: str, sampling: Sampling, state):
        tokens, at, cache, starts, step = state
        rows, key, settings = self._constants(sampling, tokens.shape[0])
        run = self._executables(tokens.shape[0], (kind,))[kind]
        return run(self.params, tokens, at, rows, cache, key, step, settings, starts)

    def encode_prompt(self, index: int, prompt) -> np.ndarray:
        return encode_prompt(self.tokenizer, self.cfg.vocab_size, index, prompt)

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
        """Continue every prompt (one batch); see ``programs`` for sampling, ``streaming`` for stopping."""
        sampling = Sampling(float(temperature), int(top_k), float(top_p), int(seed))
        sampling.check()
        ids = [self.encode_prompt(i, p) for i, p in enumerate(prompts)]
        check_budget(ids, max_new_tokens, self.max_len)
        stops = check_stops(stop)
        rows = [OutputRow(i, make_stream(self.tokenizer), stops, self.eod, on_token) for i in range(len(ids))]
        tokens, lengths = pad_prompts(ids, self.dp, self.slots)  # global [B', S], [B']
        self._executables(len(tokens), kinds_for(max_new_tokens, self.chunk))  # compiled before the timing
        t0 = time.perf_counter()
        nxt, _, cache = self.prefill(tokens, lengths, sampling)
        nxt = to_host(nxt)
        t1 = time.perf_counter()
        push_tokens(rows, nxt, max_new_tokens == 1)
        starts = prompt_doc_starts(tokens, lengths, self.cfg.doc_mask)
        decoded = _decode(self, rows, (nxt, lengths, cache, starts), sampling, max_new_tokens)
        t2 = time.perf_counter()
        rates = (sum(map(len, ids)) / (t1 - t0), decoded / (t2 - t1) if decoded else 0.0)
        return [r.result(p, rates) for p, r in zip(prompts, rows, strict=True)]


def logits_with_cache(gen: Generator, tokens, lengths) -> list[np.ndarray]:
    """Teacher-forced cached logits of ``gen``. Row b is prefilled with tokens[b, :lengths[b]], then fed
    tokens[b, t] one decode step at a time. Returns per row [T - lengths[b] + 1, V] float32: the
    next-token logits at positions lengths[b] - 1 ... T - 1 (a full forward's logits there)."""
    tokens, lengths = check_teacher_forced(tokens, lengths, gen.cfg.vocab_size, gen.max_len)
    t = tokens.shape[1]
    ids = [gen.encode_prompt(b, tokens[b, :n]) for b, n in enumerate(lengths)]
    padded, lens = pad_prompts(ids, gen.dp, gen.slots)  # global [B', S], [B']
    feed = np.zeros_like(padded)
    feed[: len(ids), :t] = tokens
    greedy = Sampling()
    _, logits, cache = gen.prefill(padded, lens, greedy)
    out, starts = [to_host(logits)], prompt_doc_starts(padded, lens, gen.cfg.doc_mask)
    for j in range(t - int(lengths.min())):
        pos = np.minimum(lens + j, gen.max_len - 1)
        fed = feed[np.arange(len(pos)), pos]
        starts = next_doc_starts(starts, fed, pos, gen.cfg.doc_mask)
        _, logits, cache = gen.decode_step(fed, pos, cache, greedy, j + 1, starts)
        out.append(to_host(logits))
    stacked = np.stack(out, axis=1)  # [B', steps + 1, V]
    return [stacked[b, : t - n + 1] for b, n in enumerate(lengths)]


def _decode(gen: Generator, rows: list[OutputRow], state: tuple, sampling: Sampling, max_new: int) -> int:
    """The decode steps after the prefill until ``max_new`` tokens or every row stopped, in chunks of
    ``gen.chunk`` steps (``_single_steps`` where it is 0): chunk i + 1 is dispatched from chunk i's
    device outputs before the host reads chunk i's tokens, so the device runs chunk after chunk while
    the host streams; the last chunk's steps past ``max_new`` are dropped, and so is the chunk after
    the one where every row stopped. ``state``: (the prefill's tokens [B'] on the host, the prompt
    lengths [B'], the cache, the doc starts [B']). Returns the tokens pushed to running rows."""
    if gen.chunk == 0:
        return _single_steps(gen, rows, state, sampling, max_new)
    steps, decoded = 1, 0
    for out in chunk_tokens(gen, state, sampling, -(-(max_new - 1) // gen.chunk)):
        steps, pushed = push_steps(rows, out, steps, max_new)  # [B', chunk]
        decoded += pushed
        if not any(r.finish is None for r in rows):
            break
    return decoded


def chunk_tokens(gen: Generator, state: tuple, sampling: Sampling, chunks: int):
    """Yields the host tokens [B', chunk] of ``chunks`` chunks after a prefill's ``state`` (``_decode``'s):
    chunk i + 1 is dispatched from chunk i's device outputs before chunk i is read (the device runs
    chunk after chunk while the host works); a caller that stops early drops the one queued."""
    nxt, lengths, cache, starts = state
    if chunks:
        running = gen.decode_step(nxt, lengths, cache, sampling, 1, starts, "chunk")
    for i in range(chunks):
        out, after = running
        if i + 1 < chunks:
            running = gen.decode_chunk(sampling, after)  # queued behind this chunk, before its read
        yield to_host(out)


def _single_steps(gen: Generator, rows: list[OutputRow], state: tuple, sampling: Sampling, max_new: int):
    """``_decode`` one step a program, the host between steps (its tokens, positions and document
    starts: ``inputs.next_doc_starts``): what chunks are checked against."""
    nxt, lengths, cache, starts = state
    steps, decoded = 1, 0
    while steps < max_new and any(r.finish is None for r in rows):
        at = lengths + steps - 1  # the fed token's position
        starts = next_doc_starts(starts, nxt, at, gen.cfg.doc_mask)
        out, _, cache = gen.decode_step(nxt, at, cache, sampling, steps, starts)
        out = to_host(out)[:, None]
        steps, pushed = push_steps(rows, out, steps, max_new)
        nxt, decoded = out[:, -1], decoded + pushed
    return decoded


def in_dtype(params, dtype):
    """``params`` with every floating leaf cast to ``dtype`` (``generate --bf16``: bf16 weights, and so a
    bf16 KV cache, the cache taking the embedding's dtype: half the bytes a decode step reads); integer
    leaves as they are. Norms, the router and the logits compute in at least float32 all the same
    (``model.layers.upcast``)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def cache_memory(gen: Generator, batch: int) -> dict:
    """The decode KV cache of ``gen`` for a global ``batch`` of prompts: {"slots" (positions held per
    layer: the window for a rolling cache), "total", "per_device" (bytes, K and V)}."""
    b = -(-batch // gen.dp) * gen.dp  # rows padded to a multiple of dp, as ``pad_prompts``
    return cache_bytes(gen.cfg, gen.layout, b, gen.slots, gen.params["embed"]["embeddings"].dtype)


def bench_generation(cfg: ModelConfig, params, where, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """Throughput of ``batch`` random prompts of ``prompt_len`` tokens, ``new_tokens`` each, with the
    cache sized to exactly prompt_len + new_tokens (prefill runs over all of it: fixed shapes). A first
    short run compiles and warms up outside the timing the programs the timed run needs (``kinds_for``:
    the prefill and the chunk). Never stops early (no EOD)."""
    gen = Generator(cfg, params, where, max_len=prompt_len + new_tokens, eod=None)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, prompt_len).tolist() for _ in range(batch)]
    gen.generate(prompts, min(2 * gen.chunk + 1, new_tokens))  # warm: the prefill, two chunks
    r = gen.generate(prompts, new_tokens)[0]
    params = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(gen.params))
    return {
        "prefill_tokens_per_s": r.prefill_tokens_per_s,
        "decode_tokens_per_s": r.decode_tokens_per_s,
        # What one decode step must read from memory on each device: its parameters and its whole KV
        # cache (every slot is attended to; the cache sized to prompt + new tokens): the roofline's bytes.
        "decode_bytes_per_device": params + cache_memory(gen, batch)["per_device"],
    }
