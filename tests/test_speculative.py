"""``generate --speculative mtp`` (``generate.speculative``): the MTP depths draft, the main model verifies
in one forward, the rejected tokens' cache entries are overwritten before any query sees them.

The output equals plain greedy generation token for token on 1x1, 1x2 and 2x1 x ep 2, with drafts both
accepted and rejected in every row: the tiny DeepSeek-V3 is planted so that its MTP depth knows part of
what the main model does (``planted``: random weights alone accept about one draft in 80). A control
(the next step starting one position late: a rejected slot left stale) changes the output. The drafts
themselves equal the full forward's depth-1 predictions at the committed positions in float64 (the
depth's own cache proven), and a control (the depth embedding the token one too few ahead) is detected
there while the output stays the same: output equality alone cannot see a bad draft."""

import json
import shlex

import haiku as hk
import jax
import numpy as np
import pytest
from docs_commands import SPEC_GENERATE
from helpers import run_cli
from test_generate import host_params

import meshlm.generate.speculative as speculative
import meshlm.generate.speculative_loop as loop
from meshlm.errors import ConfigError
from meshlm.generate.generator import Generator
from meshlm.generate.speculative import check_speculative
from meshlm.generate.speculative_loop import generate_speculative
from meshlm.model import mtp
from meshlm.model.config import get_config
from meshlm.model.padding import resize_tree
from meshlm.model.transformer import local_logits_stats
from meshlm.parallel.context import Parallel
from meshlm.parallel.layout import Layout

# the preset's shape as of this test (its planted acceptance tuned on it), whatever the preset becomes
CFG = get_config("tiny-deepseek-v3").replace(n_layers=2, dense_layers=(0,), mtp_layers=1)
PROMPTS = [[1, 2, 3], [5, 9, 11, 40, 2], [7], [30, 31]]
NEW, MAX_LEN = 20, 25  # the longest prompt (5) + NEW fills the context: the last slots in use


def planted(params: dict, alpha: float = 0.01) -> dict:
    """The main model near a bigram model (its layers' outputs x ``alpha``: the embedding dominates the
    residual) and the MTP depth taking the embedding of the token it is given (``eh_proj`` = [I; 0],
    its block's outputs x ``alpha``, unit norms): it then predicts what the bigram predicts after that
    token, which the main model's layers sometimes overrule. alpha 0 accepts every draft."""
    out = {}
    for module, leaves in params.items():
        new = {n: np.array(a) for n, a in leaves.items()}
        for n in ("wo", "w_down"):
            if n in new:
                new[n] = new[n] * alpha
        if module in ("final_ln", "mtp_0/enorm", "mtp_0/hnorm", "mtp_0/head_norm"):
            new["scale"] = np.ones_like(new["scale"])
        if module == "mtp_0/eh_proj":
            d = new["w"].shape[1]
            new["w"] = np.concatenate([np.eye(d, dtype=new["w"].dtype), 0 * new["w"][d:]])
        out[module] = new
    return out


@pytest.fixture(scope="module")
def plain():
    """(params, the plain greedy tokens of PROMPTS on 1x1)."""
    params = planted(host_params(CFG))
    gen = Generator(CFG, params, Layout(), max_len=MAX_LEN, eod=None)
    return params, [r.tokens for r in gen.generate(PROMPTS, NEW)]


def _speculate(params, layout, **kw):
    results, stats = generate_speculative(
        Generator(CFG, params, layout, max_len=MAX_LEN, eod=None), PROMPTS, NEW, **kw
    )
    return [r.tokens for r in results], [s.to_json() for s in stats]


def test_output_equals_plain_greedy_with_drafts_accepted_and_rejected(plain, monkeypatch):
    params, want = plain
    got, stats = _speculate(params, Layout())
    assert got == want
    for s in stats:  # every row both accepts and rejects
        assert 0 < s["drafts_accepted"] < s["drafts_proposed"], s
        assert s["main_forwards"] < NEW and s["tokens_per_forward"] == round(NEW / s["main_forwards"], 4)
        assert s["drafts_proposed"] == s["main_forwards"] - 1  # one depth: one draft per verify step
    # control: the next step starting one position late leaves a rejected token's slot stale
    monkeypatch.setattr(loop, "advance", lambda first, k: first + k + 1)
    assert _speculate(params, Layout())[0] != want


# slow: the same speculative decode on sharded meshes (scale); sharded decoding equals unsharded:
# tests/test_generate.py, quick
@pytest.mark.slow
def test_sharded_meshes_give_the_same_output_and_drafts(plain):
    params, want = plain
    one = _speculate(params, Layout())
    for layout in (Layout(mp=2), Layout(dp=2, ep=2)):  # the latent over mp; the experts over ep
        assert _speculate(params, layout) == one == (want, one[1]), layout


def test_two_depths_chain_their_drafts(plain):
    """D = 2 (a second depth, a copy of the first): two drafts a step, the output still plain greedy's."""
    params, want = plain
    cfg = CFG.replace(mtp_layers=2)
    two = {**params, **{k.replace("mtp_0", "mtp_1"): v for k, v in params.items() if k.startswith("mtp_0")}}
    results, stats = generate_speculative(
        Generator(cfg, two, Layout(), max_len=MAX_LEN, eod=None), PROMPTS, NEW
    )
    assert [r.tokens for r in results] == want
    assert all(s.proposed == 2 * (s.forwards - 1) for s in stats)
    assert sum(s.accepted for s in stats) > 0


