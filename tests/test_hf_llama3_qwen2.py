"""Llama 3.x and Qwen2 against transformers: a tiny random LlamaForCausalLM (llama3 rope scaling, tied
embeddings, a BOS-adding tokenizer, a list of EOS ids) and Qwen2ForCausalLM (q/k/v biases, tied) are
built once each; converted, our logits equal theirs (unsharded and 2x2), `meshlm generate
--temperature 0` prints their greedy text and stops where they stop, the export loads back in
transformers with equal logits. Rope scaling skipped is a bug common to the sharded and unsharded runs:
only this comparison catches it (a planted test shows both halves)."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import run_cli, sharded_logits  # noqa: E402
from hf_helpers import our_logits  # noqa: E402

from meshlm.data.tokenizer_files import load_tokenizer  # noqa: E402
from meshlm.io import hf_weights  # noqa: E402
from meshlm.model import config as model_config  # noqa: E402
from meshlm.model.params import unflatten  # noqa: E402

RTOL = 1e-5  # float32: max |ours - theirs| / max |theirs|
CORPUS = ["def héllo(wörld):\n    return wörld + 1  # ünïcode\n" * 30, "import os\nclass A:\n    pass\n" * 20]
BOS, EOT = "<|begin_of_text|>", "<|eot_id|>"
PROMPT, NEW = "def héllo(w", 12
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0}
LLAMA3_ROPE.update(high_freq_factor=4.0, original_max_position_embeddings=16)  # every branch in play
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2)
SHAPE.update(intermediate_size=128, max_position_embeddings=64, tie_word_embeddings=True)


def _tokenizer(bos: bool):
    """A BPE over whole characters (Metaspace, SentencePiece-like: every token is text, so a stop
    never falls inside a character); with ``bos`` Llama 3's specials and a post-processor adding BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers.processors import TemplateProcessing

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    specials = ["<unk>", "<|endoftext|>", *([BOS, EOT] if bos else [])]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=specials))
    if bos:
        tok.post_processor = TemplateProcessing(
            single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))]
        )
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def _hf_config(family: str, vocab: int):
    if family == "llama3":
        return transformers.LlamaConfig(vocab_size=vocab, rope_parameters=dict(LLAMA3_ROPE), **SHAPE)
    return transformers.Qwen2Config(vocab_size=vocab, rope_parameters={"rope_theta": 1e6}, **SHAPE)


