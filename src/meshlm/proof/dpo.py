"""``meshlm verify --objective dpo``: DPO's step (``train.dpo``) proven equal to the unsharded
autodiff of its formula (``model.preference``) -- the chosen and rejected log-prob sums, the loss and
every gradient -- on the layout, in float64 at the proof's tolerance.

The problem: the model's own (``model_problem``: its specs, its plain unsharded reference model) on a
batch of pairs (rows 2i chosen, 2i + 1 rejected, one prompt shared by a pair) whose prompt and
completion lengths differ row by row, so a count or a row taken from the wrong place changes the
numbers; the policy and the reference are two different parameter sets (the reference a second
initialisation), so a reference computed with the policy's weights shows. The sharded program is
training's: the reference's per-target log-probs from the seam (``dpo.reference_logps``) on the
sharded model, then ``dpo_value_and_grad``. The reference program: one device, the plain model,
``jax.value_and_grad`` of the mean pair loss. With ``steps`` K, then K of training's AdamW steps
against the unsharded ones (``proof.dpo_steps``), every parameter and optimizer-state leaf compared.
The result is pretraining's ``proof.report.Report`` (its rows and ``--json``): the sums as the leaves
``dpo/chosen`` and ``dpo/rejected``, the gradients (and after steps the parameters and AdamW state) by
parameter path, the loss, the controls.

Controls (each planted in the sharded program only, run for its values; one whose traced program is the
honest one -- the inertness check of ``proof.inertness`` -- is skipped with that reason):
* the reference computed with the policy's weights (the frozen copy forgotten);
* chosen and rejected swapped in one data shard (its pairs' rows in the wrong order);
* the completion mask off by one (on the inputs' positions: the last prompt token counted).
"""

from __future__ import annotations

import contextlib
import dataclasses

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from meshlm.data.pairs import check_pair_batch
from meshlm.model import preference
from meshlm.model.params import flat_params
from meshlm.parallel.context import Parallel
from meshlm.parallel.placement import batch_sharding, put_global, to_host
from meshlm.proof.dpo_steps import DPOSteps, dpo_steps
from meshlm.proof.inertness import INERT, fingerprint
from meshlm.proof.lora import base_kept, lora_problem, tolerance_factor
from meshlm.proof.prover import TOLERANCE
from meshlm.proof.report import LeafResult, Report, compare_into, skipped_row, worst
from meshlm.train import dpo


def pair_batch(vocab: int, rows: int, seq_len: int, seed: int) -> dict:
    """A host batch of ``rows // 2`` pairs: {"inputs", "targets", "completion_mask"} [B, T]. A pair's
    rows share the prompt; the prompt and the completions' lengths differ between rows (a completion
    may run to the row's end or stop before padding)."""
    rng = np.random.default_rng([seed, 0xD90])
    tokens = rng.integers(0, vocab, size=(rows, seq_len + 1), dtype=np.int32)
    mask = np.zeros((rows, seq_len), np.uint8)
    for pair in range(rows // 2):
        prompt = int(rng.integers(1, seq_len - 1))  # the completion's first token is at position prompt
        tokens[2 * pair + 1, :prompt] = tokens[2 * pair, :prompt]
        for row in (2 * pair, 2 * pair + 1):
            end = int(rng.integers(prompt + 1, seq_len + 2))  # one past the completion's last token
            mask[row, prompt - 1 : end - 1] = 1  # target t is token t + 1
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], preference.COMPLETION_MASK: mask}


def _frozen(params, reference):
    """The weights the reference seam runs: the frozen ones (a control plants the policy's)."""
    return reference


def _micro_batches(v, accum: int):
    """[B, ...] -> [A, B / A, ...]: micro-batch a the rows [a B / A, (a + 1) B / A), whole pairs (as
    ``data.pairs.PairBatcher`` deals them; a control plants a pair's rows in two micro-batches)."""
    return v.reshape(accum, -1, *v.shape[1:])


