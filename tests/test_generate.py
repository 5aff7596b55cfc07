"""Generation: cached logits == full forward on every mesh, greedy == unsharded, sampling, stopping,
compile counts, the cache layout, bad inputs and the CLI.

Programs are compiled once per (config, mesh, batch size) and shared by every Generator of that
model, so most tests reuse the batch-of-2 executables the first test builds.
"""

import functools
import json

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_cli
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshlm.data.tokenizer import EOD
from meshlm.errors import ConfigError, GenerationError, TokenRangeError
from meshlm.generate import generator as generator_module
from meshlm.generate.cache import cache_bytes
from meshlm.generate.generator import Generator, bench_generation, logits_with_cache
from meshlm.generate.inputs import Sampling, read_prompt_file
from meshlm.generate.programs import kinds_for, sample
from meshlm.generate.streaming import ByteStream, ByteTokenizer, DiffStream, OutputRow
from meshlm.io.model_io import save_model
from meshlm.model.config import get_config
from meshlm.model.padding import resize_tree
from meshlm.model.transformer import logits_fn, loss_fn
from meshlm.parallel.context import Parallel
from meshlm.parallel.mesh import make_mesh

MESHES = {"tiny-gptj": [(1, 1), (1, 4), (2, 2)], "tiny-llama": [(1, 1), (1, 4), (2, 2), (1, 8)]}
# Two tiers: each preset on 2x2 (tiny: 1x4) quick; the other meshes slow, the same cached decode (scale).
QUICK = {("tiny-gptj", (2, 2)), ("tiny-llama", (2, 2)), ("tiny", (1, 4))}
CASES = [(n, m) for n, ms in MESHES.items() for m in ms] + [("tiny", (1, 1)), ("tiny", (1, 4))]
CASES = [c if c in QUICK else pytest.param(*c, marks=pytest.mark.slow) for c in CASES]
TOKENS = np.random.default_rng(1).integers(1, 64, (2, 20))  # teacher-forced rows
LENGTHS = np.array([3, 11])  # their prefill lengths: one batch, two different lengths
PROMPTS = [[5, 17, 33], [40, 2, 9, 61, 12, 7, 30, 44, 8, 3, 19]]
NEW = 12


@functools.cache
def host_params(name, scale: float = 0.35) -> dict:
    """Random parameters without init_model's compile (seconds per preset on 2 cores) of a preset (its
    name) or a ModelConfig. ``scale`` is large enough that greedy decoding does not collapse into one
    repeated token."""
    cfg = get_config(name) if isinstance(name, str) else name
    example = {k: jnp.zeros((1, 8), jnp.int32) for k in ("inputs", "targets")}
    unpadded = loss_fn(cfg.replace(vocab_multiple=1), Parallel())  # drawn unpadded, then zero-padded
    shapes = jax.eval_shape(hk.transform(unpadded).init, jax.random.PRNGKey(0), example)
    rng = np.random.default_rng(0)

    def leaf(path, s):
        base = 1.0 if path[-1].key == "scale" else 0.0
        return (base + scale * rng.standard_normal(s.shape)).astype(np.float32)

    return resize_tree(jax.tree_util.tree_map_with_path(leaf, shapes), cfg.padded_vocab)


@functools.cache
def generator(name: str, dp: int, mp: int) -> Generator:
    return Generator(get_config(name), host_params(name), make_mesh(dp, mp))


@functools.cache
def _reference(name: str):
    return jax.jit(hk.without_apply_rng(hk.transform(logits_fn(get_config(name), Parallel()))).apply)


def full_logits(name: str, tokens) -> np.ndarray:
    """The unsharded model's logits [B, T, V] with no cache (plain jit, one device)."""
    return np.asarray(_reference(name)(host_params(name), np.asarray(tokens, np.int32)))


def reference_greedy(name: str, prompts, n: int) -> list[list[int]]:
    """Greedy by full recomputation at a fixed padded length, cut after an EOD like generate."""
    s = get_config(name).max_seq_len
    seqs = [list(p) for p in prompts]
    for _ in range(n):
        padded = np.array([q + [0] * (s - len(q)) for q in seqs])
        logits = full_logits(name, padded)
        for b, q in enumerate(seqs):
            q.append(int(np.argmax(logits[b, len(q) - 1])))
    out = [q[len(p) :] for q, p in zip(seqs, prompts, strict=True)]
    return [t[: t.index(EOD) + 1] if EOD in t else t for t in out]


