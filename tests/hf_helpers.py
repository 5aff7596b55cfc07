"""What the transformers comparisons share: both models' logits and their relative difference."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from meshlm.model.params import unflatten
from meshlm.model.transformer import logits_fn
from meshlm.parallel.context import Parallel

# The tiny models' shared setting: float32 logits within RTOL (worst |ours - theirs| relative to the
# largest |logit|), a BPE vocabulary of VOCAB trained on CORPUS, NEW greedy tokens after PROMPT.
RTOL = 1e-5
VOCAB = 280
PROMPT = "def héllo(wörld):\n    ret"
NEW = 10
# The tiny transformers configs' common fields (a family's file adds its own: layers, MLP width, pad id)
TINY = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
TINY |= dict(max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
ROPE = {"rope_type": "default", "rope_theta": 1e4}
CORPUS = ["def héllo(wörld):\n    return wörld + 1  # ünïcode\n" * 30, "import os\nclass A:\n    pass\n" * 20]


def perturbed_model(model_cls, hf_cfg, init: float = 0.3, norm_noise: float = 0.3):
    """A tiny transformers model of ``hf_cfg`` with peaked logits (``init``, its initializer_range: greedy
    text neither degenerate nor near a tie) and every weight perturbed (by 0.05, the norm weights by
    ``norm_noise``: away from their 1 or 0), so that no tensor is its default."""
    import torch

    hf_cfg.initializer_range = init
    model = model_cls(hf_cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (norm_noise if "norm" in name else 0.05))
    return model


def random_tokens(length: int = 16) -> np.ndarray:
    """The compared token ids [2, length] (seed 0)."""
    return np.random.default_rng(0).integers(0, VOCAB, (2, length))


def rel(got, want) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def hf_logits(model, tokens) -> np.ndarray:
    """A transformers model's logits [B, T, V] (torch imported only here: the test extra has it)."""
    import torch

    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def our_logits(cfg, flat, tokens) -> np.ndarray:
    """The unsharded model's logits [B, T, V] from flat converted parameters: one compiled program (op by
    op, the forward's layer scans and every small op compile a program each)."""
    apply = jax.jit(hk.transform(logits_fn(cfg, Parallel())).apply)
    return np.asarray(apply(unflatten(flat), None, jnp.asarray(tokens)))


def export_round_trip(hf_dir, out, tokens, want, **load) -> tuple[str, float, bool]:
    """Convert ``hf_dir`` to meshlm, export it back to ``out`` and load that in transformers (``load``:
    from_pretrained's options): (the loaded class's name, its logits on ``tokens`` relative to
    ``want``, the original model's, and whether the export converts back to the same config)."""
    import transformers

    from meshlm.io import hf_weights

    cfg, flat = hf_weights.load_hf(hf_dir)
    hf_weights.save_hf(cfg, flat, out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, **load).eval()
    return type(model).__name__, rel(hf_logits(model, tokens), want), hf_weights.load_hf(out)[0] == cfg


def bpe_tokenizer(corpus, vocab: int):
    """A transformers fast tokenizer of meshlm's BPE trained on ``corpus`` (EOD as its eos)."""
    import transformers

    from meshlm.data.bpe import train_bpe
    from meshlm.data.hf_tokenizer import EOD_TOKEN

    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(corpus, vocab).tok, eos_token=EOD_TOKEN
    )


def write_fused(model, source, out):
    """The model's in-memory state dict (fused experts) as model.safetensors, with source's config."""
    import shutil

    from safetensors.torch import save_file

    out.mkdir()
    shutil.copy(source / "config.json", out / "config.json")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})


def balance_loss_equal_transformers(hf_dir, model, tokens, loss_func, experts=4, k=2) -> int:
    """Our "hf" balance loss of the converted model's own routing equals transformers' ``loss_func``
    (its load_balancing_loss_func) of the model's router logits, every routed layer's tokens pooled;
    returns how many routed layers both saw."""
    import pytest
    import torch

    from meshlm.io import hf_weights
    from meshlm.model import moe
    from meshlm.model.transformer import local_logits_stats

    cfg, flat = hf_weights.load_hf(hf_dir)
    run = lambda t: local_logits_stats(cfg, Parallel(), t)[2]
    stats = jax.jit(hk.transform(run).apply)(unflatten(flat), None, jnp.asarray(tokens))
    with torch.no_grad():
        router = model(torch.tensor(tokens), output_router_logits=True).router_logits
    want = float(loss_func(router, experts, k))
    assert stats.shape[0] == len(router)
    assert float(moe.balance_loss(cfg, stats)) == pytest.approx(want, rel=1e-5)
    return len(router)
