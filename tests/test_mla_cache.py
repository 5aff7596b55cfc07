"""Generation's latent KV cache for multi-head latent attention (``generate.cache``, ``model.mla``): per
token and layer it holds the normed latent (kv_lora_rank) and the rotated rotary key (qk_rope_head_dim)
only, the up-projection applied to the cache at each step. Teacher-forced cached logits of the tiny
DeepSeek-V3 (MLA, YaRN, a dense layer then DeepSeek's MoE) equal its full forward in float64 with the
latent replicated over mp (1x2) and with the prefill over cp (cp 2 x mp 2); the cache's size is r + R
per token and layer (DeepSeek-V3: 576 against full K/V's 40960)."""

import haiku as hk
import jax
import numpy as np
import pytest
from test_generate import host_params

from meshlm.generate.cache import cache_bytes, cache_shapes
from meshlm.generate.generator import Generator, logits_with_cache
from meshlm.model.config import get_config
from meshlm.model.transformer import logits_fn
from meshlm.parallel.context import Parallel
from meshlm.parallel.layout import Layout

TOKENS = np.random.default_rng(3).integers(1, 64, (2, 40))  # teacher-forced rows
LENGTHS = np.array([5, 30])  # prefilled lengths; the rest fed one decode step at a time


def _cached_logits_equal_the_full_forward(cases):
    cfg = get_config("tiny-deepseek-v3")
    with jax.enable_x64(True):
        params = jax.tree.map(lambda x: np.asarray(x, np.float64), host_params("tiny-deepseek-v3"))
        full = np.asarray(jax.jit(hk.transform(logits_fn(cfg, Parallel())).apply)(params, None, TOKENS))
        for name, layout, cp in cases:
            gen = Generator(cfg, params, layout, eod=None, prefill_cp=cp)
            got = logits_with_cache(gen, TOKENS, LENGTHS)
            for b, n in enumerate(LENGTHS):
                want = full[b, n - 1 :, : cfg.vocab_size]
                worst = float(np.max(np.abs(got[b] - want)) / np.max(np.abs(want)))
                assert worst <= 1e-12, (name, b, worst)


def test_latent_cache_logits_equal_the_full_forward_in_float64():
    _cached_logits_equal_the_full_forward((("1x2", Layout(mp=2), False),))


# slow: the same latent cache with its prefill over cp (its cost: a second generator compiled); a prefill
# over cp equal to one without is quick in tests/test_generate_cp.py, the latent cache quick above
@pytest.mark.slow
def test_latent_cache_with_the_prefill_over_cp_equals_the_full_forward_in_float64():
    _cached_logits_equal_the_full_forward((("cp2 x mp2", Layout(mp=2, cp=2), True),))


def test_latent_cache_holds_the_latent_and_the_rotary_key_only():
    tiny = get_config("tiny-deepseek-v3")  # r 32, R 8; 8 heads of 24 (q/k) and 16 (v)
    # flat [L, B, S, Kc * width], a copy per mp
    assert cache_shapes(tiny, 2, 4, 64) == {"k": (3, 4, 64, 2 * 32), "v": (3, 4, 64, 2 * 8)}
    size = cache_bytes(tiny, Layout(dp=2, mp=2), 4, 64, np.float32)
    assert size["per_device"] == 3 * (4 // 2) * 64 * (32 + 8) * 4  # L x B/dp x S x (r + R) x 4 bytes
    assert size["per_token_layer"] == {"values": 40, "full_kv": 8 * (24 + 16), "ratio": 8.0}
    v3 = cache_bytes(get_config("deepseek-v3"), Layout(), 1, 16)["per_token_layer"]
    assert v3 == {"values": 576, "full_kv": 128 * (192 + 128), "ratio": 71.11}
    llama = cache_bytes(get_config("tiny-llama"), Layout(), 1, 16)["per_token_layer"]
    assert llama == {"values": 2 * 4 * 8}  # K and V: 2 x 4 KV heads x 8
