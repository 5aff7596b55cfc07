"""The proof: a sharded computation equals the unsharded one, parameter by parameter.

``verify`` runs one Haiku loss (written with meshlm layers) twice on the same inputs and initial
parameters: sharded with ``shard_map`` on a (DP, MP) mesh, and unsharded under ``jit`` on one device.
It compares the loss and every parameter's gradient, and with ``steps=K`` every parameter and
optimizer-state leaf after each of K training steps. Then it runs planted faults (``controls``) and
requires each one to be detected, so a passing proof is known to be able to fail.

Error measure per leaf: max_abs_err = max|s - r|; max_rel_err = max|s - r| / max|r| (normwise).
A leaf passes when max_abs_err <= atol + rtol * max|r|.
"""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp

from meshlm.data.tokens import check_batch
from meshlm.model.params import flat_params
from meshlm.parallel.axes import DP, MP
from meshlm.parallel.context import Parallel
from meshlm.parallel.placement import bytes_per_device, put_global, to_host, total_bytes
from meshlm.parallel.rules import batch_sharding
from meshlm.parallel.spmd import reference_value_and_grad, sharded_value_and_grad
from meshlm.proof.controls import CONTROLS, Control, Where, per_shard_clip
from meshlm.proof.problem import Problem, random_batch
from meshlm.proof.report import LeafResult, Report, compare_into
from meshlm.train.optim import OptimConfig, adamw, clip_by_global_norm, make_step

# (rtol, atol), normwise. float32: summation order differs between layouts and Adam's division by
# sqrt(v) amplifies rounding in near-zero gradients over steps; float64 shows the result is exact.
TOLERANCE = {"float32": (2e-4, 1e-6), "float64": (1e-12, 1e-15)}


def _put(batch, mesh, accum: bool):
    """Host batch -> global arrays (each process supplies the rows of its own devices)."""
    sharding = batch_sharding(mesh, 2 if accum else 1)
    return {k: put_global(v, sharding) for k, v in batch.items()}


class _Runs:
    """The reference and sharded runs of one Problem on one mesh, sharing inputs and parameters."""

    def __init__(self, problem: Problem, mesh, dtype, seed: int):
        from meshlm.parallel.rules import init_sharded

        self.problem, self.mesh = problem, mesh
        self.device = jax.local_devices()[0]  # the reference runs on one device of this process
        init = hk.transform(problem.build_loss(Parallel())).init
        example = jax.tree.map(jnp.asarray, problem.batch)
        self.params, self.specs = init_sharded(
            init,
            jax.random.PRNGKey(seed),
            example,
            specs_fn=problem.specs_fn,
            mesh=mesh,
            dtype=dtype,
        )
        if problem.load_params is not None:  # e.g. a checkpoint: same specs, loaded onto this mesh
            self.params = jax.tree.map(lambda p: p.astype(dtype), problem.load_params(mesh))
        self.ref_params = jax.device_put(jax.tree.map(to_host, self.params), self.device)

    def grads(self, build_loss, par_cls=Parallel):
        fn = sharded_value_and_grad(build_loss, self.mesh, self.specs, par_cls)
        return jax.jit(fn)(self.params, _put(self.problem.batch, self.mesh, False))

    def reference_grads(self):
        """The unsharded loss and gradients (computed once: every control compares against them)."""
        if not hasattr(self, "_ref_grads"):
            fn = jax.jit(reference_value_and_grad(self.problem.build_loss))
            self._ref_grads = fn(self.ref_params, jax.device_put(self.problem.batch, self.device))
        return self._ref_grads

    def reference_train(self, ocfg: OptimConfig, batches) -> list:
        """The unsharded (params, opt_state, metrics) after each step, computed once per config."""
        key = (ocfg, len(batches))
        cache = self.__dict__.setdefault("_ref_train", {})
        if key not in cache:
            opt = adamw(ocfg, self.params)
            step = jax.jit(make_step(reference_value_and_grad(self.problem.build_loss), opt, ocfg))
            state, out = (self.ref_params, jax.jit(opt.init)(self.ref_params)), []
            for b in batches:
                *state, metrics = step(*state, jax.device_put(b, self.device))
                out.append((*state, metrics))
            cache[key] = out
        return cache[key]

    def train(self, ocfg: OptimConfig, batches, clip_fault: bool = False):
        """Yield ((params, opt_state, metrics) sharded, the same unsharded) after each step."""
        opt = adamw(ocfg, self.params)
        grad = sharded_value_and_grad(self.problem.build_loss, self.mesh, self.specs)
        clip = per_shard_clip(self.mesh, self.specs, ocfg.clip_norm) if clip_fault else None
        step = jax.jit(make_step(grad, opt, ocfg, clip))
        state = (self.params, jax.jit(opt.init)(self.params))
        accum = ocfg.accum_steps > 1
        for b, ref in zip(batches, self.reference_train(ocfg, batches), strict=True):
            *state, metrics = step(*state, _put(b, self.mesh, accum))
            yield (*state, metrics), ref


