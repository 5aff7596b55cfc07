"""The router's precision under ``--bf16`` (issue 47): its logits, softmax and top-k are float32 whatever
the compute dtype (``model.moe``: ``upcast`` before the matmul), so bf16 rounding never decides a choice."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from meshlm.model import moe
from meshlm.model.config import get_config
from meshlm.parallel.context import Parallel
from meshlm.sharding.spmd import with_compute_dtype

CFG = get_config("tiny-mixtral")


def _router_inputs(d: int, e: int, k: int):
    """(xn [1, 2, D], router [D, E]), every value exact in bf16. Token 0 sees logit 1 for every expert
    but expert k, whose logit is 1 + 2^-10: in float32 it is the first choice, in bf16 (one ulp at 1
    is 2^-7) it rounds to 1 and the tie goes to experts 0..k-1. Token 1: random values, whose bf16
    logits are off by ~2^-9 relative."""
    rng = np.random.default_rng(0)
    router = np.zeros((d, e), np.float32)
    router[0] = 1.0
    router[1, k] = 2.0**-10
    router[2:] = rng.normal(size=(d - 2, e))
    x = np.zeros((1, 2, d), np.float32)
    x[0, 0, :2] = 1.0
    x[0, 1] = rng.normal(size=d)
    bf = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))
    return bf(x), bf(router)


def test_router_logits_and_choices_are_float32_under_bf16(monkeypatch):
    """Mutant caught (issue 47, round 5): the router's matmul in the compute dtype, i.e. in
    ``MoE.__call__`` ``logits = upcast(xn) @ upcast(router)`` planted as ``logits = xn @ router`` (or
    ``(xn @ router).astype(jnp.float32)``): under bf16 the logits round before softmax and top-k."""
    e, k = CFG.n_experts, CFG.experts_per_token
    seen = {}

    def spy(logits, *args):
        seen["logits"], seen["routed"] = logits, route(logits, *args)
        return seen["routed"]

    route = moe.route
    monkeypatch.setattr(moe, "route", spy)
    fwd = hk.transform(lambda x: moe.MoE(cfg=CFG, par=Parallel(), stddev=0.02)(x)[0])
    x, router = _router_inputs(CFG.d_model, e, k)
    params = fwd.init(jax.random.key(0), x)
    params["moe/router"]["w"] = jnp.asarray(router)
    bf16 = with_compute_dtype(lambda p, xb: fwd.apply(p, None, xb), jnp.bfloat16)  # as --bf16 runs
    bf16(params, jnp.asarray(x, jnp.bfloat16))
    logits = seen["logits"]
    assert logits.dtype == jnp.float32
    want = np.einsum("btd,de->bte", x.astype(np.float64), router.astype(np.float64))  # the bf16 values
    np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-6, atol=1e-6)  # bf16 rounding: ~4e-3
    ids = seen["routed"][2]  # the choices the layer made
    assert ids[0, 0].tolist() == [k, *range(k - 1)]  # the 2^-10 lead decides: expert k first