def tokens_of(results) -> list[list[int]]:
    return [r.tokens for r in results]


@pytest.mark.parametrize(
    ("name", "mesh"), CASES, ids=lambda v: f"{v[0]}x{v[1]}" if isinstance(v, tuple) else v
)
def test_cached_logits_and_greedy_equal_unsharded(name, mesh):
    gen = generator(name, *mesh)
    got = logits_with_cache(gen, TOKENS, LENGTHS)
    ref = full_logits(name, TOKENS)
    for b, n in enumerate(LENGTHS):
        # float32: a [B, 1] step and a [B, T] forward sum in different orders, so the bound is relative
        # to the logits' scale (|logits| reaches ~50 here), like proof.py's normwise measure.
        want = ref[b, n - 1 :]
        np.testing.assert_allclose(got[b], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert tokens_of(gen.generate(PROMPTS, NEW)) == reference_greedy(name, PROMPTS, NEW)


def test_rows_of_different_lengths_equal_each_prompt_alone():
    gen = generator("tiny-gptj", 1, 1)
    together = tokens_of(gen.generate(PROMPTS, NEW))
    assert together == [gen.generate([p], NEW)[0].tokens for p in PROMPTS]
    assert len(set(map(tuple, together))) == 2 and all(len(set(t)) > 3 for t in together)  # not degenerate


def test_sampling_is_seeded_mesh_independent_and_top_k_1_is_greedy():
    gen, sharded = generator("tiny-gptj", 1, 1), generator("tiny-gptj", 2, 2)
    kw = dict(temperature=1.0, top_k=20, top_p=0.95)
    a = tokens_of(gen.generate(PROMPTS, NEW, seed=1, **kw))
    assert a == tokens_of(gen.generate(PROMPTS, NEW, seed=1, **kw))
    assert a == tokens_of(sharded.generate(PROMPTS, NEW, seed=1, **kw))
    assert a != tokens_of(gen.generate(PROMPTS, NEW, seed=2, **kw))
    greedy = tokens_of(gen.generate(PROMPTS, NEW))
    assert greedy != a
    assert tokens_of(gen.generate(PROMPTS, NEW, temperature=1.5, top_k=1, seed=3)) == greedy
    assert tokens_of(gen.generate(PROMPTS, NEW, temperature=1.5, top_p=1e-6, seed=4)) == greedy


def test_sample_respects_top_k_top_p_and_temperature():
    probs = np.array([0.5, 0.3, 0.15, 0.05], np.float32)
    logits = np.broadcast_to(np.log(probs), (4000, 4))
    rows = np.arange(4000)
    draw = jax.jit(sample)

    def freq(t, k, p):
        out = np.asarray(draw(logits, jax.random.PRNGKey(0), rows, 1, Sampling(t, k, p).args()))
        return np.bincount(out, minlength=4) / len(out)

    np.testing.assert_allclose(freq(1.0, 0, 1.0), probs, atol=0.03)
    np.testing.assert_allclose(freq(1.0, 2, 1.0), [0.625, 0.375, 0, 0], atol=0.03)
    np.testing.assert_allclose(freq(1.0, 0, 0.7), [0.625, 0.375, 0, 0], atol=0.03)
    np.testing.assert_allclose(freq(1.0, 0, 0.81), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0], atol=0.03)
    assert freq(0.0, 0, 1.0)[0] == 1.0
    assert freq(1e-3, 0, 1.0)[0] == 1.0


def test_stop_string_eod_and_streaming():
    gen = generator("tiny-gptj", 1, 1)
    full = gen.generate(PROMPTS, NEW)[0]
    assert full.finish_reason == "length" and len(full.tokens) == NEW
    stop = full.text[5:7]
    cut = full.text.find(stop)
    pieces: dict[int, list] = {0: [], 1: []}
    streamed: dict[int, list] = {0: [], 1: []}

    def on_token(i, token, piece):
        streamed[i].append(token)
        pieces[i].append(piece)

    out = gen.generate(PROMPTS, NEW, stop=[stop, "never\x01"], on_token=on_token)
    assert out[0].text == full.text[:cut] and out[0].finish_reason == "stop"
    assert out[0].tokens == full.tokens[: cut + len(stop)]  # one byte per token: through the stop
    for i in (0, 1):
        assert "".join(pieces[i]) == out[i].text and streamed[i] == out[i].tokens
    head = {**host_params("tiny-gptj")["head"], "b": np.eye(128, dtype=np.float32)[EOD] * 1e3}
    params = {**host_params("tiny-gptj"), "head": head}
    eod = Generator(get_config("tiny-gptj"), params, make_mesh(1, 1)).generate(PROMPTS, NEW)
    assert [(r.tokens, r.text, r.finish_reason) for r in eod] == [([EOD], "", "eod")] * 2