def _step_batches(problem: Problem, steps: int, accum: int, seed: int) -> list[dict]:
    b, t = problem.batch["inputs"].shape
    vocab = int(problem.batch["inputs"].max()) + 1 if problem.cfg is None else problem.cfg.vocab_size
    shape = (accum, b, t) if accum > 1 else (b, t)
    return [random_batch(vocab, shape, seed + 1000 + k) for k in range(steps)]


def default_optim(steps: int, ref_grad_norm: float) -> OptimConfig:
    """The proof's optimizer: warm-up and decay inside K steps, 2 micro-batches, weight decay, and a
    clip at a tenth of the initial gradient norm, so that clipping (and its norm) is exercised on every step
    (an inactive clip would hide a wrong norm; batches of the steps can have smaller norms than the first)."""
    return OptimConfig(
        lr=1e-2,
        warmup_steps=1,
        total_steps=max(steps, 2),
        weight_decay=0.1,
        clip_norm=0.1 * ref_grad_norm,
        accum_steps=2,
    )


def verify(
    problem: Problem,
    mesh,
    *,
    steps: int = 0,
    dtype=jnp.float32,
    seed: int = 0,
    ocfg: OptimConfig | None = None,
    controls: tuple[Control, ...] = CONTROLS,
) -> Report:
    """Prove ``problem`` sharded on ``mesh`` equals it unsharded; see the module docstring."""
    dname = jnp.dtype(dtype).name
    rtol, atol = TOLERANCE[dname]
    if problem.cfg is not None:
        check_batch(problem.batch, problem.cfg.vocab_size)
    report = Report(
        config=problem.name,
        dp=mesh.shape[DP],
        mp=mesh.shape[MP],
        steps=steps,
        dtype=dname,
        rtol=rtol,
        atol=atol,
    )
    runs = _Runs(problem, mesh, dtype, seed)
    (ls, gs), (lr, gr) = runs.grads(problem.build_loss), runs.reference_grads()
    report.loss_sharded, report.loss_reference = float(to_host(ls)), float(to_host(lr))
    loss_check = LeafResult(path="loss", shape=(), spec="P()")
    loss_check.update(ls, lr, rtol, atol)
    report.loss_ok = loss_check.ok
    results: dict[str, LeafResult] = {}
    compare_into(results, gs, gr, rtol, atol)
    if steps:
        ocfg = ocfg or default_optim(steps, float(clip_by_global_norm(gr, 0)[1]))
        batches = _step_batches(problem, steps, ocfg.accum_steps, seed)
        for (ps, ss, ms), (pr, sr, mr) in runs.train(ocfg, batches):
            compare_into(results, (ps, ss), (pr, sr), rtol, atol)
            loss_check.update(to_host(ms["loss"]), to_host(mr["loss"]), rtol, atol)
        report.loss_ok = loss_check.ok
    _fill_specs(results, runs.specs)
    report.params = list(results.values())
    report.extra["param_bytes_per_device"] = bytes_per_device(runs.params)
    report.extra["param_bytes_total"] = total_bytes(runs.params)
    where = Where(cfg=problem.cfg, dp=report.dp, mp=report.mp, has_row_bias=problem.has_row_bias)
    report.controls = [_run_control(c, runs, ocfg, rtol, atol) for c in controls if c.applies(where)]
    return report


def _fill_specs(results: dict[str, LeafResult], specs) -> None:
    for path, spec in flat_params(specs).items():
        if path in results:
            results[path].spec = str(spec)


def _run_control(control: Control, runs: _Runs, ocfg, rtol, atol) -> dict:
    """Run one planted fault sharded; detected when anything differs from the reference (or when
    JAX's varying-axis type check rejects the program outright)."""
    problem = runs.problem
    build = problem.build_loss
    if control.cfg_change is not None:
        build = problem.rebuild(control.cfg_change(problem.cfg))
    results: dict[str, LeafResult] = {}
    try:
        if control.per_shard_clip:
            (_, gr) = runs.reference_grads()
            ocfg = ocfg or default_optim(1, float(clip_by_global_norm(gr, 0)[1]))
            batches = _step_batches(problem, 1, ocfg.accum_steps, 0)
            for (ps, ss, _), (pr, sr, _) in runs.train(ocfg, batches, clip_fault=True):
                compare_into(results, (ps, ss), (pr, sr), rtol, atol)
        else:
            (ls, gs), (lr, gr) = runs.grads(build, control.par_cls), runs.reference_grads()
            compare_into(results, {"loss": {"value": ls}, **gs}, {"loss": {"value": lr}, **gr}, rtol, atol)
    except Exception as e:  # noqa: BLE001 - a rejected faulty program counts as detected
        return {
            "name": control.name,
            "detected": True,
            "how": f"rejected: {str(e).splitlines()[0]}",
        }
    bad = [r.path for r in results.values() if not r.ok]
    how = f"{len(bad)} leaves differ, e.g. {bad[0]}" if bad else "no difference"
    return {"name": control.name, "detected": bool(bad), "how": how}