def _greedy(model, ids, eos) -> list[int]:
    model.generation_config.eos_token_id = eos
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module", params=["llama3", "qwen2"])
def family(request, tmp_path_factory):
    """The tiny model saved with its tokenizer and converted (1x1); its EOS ids are two tokens its
    greedy continuation of PROMPT produces (first at steps k1 < k2), so generation must stop at k1."""
    name = request.param
    tok = _tokenizer(bos=name == "llama3")
    torch.manual_seed(0)
    hf_cfg = _hf_config(name, len(tok))
    hf_cfg.initializer_range = 0.3  # peaked logits: greedy is neither degenerate nor near a tie
    model = getattr(transformers, {"llama3": "LlamaForCausalLM"}.get(name, "Qwen2ForCausalLM"))(hf_cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # biases and norms too: a wrong mapping of any tensor shows
            p.add_(torch.randn_like(p) * 0.05)
    ids = tok(PROMPT).input_ids
    free = _greedy(model, ids, None)
    new = [k for k in range(2, NEW) if free[k] not in free[:k] + ids]  # stop points: tokens not seen before
    eos = [free[new[0]], free[new[1]]]
    model.config.eos_token_id = eos
    root = tmp_path_factory.mktemp(name)
    model.save_pretrained(root / "hf")
    tok.save_pretrained(root / "hf")
    assert (
        run_cli("convert", "--from-hf", str(root / "hf"), "--out", str(root / "ckpt"), "--mesh", "1x1") == 0
    )
    stopped = _greedy(model, ids, eos)
    assert stopped == free[: new[0] + 1]  # transformers stops at the first of the two
    text = tok.decode(stopped[:-1], skip_special_tokens=True)  # the EOS ids are plain tokens here
    return dict(
        name=name, tok=tok, model=model, root=root, ids=ids, free=free, eos=eos, text=text, stopped=stopped
    )


def _logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def _rel(got, want) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.fixture(scope="module")
def tokens(family):
    """[2, 40] ids: past the original context of 16 that llama3's scaling is relative to."""
    return np.random.default_rng(0).integers(0, len(family["tok"]), (2, 40))


def test_logits_equal_transformers_unsharded_and_2x2(family, tokens):
    cfg, flat = hf_weights.load_hf(family["root"] / "hf")
    assert cfg.tie_embeddings and cfg.arch.qkv_bias == (family["name"] == "qwen2")
    assert (cfg.rope_scaling is not None) == (family["name"] == "llama3")
    want = _logits(family["model"], tokens)
    got = our_logits(cfg, flat, tokens)
    assert _rel(got, want) <= RTOL
    for copy in sharded_logits(cfg, unflatten(flat), tokens):
        assert _rel(copy, want) <= RTOL


# 1x1 and one sharded mesh (test_generation_stops_at_either_eos_id reuses 2x2's compiled programs)
@pytest.mark.parametrize("mesh", ["1x1", "2x2"])
def test_greedy_text_equal_and_stops_at_an_eos_id(family, mesh, capsys):
    capsys.readouterr()
    argv = ["generate", "--checkpoint", str(family["root"] / "ckpt"), "--mesh", mesh, "--temperature", "0"]
    assert run_cli(*argv, "--json", "--prompt", PROMPT, "--max-new-tokens", str(NEW)) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["finish_reason"] == "eod" and out["tokens"] == family["stopped"]
    assert out["text"] == family["text"] and len(out["text"]) > 3


def test_generation_stops_at_either_eos_id(family):
    """The second id alone (the first never produced) stops at its own step: any id of the list ends."""
    from meshlm.generate.generator import Generator
    from meshlm.io.model_io import load_model
    from meshlm.parallel.mesh import make_mesh

    mesh = make_mesh(2, 2)  # the CLI test's mesh: its compiled programs are reused
    cfg, params, _ = load_model(family["root"] / "ckpt", mesh)
    free, (first, second) = family["free"], family["eos"]
    unused = next(i for i in range(cfg.vocab_size) if i not in free)
    gen = Generator(cfg, params, mesh, eod=[unused, second])
    [result] = gen.generate([family["ids"]], NEW)
    assert result.finish_reason == "eod" and result.tokens == free[: free.index(second) + 1]
    assert free.index(second) > free.index(first)


@pytest.mark.parametrize("family", ["llama3"], indirect=True)
def test_bos_added_once_never_doubled_never_dropped(family):
    tok = load_tokenizer(family["root"] / "hf" / "tokenizer.json")
    bos = tok.tok.token_to_id(BOS)
    ids = tok.encode_prompt(PROMPT).tolist()
    assert ids == family["ids"] and ids[0] == bos and ids.count(bos) == 1  # as transformers: one BOS
    assert tok.encode_prompt(BOS + PROMPT).tolist() == ids  # the text's own BOS: not a second one
    assert tok.encode(PROMPT).tolist() == ids[1:]  # training text: no BOS added


def test_export_loads_back_in_transformers(family, tokens, tmp_path):
    out = tmp_path / "export"
    assert (
        run_cli("convert", "--to-hf", str(family["root"] / "ckpt"), "--out", str(out), "--mesh", "2x2") == 0
    )
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == family["eos"]
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert _rel(_logits(back, tokens), _logits(family["model"], tokens)) <= RTOL


@pytest.mark.parametrize("family", ["llama3"], indirect=True)
def test_rope_scaling_skipped_only_transformers_catches(family, tokens, monkeypatch):
    """Plant the bug: frequencies computed without the scaling. Sharded and unsharded still agree (the
    bug is in code both run: `verify` cannot see it), but the logits leave transformers' far behind."""
    plain = model_config.rope_inv_freq
    monkeypatch.setattr(model_config, "rope_inv_freq", lambda dim, theta, scaling: plain(dim, theta, None))
    cfg, flat = hf_weights.load_hf(family["root"] / "hf")
    got = our_logits(cfg, flat, tokens)
    assert _rel(sharded_logits(cfg, unflatten(flat), tokens)[0], got) <= RTOL
    assert _rel(got, _logits(family["model"], tokens)) > 100 * RTOL