def _accumulated(cfg, layout, specs, beta: float, loss: str, accum: int, values_only: bool):
    """fn(params, ref params, batch) of training's step with ``accum`` micro-batches: the loss and
    gradients ``optim.accumulate``'s; chosen and rejected the validation program's on the whole batch."""
    from meshlm.train.optim import accumulate

    logps = dpo.per_token_logps(cfg.replace(z_loss=0.0), layout, specs)
    step = dpo.dpo_value_and_grad(cfg, layout, specs, beta=beta, loss=loss, accum=accum, fill=float("nan"))
    values = dpo.dpo_value(logps, beta, loss)

    def fn(params, ref_params, batch):
        batch = {
            **batch,
            preference.REF_LOGPS: dpo.reference_logps(logps, _frozen(params, ref_params))(batch),
        }
        chosen, rejected = preference.pairs(values(params, batch)[3])
        micro = jax.tree.map(lambda v: _micro_batches(v, accum), batch)
        if values_only:  # a control's run: the micro-batches' mean loss, no gradient pass
            losses = [values(params, jax.tree.map(lambda v, a=a: v[a], micro))[0] for a in range(accum)]
            return {"chosen": chosen, "rejected": rejected, "loss": sum(losses) / accum}
        (value, _), grads = accumulate(step, params, micro, accum)
        return {"chosen": chosen, "rejected": rejected, "loss": value}, grads

    return fn


def sharded_program(cfg, layout, specs, beta: float, loss: str, values_only: bool = False, accum: int = 1):
    """fn(params, reference params, batch) -> ({"chosen", "rejected", "loss"}, grads), training's;
    ``values_only``: the values of training's validation program (no gradient pass: a control's run);
    ``accum``: gradient accumulation over that many micro-batches (``_accumulated``)."""
    if accum > 1:
        return _accumulated(cfg, layout, specs, beta, loss, accum, values_only)
    logps = dpo.per_token_logps(cfg.replace(z_loss=0.0), layout, specs)
    step = dpo.dpo_value_and_grad(cfg, layout, specs, beta=beta, loss=loss, sums=True, fill=float("nan"))
    values = dpo.dpo_value(logps, beta, loss)

    def fn(params, ref_params, batch):
        ref = dpo.reference_logps(logps, _frozen(params, ref_params))(batch)
        if values_only:
            loss_value, _, _, sums = values(params, {**batch, preference.REF_LOGPS: ref})
            chosen, rejected = preference.pairs(sums)
            return {"chosen": chosen, "rejected": rejected, "loss": loss_value}
        (value, metrics), grads = step(params, {**batch, preference.REF_LOGPS: ref})
        chosen, rejected = preference.pairs(metrics["sums"])  # the step's own sums
        return {"chosen": chosen, "rejected": rejected, "loss": value}, grads

    return fn


def reference_program(plain_cfg, beta: float, loss: str):
    """The unsharded fn(params, reference params, batch): the formula differentiated by JAX."""
    apply = dpo.per_token_logps(plain_cfg.replace(z_loss=0.0), None)

    def fn(params, ref_params, batch):
        mask = batch[preference.COMPLETION_MASK]
        reference = preference.sequence_logps(apply(ref_params, batch), mask)
        lengths = jnp.sum(mask, axis=-1)

        def objective(p):
            policy = preference.sequence_logps(apply(p, batch), mask)
            return preference.dpo_loss(policy, reference, lengths, beta, loss), policy

        (value, policy), grads = jax.value_and_grad(objective, has_aux=True)(params)
        chosen, rejected = preference.pairs(policy)
        return {"chosen": chosen, "rejected": rejected, "loss": value}, grads

    return fn


# Controls: (name, plant) where plant() is a context manager active while the sharded program traces.
@contextlib.contextmanager
def _planted(module, name, value):
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def _swap_one_shard(shard_rows: int):
    def wrap(fn):  # fn: ``dpo.dpo_value``'s program, whose rows arrive swapped
        def swapped(params, batch):
            order = np.arange(batch["inputs"].shape[0])
            first = order[: shard_rows - shard_rows % 2].reshape(-1, 2)[:, ::-1].reshape(-1)
            order[: first.size] = first
            return fn(params, {k: v[order] for k, v in batch.items()})

        return swapped

    return wrap


def _mask_off_by_one(batch):
    mask = batch[preference.COMPLETION_MASK]
    return jnp.concatenate([mask[:, 1:], jnp.zeros_like(mask[:, :1])], axis=-1)  # on the inputs


