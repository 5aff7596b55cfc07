"""AdamW updates its moments in place: the compiled step holds no copy of the optimizer state, and its
temporaries are the gradients alone, below the same step guarded by a select (issue 63.1b); the
update equals optax's, and a non-finite step keeps the state exactly."""

import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from meshlm.errors import CheckpointError
from meshlm.model.config import get_config
from meshlm.model.transformer import param_shapes
from meshlm.parallel.layout import Layout
from meshlm.parallel.mesh import make_mesh
from meshlm.parallel.placement import batch_sharding, bytes_per_device
from meshlm.sharding.rules import model_specs, shardings
from meshlm.train.config import TrainConfig
from meshlm.train.optim import OptimConfig, adamw, clip_by_global_norm, make_step
from meshlm.train.resume import check_resumable
from meshlm.train.step import abstract_opt_state, sharded_step

OCFG = OptimConfig(warmup_steps=2, total_steps=10)


def state_copies(compiled, first: int, count: int) -> list[str]:
    """Copies of the optimizer state's arrays (its scalar counters aside: 4 bytes) in the compiled
    step: the entry's of its arguments ``first`` .. ``first + count - 1``, and those inside a
    conditional's branches (the guard's ``lax.cond``, whose operands the state is) of a value of a
    state argument's shape and dtype."""
    hlo = compiled.as_text()
    entry = hlo[hlo.index("\nENTRY") :]
    params = {
        m[1]: (int(m[3]), m[2])
        for m in re.finditer(r"%(\S+) = (\S+?)(?:\{[^}]*\})? parameter\((\d+)\)", entry)
    }
    state = {n: t for n, (i, t) in params.items() if first <= i < first + count and not t.endswith("[]")}
    found = [n for n in re.findall(r"= \S+ copy\(%([^)\s]+)\)", entry) if n in state]
    types = set(state.values())
    for branch in set(re.findall(r"branch_computations=\{([^}]*)\}", entry)):
        for name in re.findall(r"%([\w.\-]+)", branch):
            body = hlo[hlo.index(f"\n%{name} ") :].split("\n}\n", 1)[0]
            copied = re.findall(r"= (\S+?)(?:\{[^}]*\})? copy\(", body)
            found += [f"{name}: {t}" for t in copied if t in types]
    return found


def _toy():
    """A params-dominated problem: two weights, a batch of 2 rows (activations ~1% of the weights)."""
    rng = np.random.default_rng(0)
    params = {"a": {"w": jnp.asarray(rng.normal(size=(128, 256)), jnp.float32)}}
    params["b"] = {"w": jnp.asarray(rng.normal(size=(256, 128)), jnp.float32) * 0.1}
    x = {"inputs": jnp.asarray(rng.normal(size=(2, 128)), jnp.float32)}  # [B, D]
    loss = lambda p, b: jnp.sum(jnp.tanh(jnp.tanh(b["inputs"] @ p["a"]["w"]) @ p["b"]["w"]))
    grad = jax.value_and_grad(loss)
    return params, x, grad


def _select_guarded(grad, opt):
    """The step as it was: one ``optimizer.update``, then ``where(finite, new, old)``."""

    def step(params, state, x):
        loss, grads = grad(params, x)
        grads, norm = clip_by_global_norm(grads, OCFG.clip_norm)
        updates, new_state = opt.update(grads, state, params)
        finite = jnp.isfinite(loss) & jnp.isfinite(norm)
        keep = lambda new, old: jnp.where(finite, new, old)
        return jax.tree.map(keep, (optax.apply_updates(params, updates), new_state), (params, state))

    return step