def test_stream_decodes_utf8_incrementally_and_holds_back_stop_prefixes():
    def run(data: bytes, stops=(), stream=ByteStream):
        pieces = []
        row = OutputRow(0, stream(), stops, EOD, lambda i, t, p: pieces.append(p))
        for i, b in enumerate(data):
            if row.finish is None:
                row.push(b, i == len(data) - 1)
        return row, pieces

    text = "héllo ✓ wörld €"
    row, pieces = run(text.encode())
    assert "".join(pieces) == row.text == text and all("\ufffd" not in p for p in pieces)
    assert pieces[1:3] == ["", "é"]  # two bytes, one character once both arrived
    diff = run(text.encode(), stream=lambda: DiffStream(ByteTokenizer()))[1]  # any-tokenizer path
    assert diff == pieces
    row, pieces = run(b"ab STxSTOP cd", ("STOP",))
    assert "".join(pieces) == row.text == "ab STx" and row.finish == "stop"
    assert pieces[3:6] == ["", "", "STx"]  # "S", "ST" could begin STOP: held back until "x"
    row, pieces = run(b"hi\0")
    assert (row.text, row.ids, row.finish) == ("hi", [104, 105, 0], "eod")


def test_a_generation_compiles_only_the_programs_it_runs():
    """Before its timing a generation compiles what its decode schedule runs (``programs.kinds_for``):
    one new token needs no decode program, more a chunk (its steps past the last token dropped) and no
    single step; single steps (chunk 0) no chunk. Each chunk length its own programs, whose chunk
    program returns that many tokens a row."""
    gen = generator("tiny-llama", 2, 2)
    prompts = [[1, 2, 3]] * 6  # a batch size no other test here generates: its programs are new
    gen.generate(prompts, 1)
    assert set(gen._prog.by_batch[6]) == {"prefill"}
    gen.generate(prompts, 3)  # 2 decode steps: one chunk, its other steps dropped
    assert set(gen._prog.by_batch[6]) == {"prefill", "chunk"}
    assert kinds_for(9) == ("prefill", "chunk") and kinds_for(1) == ("prefill",)
    assert kinds_for(9, chunk=0) == ("prefill", "decode")
    cfg, params, mesh = get_config("tiny-llama"), host_params("tiny-llama"), make_mesh(2, 2)
    for chunk in (0, 3):
        other = Generator(cfg, params, mesh, chunk=chunk)
        assert other._prog is not gen._prog and other._prog.chunk == chunk
        other.generate(prompts, 5)
        want = {"prefill", "chunk" if chunk else "decode"}
        assert set(other._prog.by_batch[6]) == want
    out = other._executables(6, ("chunk",))["chunk"].out_info[0]  # chunk 3: tokens [B, 3]
    assert out.shape == (6, 3)
    for bad in (-1, 2.5, True):  # one line before any compile
        with pytest.raises(ConfigError, match="whole number >= 0"):
            Generator(cfg, params, mesh, chunk=bad)


def test_no_compilation_per_token_or_prompt_length():
    gen = generator("tiny-llama", 2, 2)
    gen.generate(PROMPTS, 20)  # compiled and warm
    before = gen.compilations
    compiles = []

    def listener(event, duration, **kwargs):
        # Tracing counts too: with conftest's persistent cache a recompilation may skip the backend.
        if event.startswith("/jax/core/compile/"):
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for prompts in ([[1, 2, 3], [4] * 9], [[7] * 30, [9]], [[3] * 44, [5] * 17]):
            out = gen.generate(prompts, 20, temperature=0.8, top_k=5, seed=len(prompts[0]))
            assert sum(map(len, tokens_of(out))) > 20
        # shared by all Generators (other tests' programs among them): a prefill and a chunk here
        assert compiles == [] and gen.compilations == before
        assert {"prefill", "chunk"} <= set(gen._prog.by_batch[2])
        jax.jit(lambda x: x + 1)(np.ones(3))  # control: the listener does see a compilation
        assert compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


