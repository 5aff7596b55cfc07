"""The pipeline proven: every schedule equal to the sequential model, and planted faults that must be caught.

``prove_pipeline`` runs the engine (``meshlm.parallel.pipeline``) with NaN in every bubble and compares
the loss, every parameter gradient and the input gradient with the sequential model on one device
(normwise relative error, as ``meshlm verify`` measures it). Then each control -- an engine with one hook
broken -- must differ from the reference by more than the tolerance (or not be finite):

* activations sent to the wrong stage (the forward ``ppermute`` direction reversed);
* one micro-batch's gradient dropped (its loss seeds no cotangent);
* the loss not divided by the number of micro-batches;
* layer chunks assigned to the wrong virtual stage (device d holding chunks d V .. d V + V - 1);
* a bubble's garbage reaching the result (no masking of bubble slots).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshlm.parallel.axes import PP
from meshlm.parallel.pipeline import Pipeline, pipeline_value_and_grad, sequential_value_and_grad
from meshlm.parallel.pipeline_schedule import PipelineConfig


class ReversedPermute(Pipeline):
    """Activations sent to the wrong stage: device d sends to d - 1."""

    def send_forward(self, x):
        return lax.ppermute(x, PP, [(b, a) for a, b in self.hops()])


class DroppedMicrobatch(Pipeline):
    """The last micro-batch's gradient dropped (its loss still counted)."""

    def keeps_grad(self, m):
        return m != self.config.microbatches - 1


class LossNotDividedByM(Pipeline):
    """The micro-batch losses summed, not averaged."""

    def loss_scale(self):
        return 1.0


class WrongVirtualStage(Pipeline):
    """Each device holds V adjacent chunks (d V + j) while the schedule visits them as j pp + d."""

    def chunk_ids(self) -> np.ndarray:
        c = self.config
        return np.arange(c.chunks).reshape(c.pp, c.virtual_stages)


class BubbleLeak(Pipeline):
    """Bubble slots run and unmasked: their (NaN) inputs run through the chunk and into the gradients."""

    def mask(self, valid, x):
        return x

    def runs(self, valid):
        return jnp.ones_like(valid)


CONTROLS = {
    "activations sent to the wrong stage": ReversedPermute,
    "one micro-batch's gradient dropped": DroppedMicrobatch,
    "loss not divided by M": LossNotDividedByM,
    "layer chunks on the wrong virtual stage": WrongVirtualStage,
    "a bubble's NaN let through": BubbleLeak,
}


def applicable_controls(cfg: PipelineConfig) -> list[str]:
    """Controls that can show a difference for ``cfg``: a pipeline of one stage has no neighbours or
    bubbles, one micro-batch no mean to get wrong, one virtual stage no placement to confuse; the ring of
    two devices that interleaving needs is the same in both directions."""
    skip = set()
    if not cfg.staged:
        skip |= {"activations sent to the wrong stage", "a bubble's NaN let through"}
    if cfg.pp == 2 and cfg.virtual_stages > 1:
        skip.add("activations sent to the wrong stage")
    if cfg.microbatches == 1:
        skip.add("loss not divided by M")
    if cfg.virtual_stages == 1:
        skip.add("layer chunks on the wrong virtual stage")
    return [name for name in CONTROLS if name not in skip]


@dataclass(frozen=True)
class PipelineProof:
    errors: dict  # "loss" / "x" / parameter path -> normwise relative error of the pipeline
    finite: bool  # the pipeline's results are all finite (bubbles held NaN)
    controls: dict  # control name -> its largest relative error (inf when not finite)
    tol: float

    @property
    def max_rel_err(self) -> float:
        return max(self.errors.values())

    @property
    def detected(self) -> dict:
        return {name: err > self.tol for name, err in self.controls.items()}

    @property
    def ok(self) -> bool:
        return self.finite and self.max_rel_err <= self.tol and all(self.detected.values())


def _errors(result, reference) -> dict:
    (loss, (grads, dx)), (r_loss, (r_grads, r_dx)) = result, reference
    leaves = [("loss", loss, r_loss), ("x", dx, r_dx)]
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    leaves += [
        (jax.tree_util.keystr(k), g, r) for (k, g), r in zip(flat, jax.tree.leaves(r_grads), strict=True)
    ]
    out = {}
    for name, a, b in leaves:
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = np.max(np.abs(b)) or 1.0
        out[name] = float(np.max(np.abs(a - b)) / scale) if np.all(np.isfinite(a)) else float("inf")
    return out


def prove_pipeline(
    stage_fn, loss_fn, mesh, cfg: PipelineConfig, params, x, targets, *, tol=1e-12, controls=True
):
    """Compare the pipeline with the sequential model; run the applicable controls (``controls=False``:
    none). Bubbles are NaN-filled throughout."""
    reference = jax.jit(sequential_value_and_grad(stage_fn, loss_fn))(params, x, targets)

    def run(pipe: Pipeline):
        return jax.jit(pipeline_value_and_grad(stage_fn, loss_fn, mesh, pipe))(params, x, targets)

    result = run(Pipeline(cfg, fill=float("nan")))
    finite = all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(result))
    found = {}
    for name in applicable_controls(cfg) if controls else ():
        pipe = CONTROLS[name](cfg, fill=float("nan"))
        found[name] = max(_errors(run(pipe), reference).values())
    return PipelineProof(_errors(result, reference), finite, found, tol)