@pytest.mark.parametrize("opt_dtype", ["float32", "bf16"])
def test_the_step_copies_no_moment_and_saves_two_parameters_bytes(opt_dtype):
    params, x, grad = _toy()
    ocfg = dataclasses.replace(OCFG, opt_dtype=opt_dtype)
    opt = adamw(ocfg, params)
    state = opt.init(params)
    n_params, n_state = len(jax.tree.leaves(params)), len(jax.tree.leaves(state))
    compile_ = lambda fn: jax.jit(fn, donate_argnums=(0, 1)).lower(params, state, x).compile()
    ours = compile_(lambda p, s, x: make_step(grad, opt, ocfg)(p, s, x)[:2])
    assert state_copies(ours, n_params, n_state) == []
    assert ours.memory_analysis().temp_size_in_bytes < 1.1 * bytes_per_device(params)  # the gradients
    if opt_dtype == "bf16":  # (the step reads the stored moments: no copy even under a select)
        return
    select = compile_(_select_guarded(grad, opt))
    assert state_copies(select, n_params, n_state), "the select-guarded step should copy the moments"
    # The copies are 2 x the parameters' bytes; XLA CPU makes each just before its leaf's update, as
    # the gradients already applied die, so here (two leaves) the peak falls by one parameters' bytes:
    # temporaries 2 P -> P (the gradients alone). llama-100m (scripts/step_memory.py): 1158 -> 499 MB.
    saved = select.memory_analysis().temp_size_in_bytes - ours.memory_analysis().temp_size_in_bytes
    assert saved >= 0.9 * bytes_per_device(params), saved


def test_the_model_step_on_a_mesh_copies_no_optimizer_state():
    """meshlm's own step (tiny-llama on a 1 x 2 mesh, compiled ahead of time): no copy of any
    optimizer-state array."""
    cfg, mesh = get_config("tiny-llama"), make_mesh(1, 2)
    layout, shapes = Layout.of(mesh), param_shapes(cfg)
    specs = model_specs(cfg, shapes, layout)
    sh = shardings(specs, mesh)
    params = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, jnp.float32, sharding=h), shapes, sh)
    step, opt = sharded_step(cfg, OCFG, layout, specs, params)
    state = abstract_opt_state(opt, params, specs, mesh)
    batch = {k: jax.ShapeDtypeStruct((2, 8), jnp.int32, sharding=batch_sharding(layout, 1)) for k in "it"}
    batch = {"inputs": batch["i"], "targets": batch["t"]}
    compiled = step.lower(params, state, batch).compile()
    assert state_copies(compiled, len(jax.tree.leaves(params)), len(jax.tree.leaves(state))) == []


def test_the_update_is_optaxs_and_a_non_finite_step_keeps_everything():
    params, x, grad = _toy()
    opt = adamw(OCFG, params)
    state = opt.init(params)
    step = jax.jit(make_step(grad, opt, OCFG))
    new, new_state, metrics = step(params, state, x)
    grads, _ = optax.clip_by_global_norm(OCFG.clip_norm).update(grad(params, x)[1], optax.EmptyState())
    updates, want_state = opt.update(grads, state, params)
    want = optax.apply_updates(params, updates)
    assert bool(metrics["ok"])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), new, want)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9), new_state, want_state)
    kept, kept_state, bad = step(new, new_state, {"inputs": x["inputs"].at[0, 0].set(jnp.nan)})
    assert not bool(bad["ok"])
    jax.tree.map(np.testing.assert_array_equal, (kept, kept_state), (new, new_state))


def test_one_device_step_has_no_collective():
    """On one device meshlm's step runs its loss unsharded (``spmd.sharded_value_and_grad``): no
    all-reduce over size-1 axes, whose second gradient buffer was 0.35 x the parameters' bytes of
    llama-100m's temporaries (scripts/step_memory.py)."""
    cfg, mesh = get_config("tiny-llama"), make_mesh(1, 1)
    layout, shapes = Layout.of(mesh), param_shapes(cfg)
    specs = model_specs(cfg, shapes, layout)
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), shapes)
    step, opt = sharded_step(cfg, OCFG, layout, specs, params)
    batch = {k: jax.ShapeDtypeStruct((2, 8), jnp.int32) for k in ("inputs", "targets")}
    hlo = step.lower(params, jax.eval_shape(opt.init, params), batch).compile().as_text()
    assert "all-reduce" not in hlo and "copy(%opt_state" not in hlo