# the greedy cell slow: the sampled one (quick) also fails on a chunk's wrong step key or document start
@pytest.mark.parametrize(
    "sampled,bf16",
    [pytest.param(False, False, marks=pytest.mark.slow), (True, False), (True, True)],
    ids=["greedy", "sampled", "sampled-bf16"],
)
def test_chunked_decode_draws_the_tokens_of_single_steps(sampled, bf16):
    """Generation runs chunks of steps, each dispatched from the chunk before's device outputs: the same
    tokens, row for row, as single steps (``chunk=0``: the host loop of ``decode_step``), greedy and
    sampled (each step's key from its index), with the document mask moving at an EOD a chunk feeds,
    a row that stops mid-chunk (its stop string) keeping only its tokens up to there, and the last
    chunk's steps past the new tokens dropped. ``bf16``: ``generate --bf16``'s weights (and so its bf16
    KV cache)."""
    cfg = get_config("tiny-llama")
    params, mesh = host_params("tiny-llama"), make_mesh(2, 2)
    if bf16:
        params = generator_module.in_dtype(params, jnp.bfloat16)
        gen = Generator(cfg, params, mesh)
        half = generator_module.cache_memory(gen, 2)["per_device"]
        assert (
            gen._prog.cache_dtype == jnp.bfloat16
            and 2 * half == cache_bytes(cfg, mesh, 2, gen.max_len)["per_device"]
        )
    kw = dict(temperature=0.9, top_k=20, seed=3) if sampled else {}
    new = 2 * generator_module.DECODE_CHUNK + 3  # three chunks, the last one's 6 steps dropped
    free = Generator(cfg, params, mesh, eod=None).generate(PROMPTS, new, **kw)
    eod = tokens_of(free)[0][5]  # a token row 0 feeds inside the first chunk: a document boundary
    stop = bytes([tokens_of(free)[1][10]]).decode("latin-1")  # row 1 stops inside the second chunk

    def run(chunk=generator_module.DECODE_CHUNK):
        gen = Generator(cfg.replace(doc_mask=eod), params, mesh, eod=None, chunk=chunk)
        return gen.generate(PROMPTS, new, stop=stop, **kw)

    chunked, single = run(), run(chunk=0)
    assert [(r.tokens, r.text, r.finish_reason) for r in chunked] == [
        (r.tokens, r.text, r.finish_reason) for r in single
    ]
    assert any(r.finish_reason == "stop" for r in single) and tokens_of(single) != tokens_of(
        free
    )  # both bite