def _depth1_logits(params, rows: list) -> np.ndarray:
    """The full forward's depth-1 logits [B, T, V] of the sequences ``rows`` (unsharded, right-padded:
    causal, so the padding changes no earlier position): at position i, given t_{i+1}."""
    tokens = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for b, row in enumerate(rows):
        tokens[b, : len(row)] = row
    fn = lambda t: local_logits_stats(CFG, Parallel(), t, mtp_ids=[mtp.ahead(t, 1)])[3][0][0]
    full = jax.jit(hk.transform(fn).apply)(params, None, tokens)
    return np.asarray(full)[..., : CFG.vocab_size]


def _drafts(params, layout) -> tuple[list, list]:
    """(each prompt's output, the drafts' (row, position, logits [D, V])) of a speculative run."""
    record: list = []
    gen = Generator(CFG, params, layout, max_len=MAX_LEN, eod=None)
    results, _ = generate_speculative(gen, PROMPTS, 8, record=record)
    return [p + r.tokens for p, r in zip(PROMPTS, results, strict=True)], record


def _worst(rows, full, record) -> float:
    """The worst relative error of the drafts' logits against the full forward's, where the token the
    depth embeds (t_{p+1}) is in the output (a row's budget may cut the step's last tokens)."""
    kept = [(b, p, logits) for b, p, logits in record if p + 1 < len(rows[b])]
    assert len(kept) > len(PROMPTS)
    return max(float(np.max(np.abs(x[0] - full[b, p])) / np.max(np.abs(full[b, p]))) for b, p, x in kept)


def test_drafts_equal_the_full_forward_depth_in_float64(monkeypatch):
    with jax.enable_x64(True):
        params = jax.tree.map(lambda x: jax.numpy.asarray(x, np.float64), host_params(CFG))
        rows, record = _drafts(params, Layout(mp=2))
        full = _depth1_logits(params, rows)
        assert _worst(rows, full, record) <= 1e-12, _worst(rows, full, record)
        # control: the depth embeds the fed token (t_i) instead of the next one (t_{i+1})
        monkeypatch.setattr(speculative, "known", lambda tokens, at, bonus: tokens)
        monkeypatch.setattr(speculative, "_PROGRAMS", {})
        same, bad = _drafts(params, Layout(mp=2))
        assert same == rows and _worst(rows, full, bad) > 1e-3  # detected; the output cannot show it


def test_refused_in_one_line():
    params = {"embed": {}}
    with pytest.raises(ConfigError, match="needs MTP depths"):
        check_speculative(get_config("tiny-llama"), None, 0.0, False)
    with pytest.raises(ConfigError, match="no MTP weights"):
        check_speculative(CFG, params, 0.0, False)
    with pytest.raises(ConfigError, match="greedy only"):
        check_speculative(CFG, None, 0.7, False)
    with pytest.raises(ConfigError, match="--cp"):
        check_speculative(CFG, None, 0.0, True)
    with pytest.raises(ConfigError, match="windowed or chunked"):
        check_speculative(get_config("tiny-mistral").replace(mtp_layers=1), None, 0.0, False)
    with pytest.raises(ConfigError, match="document mask"):
        check_speculative(CFG.replace(doc_mask=0), None, 0.0, False)


def _checkpoint(path, cfg, params):
    from meshlm.io.model_io import save_model

    save_model(str(path), cfg, params)
    return str(path)


def _documented_run(tmp_path, monkeypatch, capsys):
    """The docs' command on a tiny-deepseek-v3 of the docs' 300-id vocabulary (the planted weights, ids
    from 64 on zero-padded), run in ``tmp_path``: (its argv, its JSON rows), the drafts reported."""
    cfg = CFG.replace(vocab_size=300)
    _checkpoint(
        tmp_path / "runs/deepseek",
        cfg,
        resize_tree(planted(host_params(CFG)), cfg.padded_vocab),
    )
    monkeypatch.chdir(tmp_path)
    argv = [*shlex.split(SPEC_GENERATE)[1:], "--max-new-tokens", "12"]  # docs/models.md's, exactly
    assert run_cli(*argv) == 0
    out = json.loads(capsys.readouterr().out)
    keys = {"drafts_proposed", "drafts_accepted", "acceptance_rate", "main_forwards", "tokens_per_forward"}
    assert all(keys < set(o["speculative"]) and o["speculative"]["method"] == "mtp" for o in out)
    assert sum(o["speculative"]["drafts_accepted"] for o in out) > 0
    return argv, out


def test_cli_runs_the_documented_command_and_refuses_bad_input(tmp_path, monkeypatch, capsys):
    """The docs' command (``_documented_run``), and its bad inputs refused in one line before any work."""
    argv, _ = _documented_run(tmp_path, monkeypatch, capsys)
    assert run_cli(*argv, "--temperature", "0.7") == 2
    assert capsys.readouterr().err.count("\n") == 1  # one line
    assert run_cli(*argv, "--mesh", "1x1", "--cp", "2", "--devices", "2") == 2
    assert "--cp" in capsys.readouterr().err
    _checkpoint(tmp_path / "llama", get_config("tiny-llama"), host_params("tiny-llama"))
    assert run_cli(*[a.replace("runs/deepseek", "llama") for a in argv]) == 2
    assert "needs MTP depths" in capsys.readouterr().err


# slow: the CLI's plain generation beside its speculative one (its cost: a second generation compiled);
# speculative tokens equal plain greedy ones, quick: test_output_equals_plain_greedy_with_drafts_accepted_
# and_rejected (the library call the CLI makes)
@pytest.mark.slow
def test_cli_speculative_tokens_are_plain_greedy_generations(tmp_path, monkeypatch, capsys):
    argv, out = _documented_run(tmp_path, monkeypatch, capsys)
    assert run_cli(*[a for a in argv if a not in ("--speculative", "mtp")]) == 0
    assert [o["tokens"] for o in json.loads(capsys.readouterr().out)] == [o["tokens"] for o in out]