def test_bf16_moments_are_stored_rounded_and_the_step_is_of_them():
    """--opt-dtype bf16: mu and nu stored in bfloat16, each the float32 moment rounded to nearest;
    the step is AdamW's of the moments as stored, computed in float32 (written out here in numpy)."""
    params, x, grad = _toy()
    ocfg = dataclasses.replace(OCFG, opt_dtype="bf16", clip_norm=0.0, weight_decay=0.0)
    opt = adamw(ocfg, params)
    state = opt.init(params)
    new, new_state, _ = jax.jit(make_step(grad, opt, ocfg))(params, state, x)
    g = np.asarray(grad(params, x)[1]["a"]["w"], np.float32)
    mu, nu = new_state[0].mu["a"]["w"], new_state[0].nu["a"]["w"]
    assert mu.dtype == nu.dtype == jnp.bfloat16
    want_mu = jnp.asarray(np.float32(0.1) * g, jnp.bfloat16)  # the moments start at 0
    want_nu = jnp.asarray(np.float32(0.05) * g * g, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(mu, np.float32), np.asarray(want_mu, np.float32))
    np.testing.assert_array_equal(np.asarray(nu, np.float32), np.asarray(want_nu, np.float32))
    m_hat = np.asarray(mu, np.float32) / np.float32(0.1)
    v_hat = np.asarray(nu, np.float32) / np.float32(0.05)
    lr = np.float32(optax.warmup_cosine_decay_schedule(0.0, ocfg.lr, 2, 10, ocfg.lr * 0.1)(0))
    step = -lr * (m_hat / (np.sqrt(v_hat) + np.float32(ocfg.eps)))
    np.testing.assert_allclose(np.asarray(new["a"]["w"]) - np.asarray(params["a"]["w"]), step, atol=1e-6)


def test_resuming_with_another_opt_dtype_is_refused():
    """The checkpoint's moments are of its run's dtype: a resume with another is one line (a run
    from before --opt-dtype stored float32 moments)."""
    meta = {"train_config": TrainConfig().to_dict()}
    with pytest.raises(CheckpointError, match="opt_dtype: saved 'float32', now 'bf16'"):
        check_resumable(meta, TrainConfig(opt_dtype="bf16"), Path("runs/x"))
    del meta["train_config"]["opt_dtype"]
    with pytest.raises(CheckpointError, match="opt_dtype: saved 'float32', now 'bf16'"):
        check_resumable(meta, TrainConfig(opt_dtype="bf16"), Path("runs/x"))
    check_resumable(meta, TrainConfig(), Path("runs/x"))


# slow: a proof (its cost); bf16 moments' rounding and the step taken of them run quick in
# test_bf16_moments_are_stored_rounded_and_the_step_is_of_them
@pytest.mark.slow
def test_verify_proves_bf16_moments_sharded_equal_unsharded():
    """``meshlm verify --steps K --opt-dtype bf16 --x64``'s path: tiny on 2x2, 2 training steps with
    bfloat16 moments (float64 arithmetic), sharded == unsharded to 1e-12, moments compared too."""
    from meshlm.parallel.mesh import make_mesh
    from meshlm.proof import model_problem, verify

    problem = dataclasses.replace(model_problem(get_config("tiny"), "tiny", 2, 4, 16), opt_dtype="bf16")
    with jax.enable_x64(True):
        report = verify(problem, make_mesh(2, 2), steps=2, dtype=jnp.float64, controls=())
    assert report.ok and max(p.max_rel_err for p in report.params) <= 1e-12


def test_a_non_finite_step_keeps_what_the_balance_moves_too():
    """A mixture of experts' selection bias moves after AdamW (``make_step``'s ``balance``): on a
    non-finite step it is kept as it was, like the rest of the state."""
    params, x, _ = _toy()

    def grad(p, b):  # value (loss, aux): the aux a routing statistic, as a mixture of experts' loss
        loss = lambda p: (jnp.sum(jnp.tanh(b["inputs"] @ p["a"]["w"])), jnp.ones(()))
        return jax.value_and_grad(loss, has_aux=True)(p)

    balance = lambda p, aux: {**p, "b": {"w": p["b"]["w"] + aux}}  # moves b alone
    opt = adamw(OCFG, params)
    step = jax.jit(make_step(grad, opt, OCFG, balance=balance))
    new, _, ok = step(params, opt.init(params), x)
    assert bool(ok["ok"]) and not np.array_equal(new["b"]["w"], params["b"]["w"])
    kept, _, bad = step(params, opt.init(params), {"inputs": x["inputs"].at[0, 0].set(jnp.nan)})
    assert not bool(bad["ok"])
    jax.tree.map(np.testing.assert_array_equal, kept, params)
