"""The vocabulary padding's own check: beyond equal values (the padded model's loss and gradients
against the unpadded reference's), the padded rows' gradients must be exactly zero, not merely small.
Their logits are masked out of the softmax, so nothing may flow into them."""

from __future__ import annotations

import numpy as np

from meshlm.model.padding import padding_of
from meshlm.parallel.placement import to_host
from meshlm.proof.problem import Problem
from meshlm.proof.report import check_row


def padding_rows(problem: Problem, grads) -> list[dict]:
    """[] without padding; else one row: every padded row of every vocabulary gradient is 0."""
    cfg = problem.cfg
    if cfg is None or cfg.padded_vocab == cfg.vocab_size:
        return []
    pads = {name: np.asarray(to_host(x)) for name, x in padding_of(grads, cfg.vocab_size).items()}
    nonzero = {name: int(np.count_nonzero(x)) for name, x in pads.items() if np.count_nonzero(x)}
    ids = f"ids {cfg.vocab_size}..{cfg.padded_vocab - 1}"
    if not pads:
        detail = f"no vocabulary gradient has the padded {ids}"
    elif nonzero:
        detail = f"padded {ids} have non-zero gradients: {nonzero}"
    else:
        detail = f"padded {ids}: gradients exactly 0 in {', '.join(sorted(pads))}"
    return [check_row("vocabulary padding inert", bool(pads) and not nonzero, detail)]