def _pair_split(v, accum: int):
    """The rows dealt out as ``data.device_batches`` deals text rows (row r·A + a to micro-batch a): a
    pair's chosen and rejected in two micro-batches."""
    return jnp.swapaxes(v.reshape(-1, accum, *v.shape[1:]), 0, 1)


def dpo_controls(layout, rows: int, accum: int = 1):
    """(name, plant) of each control on ``layout`` for a batch of ``rows``: the swap takes the first data
    shard's pairs (its first pair where a shard holds one row); with ``accum`` > 1 also a pair's rows
    dealt to two micro-batches. (Each micro-batch holds B / A rows, so the mean of the micro-batches'
    means is the mean over the step's pairs: SFT's "loss divided per micro-batch" cannot differ here.)"""
    shard_rows = max(rows // layout.dp, 2)  # dp counts every data shard (with ep: dp x ep)
    import meshlm.proof.dpo as here

    swap = _swap_one_shard(int(shard_rows))
    real = dpo.dpo_value
    return (
        (
            "DPO reference computed with the policy's weights",
            lambda: _planted(here, "_frozen", lambda p, r: p),
        ),
        (
            "DPO chosen and rejected swapped in one data shard",
            lambda: _planted(dpo, "dpo_value", lambda *a, **k: swap(real(*a, **k))),
        ),
        (
            "DPO completion mask off by one (a prompt token counted)",
            lambda: _planted(dpo, "completion_mask", _mask_off_by_one),
        ),
    ) + (
        (
            (
                "DPO pair's rows in two accumulation micro-batches",
                lambda: _planted(here, "_micro_batches", _pair_split),
            ),
        )
        if accum > 1
        else ()
    )


def _values(out) -> dict:
    """A program's chosen and rejected sums as the proof's leaves ``dpo/chosen``, ``dpo/rejected``."""
    return {"dpo": {"chosen": out["chosen"], "rejected": out["rejected"]}}


def _into(report: Report, results: dict, loss: LeafResult, sharded, expected) -> None:
    """Fold the sharded (values, grads) against the reference's into ``results`` and ``loss``."""
    (vs, gs), (vr, gr) = sharded, expected
    compare_into(results, _values(vs), _values(vr), report.rtol, report.atol)
    compare_into(results, gs, gr, report.rtol, report.atol)
    loss.update(to_host(vs["loss"]), vr["loss"], report.rtol, report.atol)
    report.loss_sharded, report.loss_reference = float(to_host(vs["loss"])), float(vr["loss"])


def _control_row(name: str, got, expected, rtol, atol) -> dict:
    """A control's row as ``control_runs.run_control`` gives one: detected where a value differs."""
    results: dict[str, LeafResult] = {}
    compare_into(
        results,
        {**_values(got), "loss": {"value": got["loss"]}},
        {**_values(expected), "loss": {"value": expected["loss"]}},
        rtol,
        atol,
    )
    bad = [r.path for r in results.values() if not r.ok]
    margin = worst(*(r.tol_ratio for r in results.values()))
    finite = bool(np.isfinite(margin))
    how = f"{len(bad)} leaves differ, e.g. {bad[0]}" if bad else "no difference"
    by = "values" if finite else "non-finite values"
    return {"name": name, "detected": bool(bad), "how": how, "margin": margin if finite else None, "by": by}


def _controls(report: Report, make, args, expected: dict, layout, rows: int, accum: int) -> None:
    """Each control planted: skipped where its traced program is the honest one (``proof.inertness``),
    else run for its values (no gradient pass) and detected where one differs."""
    unplanted = fingerprint(make().trace(*args))
    for control, plant in dpo_controls(layout, rows, accum):
        with plant():  # traced whole (the inertness check); run for its values (no gradient pass)
            if fingerprint(make().trace(*args)) == unplanted:
                report.controls.append(skipped_row(control, INERT))
                continue
            got = make(values_only=True)(*args)
        report.controls.append(_control_row(control, got, expected, report.rtol, report.atol))


def prove_dpo(
    cfg,
    name: str,
    layout,
    rows: int,
    seq_len: int,
    seed: int = 0,
    *,
    beta=0.1,
    loss="sigmoid",
    dtype=None,
    load_params=None,
    accum: int = 1,
    steps: int = 0,
    opt_dtype: str = "float32",
) -> Report:
    """The proof on ``layout`` (see the module doc), a ``proof.report.Report`` (pretraining's rows and
    ``--json``); ``accum``: the sharded step accumulates over that many micro-batches of whole pairs
    (the reference: one mean over the pairs); ``steps``: K AdamW steps after it (``dpo_steps``), their
    moments stored in ``opt_dtype``."""
    from meshlm.proof.problem import model_problem
    from meshlm.sharding.rules import init_sharded

    dpo.check_dpo(cfg)  # what DPO's training refuses (experts, --doc-mask, --lora-dropout) is not proven
    check_pair_batch(rows)
    dtype = dtype or jnp.float64
    rtol, atol = TOLERANCE[jnp.dtype(dtype).name]
    problem = dataclasses.replace(model_problem(cfg, name, layout, rows, seq_len, seed), opt_dtype=opt_dtype)
    init = hk.transform(problem.build_loss(Parallel())).init
    example = jax.tree.map(jnp.asarray, problem.batch)
    made = [
        init_sharded(
            init, jax.random.PRNGKey(s), example, specs_fn=problem.specs_fn, mesh=layout.mesh, dtype=dtype
        )
        for s in (seed, seed + 1)  # the policy; the reference: another initialisation
    ]
    (params, specs), (ref_params, _) = made
    if load_params is not None:  # a checkpoint's weights as the policy (the reference stays an init)
        params = jax.tree.map(lambda p: p.astype(dtype), load_params(layout))
    elif cfg.lora_rank:  # the policy's A and B drawn: B = 0 would leave A's gradient 0 (``proof.lora``)
        params = lora_problem(problem).prepare_params(params)
    factor = tolerance_factor(cfg, params)  # adapters: rtol times their kappa (``proof.lora``)
    rtol *= factor
    host = pair_batch(cfg.vocab_size, rows, seq_len, seed)
    batch = {k: put_global(v, batch_sharding(layout, 1)) for k, v in host.items()}
    one = lambda p: jax.device_put(problem.to_reference(jax.tree.map(to_host, p)), jax.local_devices()[0])
    reference = jax.jit(reference_program(problem.reference_cfg or cfg, beta, loss))
    values, grads = reference(one(params), one(ref_params), jax.device_put(host, jax.local_devices()[0]))
    expected = (jax.tree.map(np.asarray, values), problem.from_reference(jax.tree.map(np.asarray, grads)))
    report = Report(
        config=f"{name} (DPO: {loss} loss, beta {beta:g})",
        dp=layout.dp,
        mp=layout.mp,
        steps=steps,
        dtype=jnp.dtype(dtype).name,
        rtol=rtol,
        atol=atol,
    )
    report.extra["mesh"] = layout.label() + (f", {accum} micro-batches" if accum > 1 else "")
    if factor != 1:
        report.extra["lora_tolerance_factor"] = factor
    results, loss_check = {}, LeafResult(path="loss", shape=(), spec="P()")
    args = (params, ref_params, batch)
    make = lambda values_only=False: jax.jit(
        sharded_program(cfg, layout, specs, beta, loss, values_only, accum)
    )
    _into(report, results, loss_check, make()(*args), expected)
    if steps:  # fresh pairs each step, as the pretraining proof's steps take fresh batches
        run = DPOSteps(
            cfg,
            problem,
            layout,
            specs,
            beta,
            loss,
            reference_program(problem.reference_cfg or cfg, beta, loss),
        )
        batches = [pair_batch(cfg.vocab_size, rows, seq_len, seed + 1000 + k) for k in range(steps)]
        trained = dpo_steps(run, results, loss_check, params, ref_params, batches, expected[1], rtol, atol)
        report.checks += base_kept(cfg, params, trained)
    for path, spec in flat_params(specs).items():  # the spec column (the rows' other leaves: P())
        if path in results:
            results[path].spec = str(spec)
    report.params, report.loss_ok = list(results.values()), loss_check.ok
    _controls(report, make, args, expected[0], layout, rows, accum)
    return report
