"""Every control falsifiable where it runs: each planted fault moves the result by at least 100x the
float32 tolerance on the models verify proves, vocabulary-padded ones included (``tiny-gpt2vocab`` and
a Llama converted from ``transformers`` with GPT-2's 50257 ids). A control that moves the result by
only a few tolerances would fail a correct model on a slightly different one, or pass a wrong one.

One mesh (2x4: dp > 1, mp > n_kv_heads), the smallest shapes, float32; the communication control's
effect is a count of collectives, not a value (``test_prover.py`` covers it).
"""

import dataclasses

import jax
import numpy as np
import pytest

from meshlm.data.tokenizer import EOD
from meshlm.model.config import get_config
from meshlm.model.params import unflatten
from meshlm.parallel.layout import Layout
from meshlm.parallel.mesh import make_mesh
from meshlm.proof import format_report, model_problem, verify
from meshlm.proof.controls import CONTROLS
from meshlm.proof.report import margin_text
from meshlm.sharding.rules import model_specs, shardings

DP, MP, SEQ_LEN, MARGIN = 2, 4, 8, 100.0


def hf_llama_50257(directory) -> None:
    """A tiny random Llama with GPT-2's vocabulary (50257: padded to 50304 on import), grouped-query
    attention (2 KV heads, replicated on mp = 4), every weight perturbed, saved as transformers does."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        vocab_size=50257,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(directory, safe_serialization=True)


def _hf_problem(tmp_path_factory):
    from meshlm.io.hf_weights import load_hf

    directory = tmp_path_factory.mktemp("hf-llama-50257")
    hf_llama_50257(directory)
    cfg, flat = load_hf(directory)
    assert (cfg.vocab_size, cfg.padded_vocab) == (50257, 50304)
    params = unflatten(flat)
    place = lambda layout: jax.device_put(params, shardings(model_specs(cfg, params, layout), layout.mesh))
    problem = model_problem(cfg, "hf-llama-50257", MP, 2 * DP, SEQ_LEN, dp=DP)
    return dataclasses.replace(problem, load_params=place)


def _softcapped_problem(_):
    """tiny-gemma soft-capped, its q and k weights 20x their initial size: scores of a few units, as a
    trained model's (at initialisation attention is nearly uniform, and no cap could matter)."""
    import haiku as hk

    from meshlm.model.transformer import init_fn

    cfg = get_config("tiny-gemma").replace(attn_softcap=1.0, final_softcap=0.05)
    init, example = init_fn(cfg)
    params = hk.data_structures.to_mutable_dict(init(jax.random.PRNGKey(0), example))
    for name in ("wq", "wk"):
        params["layers/attn"][name] = params["layers/attn"][name] * 20
    place = lambda layout: jax.device_put(params, shardings(model_specs(cfg, params, layout), layout.mesh))
    problem = model_problem(cfg, "tiny-gemma softcap", MP, 2 * DP, SEQ_LEN, dp=DP)
    return dataclasses.replace(problem, load_params=place)


def _preset(name, doc_mask=-1, **options):
    cfg = get_config(name).replace(doc_mask=doc_mask)
    return lambda _: model_problem(cfg, name, MP, 2 * DP, SEQ_LEN, dp=DP, **options)


def _named(*names):
    return tuple(c for c in CONTROLS if c.name in names)


# Each control on the models it is about (a control runs one sharded program: compiling them all on
# every model would multiply the runtime for no new coverage).
ATTENTION = ("shard uses another shard's heads", "wrong rotary convention", "padded logits not masked")
CASES = {
    "tiny": (_preset("tiny"), tuple(c for c in CONTROLS if not c.by_collectives)),
    "tiny-gpt2vocab": (_preset("tiny-gpt2vocab"), _named(*ATTENTION)),
    "hf-llama-50257": (_hf_problem, _named(*ATTENTION, "KV heads not replicated per query group")),
    # Gemma with a window inside the 8 positions: both families' controls in one run.
    "tiny-gemma window 3": (
        lambda _: model_problem(
            get_config("tiny-gemma").replace(sliding_window=3), "g", MP, 2 * DP, SEQ_LEN, dp=DP
        ),
        _named("sliding window off by one", "embedding scale applied twice"),
    ),
    "tiny-qwen2 tied": (  # Qwen2's q/k/v biases and a tied head (family_faults)
        lambda _: model_problem(
            get_config("tiny-llama").replace(family="qwen2", tie_embeddings=True),
            "q",
            MP,
            2 * DP,
            SEQ_LEN,
            dp=DP,
        ),
        _named(
            "q/k/v bias not sliced with its heads",
            "tied head reads another shard's vocab slice",
            "tied head's gradient not added to the embedding",
        ),
    ),
    "tiny-qwen3": (  # the per-head q/k norm (family_faults); 2 KV heads replicated on mp = 4
        _preset("tiny-qwen3"),
        _named("q/k norm applied after rotary", "q/k norm gradient not summed over mp"),
    ),
    "tiny-olmo2": (  # OLMo 2's whole-projection q/k norm; its 2 KV heads replicated on mp = 4
        _preset("tiny-olmo2"),
        _named("OLMo 2's norm statistics from the local shard only"),
    ),
    "tiny-gemma softcap": (
        _softcapped_problem,
        _named(
            "attention soft-cap off",
            "final-logit soft-cap off",
            "attention soft-cap applied after the softmax",
        ),
    ),
    "tiny-gemma3 window 3": (  # local and global layers (family_faults): one pattern, local local global
        lambda _: model_problem(
            get_config("tiny-gemma3").replace(sliding_window=3, n_layers=3), "g3", MP, 2 * DP, SEQ_LEN, dp=DP
        ),
        _named("local and global layers swapped", "local rotary base used on a global layer"),
    ),
    "tiny-gemma4": (  # per-layer inputs, keys as values, shared KV: the last two layers read 0 and 1's
        lambda _: model_problem(
            get_config("tiny-gemma4").replace(n_layers=4, global_every=2), "g4", MP, 2 * DP, SEQ_LEN, dp=DP
        ),
        _named(
            "keys-as-values layer reading its own values",
            "KV-shared layer computing and writing its own keys and values",
            "per-layer input from the wrong layer's slice",
        ),
    ),
    "tiny-llama fsdp+sp doc-mask": (  # the document mask's controls on its EOD-rich batches
        _preset("tiny-llama", fsdp=True, sp=True, doc_mask=EOD),
        tuple(c for c in CONTROLS if c.name.startswith(("FSDP", "SP", "document mask"))),
    ),
}
RAN: dict[str, set] = {}


