"""Quick tests for planted bugs that only the slow tier caught (issue 66 item 6), each at the smallest
shape that catches it: the LoRA proof's drawn A and B discarded, its frozen-base row comparing the start
with itself, a companion list without ``chat_template.jinja``, an empty conversation accepted. Each was
shown to fail with its bug planted (the issue's mutants) and to pass clean."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from meshlm.model import lora
from meshlm.model.config import get_config


def _tiny_lora_params(cfg):
    import haiku as hk
    import jax.numpy as jnp

    from meshlm.model.transformer import logits_fn
    from meshlm.parallel.context import Parallel

    tokens = jnp.zeros((1, 4), jnp.int32)
    return hk.transform(logits_fn(cfg, Parallel())).init(jax.random.PRNGKey(0), tokens)


CFG = get_config("tiny-llama").replace(lora_rank=2, lora_alpha=4.0, lora_targets="q,down")


def test_the_lora_proof_draws_a_and_b():
    """Mutant: ``lora_problem``'s prepare returning the init (B = 0: A's gradient exactly 0, a proof of
    nothing of A; the slow tier's K-step proof noticed only as an all-zero row). The prepared adapters
    are every one drawn: B nonzero, A not the init's, each factor's term at its base's size."""
    from meshlm.proof.lora import lora_problem
    from meshlm.proof.problem import model_problem

    params = _tiny_lora_params(CFG)
    prepared = lora_problem(model_problem(CFG, "tiny-llama", 1, 1, 4)).prepare_params(params)
    before, after = lora.adapters(params), lora.adapters(prepared)
    assert sorted(before) == sorted(after) and len(jax.tree.leaves(after)) == 4
    for mod, leaves in after.items():
        for name, x in leaves.items():
            assert np.count_nonzero(np.asarray(x)) == x.size, f"{mod}/{name} not drawn"
            assert not np.array_equal(np.asarray(x), np.asarray(before[mod][name])), f"{mod}/{name} kept"
    assert lora.base(prepared).keys() == lora.base(params).keys()


def test_the_frozen_base_row_compares_the_end_with_the_start():
    """Mutant: the row "LoRA: frozen base unchanged by the steps" handed the start twice (``_base_kept``
    reading ``runs.params`` for ``runs.trained``): a step that moved the base passed. Here a base moved by
    one ulp after the steps fails the row; an untouched one passes it."""
    from meshlm.proof.lora import _base_kept

    params = _tiny_lora_params(CFG)
    runs = type("Runs", (), {"problem": type("P", (), {"cfg": CFG}), "params": params})()
    runs.trained = params
    (kept,) = _base_kept(runs)
    assert kept["ok"], kept
    moved = {m: dict(leaves) for m, leaves in params.items()}
    w = moved["layers/attn"]["wq"]
    moved["layers/attn"]["wq"] = w.at[0, 0, 0, 0].set(np.nextafter(w[0, 0, 0, 0], np.inf))
    runs.trained = moved
    (kept,) = _base_kept(runs)
    assert not kept["ok"] and "layers/attn/wq" in kept["detail"], kept


def test_a_chat_template_travels_with_the_tokenizer(tmp_path):
    """Mutant: ``chat_template.jinja`` left out of the companion list: a converted or trained checkpoint
    lost the model's chat template (generate --chat and data prepare --chat then refused it; only the
    slow convert tests saw it). The companions read from a model directory and saved with the tokenizer
    keep every file, the template byte for byte."""
    from meshlm.data.tokenizer_files import read_companions, save_tokenizer

    src = tmp_path / "model"
    src.mkdir()
    files = {
        "tokenizer_config.json": '{"eos_token": "<|end|>"}',
        "special_tokens_map.json": "{}",
        "chat_template.jinja": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
        "generation_config.json": '{"eos_token_id": 1}',
    }
    for name, text in files.items():
        (src / name).write_text(text, encoding="utf-8")
    out = tmp_path / "ck"
    companions = read_companions(src)

    class Carried:  # what save_tokenizer reads of a tokenizer: its JSON, identity and companions
        fingerprint, vocab_size, files = "f" * 16, 8, companions

        def to_json(self):
            return "{}"

    entry = save_tokenizer(out, Carried())
    assert sorted(entry["files"]) == sorted(files)
    assert (out / "chat_template.jinja").read_text(encoding="utf-8") == files["chat_template.jinja"]


@pytest.mark.parametrize("train_on", ["all", "assistant", "last"])
def test_an_empty_conversation_is_refused_with_its_own_reason(train_on):
    """``{"messages": []}``: refused under every --train-on, saying it is empty (the mutant that dropped
    the emptiness check was accepted under ``all`` and refused under the default for having no assistant
    turn, the wrong reason)."""
    from meshlm.data.chat import conversation_problem

    messages, problem = conversation_problem({"messages": []}, train_on)
    assert messages is None and problem is not None
    assert "`messages` is empty" in problem and "assistant" not in problem, problem
