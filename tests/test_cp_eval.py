"""``meshlm eval --cp``: the per-token losses gathered back over cp, every token once and in order,
equal to eval without cp (the same weights and data)."""

from __future__ import annotations

import numpy as np
import pytest

from meshlm.data.stream import TokenStream
from meshlm.data.tokenizer_files import load_tokenizer
from meshlm.model.config import get_config
from meshlm.parallel.layout import Layout
from meshlm.parallel.placement import put_global, to_host
from meshlm.train.evaluation import evaluate_stream
from meshlm.train.step import init_model


@pytest.mark.parametrize("strategy", ["ring", "allgather"])
def test_eval_over_cp_equals_eval_without(strategy):
    """tiny-lm (4 heads, mp 2) on 1x2 + CP2 and on 1x2: 3.x windows of 16 (the last partial), the same
    per-token losses in the same order to 1e-6 relative."""
    cfg = get_config("tiny-lm").replace(attention="blockwise", attn_block=4)
    plain, cp = Layout(1, 2), Layout(1, 2, cp=2, cp_strategy=strategy)
    params, _ = init_model(cfg, plain, seed=0)
    host = {m: {n: to_host(x) for n, x in leaves.items()} for m, leaves in params.items()}
    on_cp = {
        m: {n: put_global(host[m][n], x.sharding.update(mesh=cp.mesh)) for n, x in leaves.items()}
        for m, leaves in params.items()
    }
    tokens = np.random.default_rng(0).integers(1, 256, 53).astype(np.int32)
    stream, tok = TokenStream(tokens, eod_id=0), load_tokenizer("bytes")
    run = lambda p, layout: evaluate_stream(
        cfg, p, layout, stream, tok, seq_len=16, batch_size=2, keep_per_token=True, progress=False
    )
    want, got = run(params, plain), run(on_cp, cp)
    assert got.tokens == want.tokens == len(got.per_token) == 53
    np.testing.assert_allclose(got.per_token, want.per_token, rtol=1e-6, atol=0)
    assert got.loss == pytest.approx(want.loss, rel=1e-6)