# slow: its cost is its scale (13 configurations' controls at 100x the tolerance); each feature's proof is
# quick with its sharding's controls (every control's detection: the feature proofs' slow halves)
@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_every_control_moves_the_result_by_100x_the_tolerance(case, tmp_path_factory):
    make_problem, controls = CASES[case]
    report = verify(make_problem(tmp_path_factory), make_mesh(DP, MP), controls=controls)
    assert report.ok, format_report(report)
    for c in report.controls:
        assert c["detected"], c
        if c["by"] == "values":  # a rejection by the type system or non-finite values: no tolerance
            assert c["margin"] >= MARGIN, f"{case}: {c['name']} moved the result by {c['margin']:.3g}x"
            assert f"detected: {margin_text(c)}" in format_report(report)
        print(case, c["name"], c["by"], c["margin"])
    RAN[case] = {c["name"] for c in report.controls}


OWN_FLOAT64_PROOF = {  # control -> the test that proves it detected, in float64
    "chunked loss: head gradient of the last chunk only": "tests/test_chunked_xent.py",
    "chunked loss: stored gradients not scaled by the cotangent": "tests/test_chunked_xent.py",
    "chunked loss: chunks stitched back one chunk off": "tests/test_chunked_xent.py",
    "sink added on every ring step": "tests/test_sinks.py",
    "sink's gradient not summed over the data shards": "tests/test_sinks.py",
    "chunk boundary off by one": "tests/test_chunked.py",
    "NoPE layer rotated": "tests/test_chunked.py",
    "temperature applied on a rotated layer": "tests/test_chunked.py",
    "delta rule decays after its write": "tests/test_deltanet.py",
    "delta rule's beta without its sigmoid": "tests/test_deltanet.py",
    "delta rule's state not reset at a document start": "tests/test_deltanet.py",
    "linear attention's key heads paired with another shard's value heads": "tests/test_deltanet.py",
    "delta rule's state not passed between cp chunks": "tests/test_deltanet.py",
    "linear attention's conv history not passed between cp chunks": "tests/test_deltanet.py",
    "MLA rotary key taken per head": "tests/test_mla.py",
    "MLA latent norm gradient not summed over mp": "tests/test_mla.py",
    "MLA key halves joined rope first": "tests/test_mla.py",
    "YaRN attention factor on the queries only": "tests/test_mla.py",
    "MTP token shifted by one too few": "tests/test_mtp.py",
    "MTP labels not taken across the cp shard boundary": "tests/test_mtp.py",
    "MTP loss counted on every pp stage": "tests/test_mtp.py",
    # flash's kernel computes in float32 (verify refuses --x64 with it): proven in float32 there
    "flash mask sees the next key": "tests/test_flash.py",
    "flash document segments ignored": "tests/test_flash.py",
    "flash window one key wider": "tests/test_flash.py",
    "flash ring's own chunk fully visible": "tests/test_flash.py",
}


# slow: reads the sweep above (skips without it)
@pytest.mark.slow
def test_the_sweep_covered_every_value_control():
    if set(RAN) != set(CASES):
        pytest.skip("runs after the sweep (the whole module)")
    # The mixture of experts' controls are swept in float64 by their own proof (tests/test_moe.py), and
    # so are those of the variants and layers added since (their float64 proofs, each with its margins).
    value_controls = {
        c.name
        for c in CONTROLS
        if not c.by_collectives and not c.name.startswith("MoE ") and c.name not in OWN_FLOAT64_PROOF
    }
    assert set().union(*RAN.values()) == value_controls


def test_padded_logits_control_is_seen_even_where_zero_padding_hides():
    """At zero padded weights the unmasked padding moves the loss by ~log(50304/50257): the control
    plants large padded logits (+-1000x real columns), so its effect is orders of magnitude larger."""
    from meshlm.proof.controls import large_padded_logits
    from meshlm.proof.runs import Runs

    cfg = get_config("tiny-gpt2vocab")
    problem = model_problem(cfg, "tiny-gpt2vocab", 2, 2, SEQ_LEN)
    runs = Runs(problem, Layout.of(make_mesh(1, 2)), np.float32, 0)
    planted = large_padded_logits(cfg, runs.params)
    w0, w1 = np.asarray(runs.params["head"]["w"]), np.asarray(planted["head"]["w"])
    np.testing.assert_array_equal(w1[:, : cfg.vocab_size], w0[:, : cfg.vocab_size])  # real columns kept
    assert not w0[:, cfg.vocab_size :].any() and np.abs(w1[:, cfg.vocab_size :]).max() > 10
    assert planted["head"]["w"].sharding == runs.params["head"]["w"].sharding
