"""Prefill over cp (``Generator(prefill_cp=True)``, ``meshlm generate --cp N``): each cp shard prefills
its two load-balanced chunks of the padded prompts, the K/V cache comes back whole and in sequence
order on every cp shard, and the decode runs without cp. Proven against generation without cp:
teacher-forced cached logits (the prefill's last-position logits, then every decode step's) equal in
float64, and the greedy tokens the same, through the library and the CLI."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_cli
from test_generate import host_params

from meshlm.errors import ConfigError
from meshlm.generate.generator import Generator, logits_with_cache
from meshlm.io.model_io import save_model
from meshlm.model.config import get_config
from meshlm.parallel.layout import Layout
from meshlm.parallel.mesh import make_mesh

# Prompts crossing every chunk boundary of the cache (S = 64: 4 chunks of 16 under cp 2): the last
# prompt positions 19 and 49 lie in chunks 1 and 3, held by different cp shards.
TOKENS = np.random.default_rng(2).integers(1, 64, (2, 56))  # teacher-forced rows
LENGTHS = np.array([20, 50])
PROMPTS = [TOKENS[0, :20].tolist(), TOKENS[1, :50].tolist()]
NEW = 8
LAYOUTS = {  # both strategies; cp with mp (the cache split by heads) and with dp (rows split)
    "ring cp2 x mp2": Layout(mp=2, cp=2),
    "allgather cp2 x dp2": Layout(dp=2, cp=2, cp_strategy="allgather"),
}


# tiny-mistral-w10: every layer windowed (10 < 64), so the decode cache rolls (``cache.keep_window``).
# tiny-qwen3.5: the hybrid's linear layer leaves its recurrent state and conv history composed from every
# cp chunk (``model.linear_context``): on cp 4, 8 chunks of 8, the rows' last tokens in chunks 2 and 6.
CASES = {"tiny-llama": LAYOUTS, "tiny-mistral-w10": {"ring cp2 x mp2": LAYOUTS["ring cp2 x mp2"]}}
CASES["tiny-qwen3.5"] = {  # one period of the preset's two (a linear, a full layer): the same code
    "ring cp2 x mp2": LAYOUTS["ring cp2 x mp2"],
    "allgather cp4": Layout(cp=4, cp_strategy="allgather"),
}


def _config(model: str):
    return get_config(model).replace(n_layers=2) if model == "tiny-qwen3.5" else get_config(model)


# tiny-llama quick; the rolling cache's and the hybrid's cells slow (its scale: more models through the
# same prefill; the hybrid's state composed over cp: test_hybrid_padding_in_the_state_is_caught, quick)
@pytest.mark.parametrize(
    "model", [m if m == "tiny-llama" else pytest.param(m, marks=pytest.mark.slow) for m in CASES]
)
def test_prefill_over_cp_equals_prefill_without_in_float64(model):
    cfg = _config(model)
    with jax.enable_x64(True):
        params = jax.tree.map(lambda x: np.asarray(x, np.float64), host_params(cfg))
        ref = Generator(cfg, params, make_mesh(1, 1), eod=None)
        want, want_tokens = logits_with_cache(ref, TOKENS, LENGTHS), ref.generate(PROMPTS, NEW)
        for name, layout in CASES[model].items():
            gen = Generator(cfg, params, layout, eod=None, prefill_cp=True)
            got = logits_with_cache(gen, TOKENS, LENGTHS)  # row b: prefill of lengths[b], then decode
            worst = max(float(np.max(np.abs(g - w))) for g, w in zip(got, want, strict=True))
            assert worst <= 1e-12, (name, worst)
            tokens = [r.tokens for r in gen.generate(PROMPTS, NEW)]
            assert tokens == [r.tokens for r in want_tokens] and len(set(tokens[1])) > 3, name


def test_prefill_over_cp_refusals():
    cfg, params = get_config("tiny-llama"), host_params("tiny-llama")
    with pytest.raises(ConfigError, match=r"2 x cp = 4 chunks, which do not divide it: .* 2N dividing 30"):
        Generator(cfg, params, Layout(cp=2), max_len=30, prefill_cp=True)
    with pytest.raises(ConfigError, match=r"needs a layout with cp >= 2 \(it has cp=1\)"):
        Generator(cfg, params, make_mesh(1, 2), prefill_cp=True)
    hybrid = _config("tiny-qwen3.5")  # 8 chunks of 2 tokens: the conv's history is 3 inputs
    with pytest.raises(ConfigError, match=r"--cp 4: chunks of 2 tokens are shorter than the linear layers"):
        Generator(hybrid, host_params(hybrid), Layout(cp=4), max_len=16, prefill_cp=True)


def test_cli_generate_with_cp_equals_without(tmp_path, capsys):
    cfg = get_config("tiny-llama")
    save_model(tmp_path / "run", cfg, host_params("tiny-llama"), step=1)
    out = []
    for cp in ([], ["--cp", "2"]):
        argv = [
            "--checkpoint",
            str(tmp_path / "run"),
            "--mesh",
            "1x2",
            "--prompt",
            "0123456789:;<=>?" * 3,
            "--json",
        ]
        assert run_cli("generate", *argv, "--max-new-tokens", "8", *cp) == 0
        out.append(json.loads(capsys.readouterr().out)["tokens"])
    assert len(out[0]) >= 2 and out[0] == out[1]  # here greedy reaches EOD after 2 tokens


def test_kv_written_in_shard_order_is_caught(monkeypatch):
    """The classic bug of a cp prefill: each shard's chunks written at [i T/cp, (i+1) T/cp), the order
    the shards hold them, not at their global positions. The equality above must see it."""
    from meshlm.generate import programs
    from meshlm.model import attention

    def shard_order(cache, k, v, positions, par, window):
        t = positions.shape[1]
        local = jnp.broadcast_to(par.cp_index() * t + jnp.arange(t), positions.shape)
        return real(cache, k, v, local, par, window)

    real = attention.cp_prefill_cache
    monkeypatch.setattr(attention, "cp_prefill_cache", shard_order)
    monkeypatch.setattr(programs, "_PROGRAMS", {})  # compile afresh with the fault
    cfg, params = get_config("tiny-llama"), host_params("tiny-llama")
    want = logits_with_cache(Generator(cfg, params, make_mesh(1, 1), eod=None), TOKENS, LENGTHS)
    gen = Generator(cfg, params, LAYOUTS["ring cp2 x mp2"], eod=None, prefill_cp=True)
    got = logits_with_cache(gen, TOKENS, LENGTHS)
    worst = max(float(np.max(np.abs(g - w))) for g, w in zip(got, want, strict=True))
    assert worst > 1e-2


def test_hybrid_padding_in_the_state_is_caught(monkeypatch):
    """The classic bug of a linear layer's cp prefill: the right-padded prompt's padding decays and
    writes the recurrent state (the rows' lengths ignored). The equality above must see it."""
    from meshlm.generate import programs
    from meshlm.model import linear_context

    real = linear_context.cp_prefill_rule

    def padding_kept(q, k, v, g, beta, positions, lengths, chunk, par):
        return real(q, k, v, g, beta, positions, jnp.full_like(lengths, 1 << 20), chunk, par)

    monkeypatch.setattr(linear_context, "cp_prefill_rule", padding_kept)
    monkeypatch.setattr(programs, "_PROGRAMS", {})  # compile afresh with the fault
    cfg = _config("tiny-qwen3.5")
    params = host_params(cfg)
    want = logits_with_cache(Generator(cfg, params, make_mesh(1, 1), eod=None), TOKENS, LENGTHS)
    gen = Generator(cfg, params, LAYOUTS["ring cp2 x mp2"], eod=None, prefill_cp=True)
    got = logits_with_cache(gen, TOKENS, LENGTHS)
    worst = max(float(np.max(np.abs(g[1:] - w[1:]))) for g, w in zip(got, want, strict=True))
    assert worst > 1e-2  # the decode steps' logits (the prefill's own are right)