def test_cache_is_sharded_by_kv_heads():
    cfg, gen = get_config("tiny-gptj"), generator("tiny-gptj", 1, 4)
    tokens = np.zeros((2, 64), np.int32)
    _, _, cache = gen.prefill(tokens, np.array([3, 5]), Sampling())
    k = cache["k"]  # flat [L, B, S, Kc * E] (``generate.cache``): 8 KV heads of 8, 2 a shard
    assert k.shape == (2, 2, 64, 8 * 8)
    assert k.sharding.is_equivalent_to(NamedSharding(gen.mesh, P(None, "dp", None, "mp")), k.ndim)
    assert k.addressable_shards[0].data.shape == (2, 2, 64, 2 * 8)
    assert cache_bytes(cfg, gen.mesh, 2, 64)["per_device"] == 2 * k.nbytes // 4
    # Replicated KV heads (mp=8 > 4): each shard stores the one KV head its queries use.
    padded = np.zeros((2, 64), np.int32)
    padded[:, :20] = TOKENS
    _, _, c8 = generator("tiny-llama", 1, 8).prefill(padded, LENGTHS, Sampling())
    _, _, c1 = generator("tiny-llama", 1, 1).prefill(padded, LENGTHS, Sampling())
    e = get_config("tiny-llama").dim_per_head
    assert c8["k"].shape[3] == 8 * e and c1["k"].shape[3] == 4 * e
    for shard in c8["v"].addressable_shards:
        i = shard.index[3].start // e  # shard i holds KV head i // 2 (two query-head groups per KV head)
        want = np.asarray(c1["v"])[:, :, :, (i // 2) * e : (i // 2 + 1) * e]
        np.testing.assert_allclose(shard.data, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_bad_inputs_are_clear_errors(tmp_path):
    gen = generator("tiny-gptj", 1, 1)
    cases = [
        (([[1] * 65], 1), GenerationError, "longer than the context of 64"),
        (([[1] * 60], 5), GenerationError, "exceeds the context of 64.*max_new_tokens <= 4"),
        ((["", "1"], 3), GenerationError, "prompt 0 is empty"),
        (([[1], []], 3), GenerationError, "prompt 1 is empty"),
        (([[1, 64]], 3), TokenRangeError, "token id 64 at position"),
        ((["A"], 3), TokenRangeError, "token id 65"),  # 'A' is byte 65, outside tiny's 64 ids
        (([[1]], 0), GenerationError, "max_new_tokens must be"),
        (([], 3), GenerationError, "no prompts"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            gen.generate(*args)
    for kw, message in [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"stop": [""]}, "stop strings"),
    ]:
        with pytest.raises(GenerationError, match=message):
            gen.generate([[1]], 3, **kw)
    with pytest.raises(ConfigError, match="max_len=65"):
        Generator(get_config("tiny-gptj"), host_params("tiny-gptj"), make_mesh(1, 1), max_len=65)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"abc\xffdef")
    with pytest.raises(GenerationError, match=r"bad\.txt is not UTF-8: byte offset 3 \(0xff\)"):
        read_prompt_file(bad)


def test_cli_json_stream_and_missing_checkpoint(tmp_path, capsys):
    gen = generator("tiny-gptj", 1, 1)
    save_model(tmp_path / "run", gen.cfg, gen.params, step=7)
    common = ["generate", "--mesh", "1x1", "--max-new-tokens", "6", "--checkpoint"]
    assert run_cli(*common, str(tmp_path / "run"), "--prompt", "012", "--prompt", "3", "--json") == 0
    out = json.loads(capsys.readouterr().out)
    expect = gen.generate(["012", "3"], 6)
    assert [o["tokens"] for o in out] == tokens_of(expect) and out[1]["prompt"] == "3"
    assert {"prompt", "tokens", "text", "prefill_tokens_per_s", "decode_tokens_per_s"} <= set(out[0])
    (tmp_path / "p.txt").write_text("3")
    assert run_cli(*common, str(tmp_path / "run" / "7"), "--prompt-file", str(tmp_path / "p.txt")) == 0
    assert capsys.readouterr().out == "3" + expect[1].text + "\n"
    assert run_cli(*common, str(tmp_path), "--prompt", "1") == 2
    assert "no checkpoint" in capsys.readouterr().err
    # --bf16: the weights cast, so the KV cache bf16 too (half the bytes), the tokens bf16 weights' own
    assert run_cli(*common, str(tmp_path / "run"), "--prompt", "012", "--json", "--bf16") == 0
    half = json.loads(capsys.readouterr().out)
    bf16 = Generator(gen.cfg, generator_module.in_dtype(gen.params, jnp.bfloat16), gen.mesh)
    assert half["tokens"] == tokens_of(bf16.generate(["012"], 6))[0]
    assert 2 * 2 * half["kv_cache"]["total"] == out[0]["kv_cache"]["total"]  # 1 row, not 2; 2 bytes, not 4


def test_bench_generation_reports_throughput():
    cfg, gen = get_config("tiny-gptj"), generator("tiny-gptj", 1, 1)
    out = bench_generation(cfg, gen.params, gen.mesh, batch=2, prompt_len=54, new_tokens=10)
    assert set(out) == {"prefill_tokens_per_s", "decode_tokens_per_s", "decode_bytes_per_device"}
    assert min(out.values()) > 0
    # what a decode step reads on the one device: every parameter and the whole cache (64 slots a row)
    weights = sum(x.nbytes for x in jax.tree.leaves(gen.params))
    assert out["decode_bytes_per_device"] == weights + cache_bytes(cfg, gen.mesh, 2, 64)["per_device"]


# Exactly the tiny-gptj / tiny-llama presets, so these reuse the programs compiled above.
HF_PRESETS = {
    "tiny-gptj": lambda t: t.GPTJConfig(
        vocab_size=64, n_embd=64, n_layer=2, n_inner=256, n_head=8, rotary_dim=4, n_positions=64
    ),
    "tiny-llama": lambda t: t.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=8,
        num_key_value_heads=4,  # grouped-query attention; replicated over mp=8
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
    ),
}


@pytest.mark.parametrize(("name", "mesh"), [("tiny-gptj", (1, 4)), ("tiny-llama", (1, 8))])
def test_greedy_equals_transformers_generate(name, mesh, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from meshlm.io.hf_weights import load_hf
    from meshlm.model.params import unflatten

    torch.manual_seed(0)
    hf_cfg = HF_PRESETS[name](transformers)
    hf_cfg.initializer_range = 0.3  # peaked logits: greedy is neither degenerate nor near a tie
    model = getattr(transformers, {"tiny-gptj": "GPTJForCausalLM"}.get(name, "LlamaForCausalLM"))(hf_cfg)
    model.save_pretrained(tmp_path)
    cfg, flat = load_hf(tmp_path)
    assert cfg == get_config(name)
    ours = Generator(cfg, unflatten(flat), make_mesh(*mesh), eod=None).generate(PROMPTS, NEW)
    model.generation_config.eos_token_id = None  # stop on length only, like eod=None
    for prompt, got in zip(PROMPTS, ours, strict=True):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        assert got.tokens == out[0, len(prompt) :].tolist() and len(set(got.tokens)) > 3


def test_cli_generate_uses_the_requested_devices(tmp_path):
    """`generate` reads prompts (importing JAX) before setting up devices: --devices must still apply."""
    import subprocess
    import sys

    from meshlm.io.model_io import save_model
    from meshlm.model.config import get_config
    from meshlm.parallel.mesh import make_mesh
    from meshlm.train.step import init_model

    cfg = get_config("tiny-lm")
    save_model(tmp_path / "ckpt", cfg, init_model(cfg, make_mesh(1, 1), 0)[0])
    argv = [
        sys.executable,
        "-m",
        "meshlm",
        "generate",
        "--checkpoint",
        str(tmp_path / "ckpt"),
        "--prompt",
        "ab",
        "--max-new-tokens",
        "4",
        "--devices",
        "4",
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "mesh 1x4" in out.stderr + out.stdout, out.stderr[-2000:]


def test_doc_mask_cached_decode_masks_the_prompts_documents(monkeypatch):
    """A --doc-mask model: with EODs inside the prompt and among the fed tokens, the cached logits and
    greedy decode equal the uncached masked forward (attention and positions restart at each EOD);
    the planted bug, decode steps that ignore the prompt's EOD (documents all start at 0), is caught."""
    cfg = get_config("tiny-llama").replace(doc_mask=EOD)
    gen = Generator(cfg, host_params("tiny-llama"), make_mesh(2, 2))
    ref = jax.jit(hk.without_apply_rng(hk.transform(logits_fn(cfg, Parallel()))).apply)
    full = lambda tokens: np.asarray(ref(host_params("tiny-llama"), np.asarray(tokens, np.int32)))
    tokens = TOKENS.copy()
    tokens[0, [1, 8]] = tokens[1, [4, 15]] = EOD  # in each prompt (lengths 3, 11), and fed later

    def cached_error(gen) -> float:
        got, want = logits_with_cache(gen, tokens, LENGTHS), full(tokens)
        return max(
            np.abs(g - want[b, n - 1 :]).max() / np.abs(want).max()
            for b, (g, n) in enumerate(zip(got, LENGTHS, strict=True))
        )

    assert cached_error(gen) <= 1e-5
    prompts = [p[:n] for p, n in zip(tokens.tolist(), LENGTHS, strict=True)]
    seqs = [list(p) for p in prompts]  # greedy by full recomputation, the masked model
    for _ in range(NEW):
        logits = full([q + [1] * (cfg.max_seq_len - len(q)) for q in seqs])
        seqs = [q + [int(np.argmax(logits[b, len(q) - 1]))] for b, q in enumerate(seqs)]
    want = [q[len(p) :] for q, p in zip(seqs, prompts, strict=True)]
    want = [t[: t.index(EOD) + 1] if EOD in t else t for t in want]
    assert tokens_of(gen.generate(prompts, NEW)) == want
    monkeypatch.setattr(generator_module, "prompt_doc_starts", lambda tokens, *_: np.zeros(len(tokens), int))
    assert cached_error(gen) > 1e-3  # the planted bug: a decode step attends across the prompt's EOD
