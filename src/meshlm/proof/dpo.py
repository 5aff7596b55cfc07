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
``jax.value_and_grad`` of the mean pair loss.

Controls (each planted in the sharded program only; each must change its traced program -- the
inertness check of ``proof.inertness`` -- and its results):
* the reference computed with the policy's weights (the frozen copy forgotten);
* chosen and rejected swapped in one data shard (its pairs' rows in the wrong order);
* the completion mask off by one (on the inputs' positions: the last prompt token counted).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from meshlm.errors import VerifierError
from meshlm.model import preference
from meshlm.parallel.context import Parallel
from meshlm.parallel.placement import batch_sharding, put_global, to_host
from meshlm.proof.inertness import fingerprint
from meshlm.proof.prover import TOLERANCE
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


@dataclass
class DPOReport:
    label: str
    rtol: float
    atol: float
    leaves: dict = field(default_factory=dict)  # name -> (max abs err, max |r|, ok)
    controls: dict = field(default_factory=dict)  # name -> detected
    inert: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(ok for *_, ok in self.leaves.values()) and all(self.controls.values()) and not self.inert

    def to_json(self) -> dict:
        leaves = {k: {"max_abs_err": e, "max_abs_ref": m, "ok": ok} for k, (e, m, ok) in self.leaves.items()}
        return {
            "label": self.label,
            "ok": self.ok,
            "leaves": leaves,
            "controls": self.controls,
            "inert": self.inert,
        }

    def lines(self) -> list[str]:
        out = [
            f"meshlm verify --objective dpo: {self.label}; tolerance "
            f"max|s-r| <= {self.atol:g} + {self.rtol:g}*max|r|"
        ]
        out += [
            f"  {k:<40} max abs err {e:.3g} (max|r| {m:.3g})  {'ok' if ok else 'DIFFERS'}"
            for k, (e, m, ok) in self.leaves.items()
        ]
        out += [f"  control: {k:<56} {'detected' if d else 'NOT DETECTED'}" for k, d in self.controls.items()]
        out += [f"  prover bug: control {k!r} changes nothing on this layout" for k in self.inert]
        out.append("OK: sharded == unsharded, every control detected" if self.ok else "FAIL")
        return out


def _compare(sharded, reference, rtol, atol) -> dict:
    out = {}
    flat = jax.tree_util.tree_flatten_with_path(sharded)[0]
    for (path, s), r in zip(flat, jax.tree.leaves(reference), strict=True):
        s, r = np.asarray(to_host(s), np.float64), np.asarray(r, np.float64)
        err, scale = float(np.max(np.abs(s - r))), float(np.max(np.abs(r)))
        keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        # (values, grads): "chosen", "loss", "rejected", "grad embed/embeddings", ...; values alone: theirs
        name = {"0": keys[-1], "1": "grad " + "/".join(keys[1:])}.get(keys[0], "/".join(keys))
        out[name] = (err, scale, bool(np.isfinite(err) and err <= atol + rtol * scale))
    return out


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
):
    """The proof on ``layout`` (see the module doc): a ``DPOReport``; ``accum``: the sharded step
    accumulates over that many micro-batches of whole pairs (the reference: one mean over the pairs)."""
    from meshlm.proof.problem import model_problem
    from meshlm.sharding.rules import init_sharded

    dpo.check_dpo(cfg)  # what DPO's training refuses (experts, --doc-mask, --lora-dropout) is not proven
    dtype = dtype or jnp.float64
    rtol, atol = TOLERANCE[jnp.dtype(dtype).name]
    problem = model_problem(cfg, name, layout, rows, seq_len, seed)
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
    host = pair_batch(cfg.vocab_size, rows, seq_len, seed)
    batch = {k: put_global(v, batch_sharding(layout, 1)) for k, v in host.items()}
    device = jax.local_devices()[0]
    one = lambda p: jax.device_put(problem.to_reference(jax.tree.map(to_host, p)), device)
    reference = jax.jit(reference_program(problem.reference_cfg or cfg, beta, loss))
    values, grads = reference(one(params), one(ref_params), jax.device_put(host, device))
    expected = (jax.tree.map(np.asarray, values), problem.from_reference(jax.tree.map(np.asarray, grads)))
    label = f"{name} on {layout.label()}, {loss} loss, beta {beta:g}" + (
        f", {accum} micro-batches" if accum > 1 else ""
    )
    report = DPOReport(label=label, rtol=rtol, atol=atol)
    args = (params, ref_params, batch)
    program = jax.jit(sharded_program(cfg, layout, specs, beta, loss, accum=accum))
    report.leaves = _compare(program(*args), expected, rtol, atol)
    unplanted = fingerprint(program.trace(*args))
    for control, plant in dpo_controls(layout, rows, accum):
        with plant():  # traced whole (the inertness check); run for its values (no gradient pass)
            planted = jax.jit(sharded_program(cfg, layout, specs, beta, loss, accum=accum))
            if fingerprint(planted.trace(*args)) == unplanted:  # a prover bug (``proof.inertness``)
                raise VerifierError(
                    f"prover bug: the control {control!r} changes nothing on {layout.label()} (its plant "
                    "reaches no code this configuration runs)"
                )
            got = _compare(
                jax.jit(sharded_program(cfg, layout, specs, beta, loss, True, accum))(*args),
                expected[0],
                rtol,
                atol,
            )
        report.controls[control] = not all(ok for *_, ok in got.values())
    return report
