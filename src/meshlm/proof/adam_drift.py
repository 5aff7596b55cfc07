"""What AdamW's division makes of a difference in its moments: the part of a parameter's error after
training steps that the (separately compared) optimizer state explains.

AdamW moves each element by lr_t * (m_hat / (sqrt(v_hat) + eps) + wd * p). The division is element-wise,
so it is ill-conditioned where an element's moments are small: a gradient element that cancels to
near zero carries a rounding error of the size of the terms it summed (the leaf's scale), and the
division turns that into an error of the size of the element's own step. The sharded and the unsharded
programs sum in different orders, so in float64 such an element's moments differ by ~1e-16 of the
leaf's scale (the normwise check of the moments passes at ~1e-14), while its parameter after the step
can differ by ~1e-12 of the leaf's scale: measured on cpu-moe 2x2 + EP2, ``embed/embeddings`` at 1.3e-12
from step 2 on, at one element whose gradient's RMS was 1.4e-9 (the moments within 8e-15), and on the
dense cpu model 2x2 at 4.6e-13 (``layers/attn/wo``, step 2).
Whether a normwise 1e-12 passes is then luck: how near zero the worst element's gradient fell.

The sound bound: a parameter's error after step k may exceed the normwise tolerance by at most
B_k = B_{k-1} + lr_k * |u(m_s, v_s) - u(m_r, v_r)|, element by element, u AdamW's normalised step
computed here (numpy, float64) from each run's own moments after step k. That is the difference the
moments' measured difference makes through the division (p_k = (1 - lr wd) p_{k-1} - lr u_k, so a
parameter's difference is at most the previous one plus lr times u's); the moments themselves are
compared normwise as before, untouched. A fault in the step itself (learning rate, weight decay, the
update applied to the wrong shard) changes the parameters and not the moments: B does not absorb it.
"""

from __future__ import annotations

import jax
import numpy as np
import optax

from meshlm.parallel.placement import to_host
from meshlm.train.optim import OptimConfig, schedule


def adam_moments(opt_state):
    """The ``ScaleByAdamState`` inside an optax chain's state, or None (another optimizer)."""
    found = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
        if isinstance(s, optax.ScaleByAdamState)
    ]
    return found[0] if len(found) == 1 else None


class AdamDrift:
    """The accumulated bound B per parameter leaf (by the proof's leaf label) over a run's steps."""

    def __init__(self, ocfg: OptimConfig, label):
        self.ocfg, self.label = ocfg, label  # label: keypath -> the proof's leaf label (``report``)
        self.lr = schedule(ocfg)
        self.bound: dict[str, np.ndarray] = {}
        self.steps = 0

    def step(self, state_s, state_r) -> dict[str, np.ndarray]:
        """Fold in the states after one more step; returns the bounds by leaf label (empty where the
        optimizer has no Adam moments)."""
        self.steps += 1
        ms, mr = adam_moments(state_s), adam_moments(state_r)
        if ms is None or mr is None:
            return {}
        lr = float(self.lr(self.steps - 1))  # optax's schedule reads the count before the step
        s_leaves = jax.tree_util.tree_flatten_with_path(ms.mu)[0]
        for (kp, m_s), v_s, m_r, v_r in zip(
            s_leaves, jax.tree.leaves(ms.nu), jax.tree.leaves(mr.mu), jax.tree.leaves(mr.nu), strict=True
        ):
            drift = lr * np.abs(self._u(m_s, v_s) - self._u(m_r, v_r))
            key = self.label(kp)
            self.bound[key] = self.bound.get(key, 0.0) + drift
        return self.bound

    def _u(self, m, v) -> np.ndarray:
        """AdamW's normalised step from moments after ``self.steps`` steps (optax's scale_by_adam)."""
        c, t = self.ocfg, self.steps
        m_hat = np.asarray(to_host(m), np.float64) / (1 - c.b1**t)
        v_hat = np.asarray(to_host(v), np.float64) / (1 - c.b2**t)
        return m_hat / (np.sqrt(v_hat) + c.eps)
