"""The proof of document masking (``--doc-mask``): batches rich in end-of-document ids, and the planted
faults of the mask.

The proof's usual batches are uniform random ids: about one token in ``vocab_size`` is the EOD, so most
rows hold one document and a wrong mask would change nothing. With ``cfg.doc_mask`` the prover's
batches (``document_batch``) are streams of several documents per row, with boundaries at different
places in every row (a row may start with an EOD or in the middle of a document; two EODs in a row make
an empty document), so the mask decides which keys most queries see.

The controls: the mask ignores one boundary (every shard), the mask crosses a boundary on one model
shard only (the others are right: a fault a per-shard mask computation could make), and the mask off
altogether (the sharded model without it must differ from the masked reference: the proof of the mask
cannot pass vacuously on a batch where the mask changes nothing).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from meshlm.proof.taps import Tapped

# The longest gap between two EODs in a document batch: documents of 0 to MAX_DOC_LEN - 1 tokens after
# their EOD, so a row of T tokens holds about 2T / MAX_DOC_LEN documents.
MAX_DOC_LEN = 8


def document_batch(vocab: int, eod: int, shape: tuple[int, ...], seed: int) -> dict:
    """{"inputs", "targets"} of ``shape`` [..., T]: each row a window of a stream of documents, the
    targets the inputs shifted by one (as ``meshlm train`` reads windows). Deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    rows, t = int(np.prod(shape[:-1])), shape[-1]
    stream = rng.integers(0, vocab - 1, (rows, t + 1))
    stream += stream >= eod  # every id but the EOD
    for row in stream:
        at = int(rng.integers(0, MAX_DOC_LEN))  # the first EOD: 0 (the row starts a document) or later
        while at <= t:
            row[at] = eod
            at += int(rng.integers(1, MAX_DOC_LEN + 1))
    stream = stream.astype(np.int32).reshape(*shape[:-1], t + 1)
    return {"inputs": stream[..., :-1], "targets": stream[..., 1:]}


def _first_boundary_ignored(starts):
    """Where documents start, with each row's first boundary after the window start ignored: the
    document it starts joins the one before it (which starts at 0)."""
    first = jnp.min(jnp.where(starts > 0, starts, starts.shape[-1]), axis=-1, keepdims=True)
    return jnp.where(starts == first, 0, starts)


class DocMaskIgnoresBoundary(Tapped):
    """The document mask ignores one boundary per row: a document attends to the one before it."""

    def doc_starts(self, starts):
        return _first_boundary_ignored(starts)


class DocMaskCrossesOnOneShard(Tapped):
    """The last model shard's heads ignore one boundary per row; the other shards mask correctly."""

    def doc_starts(self, starts):
        return jnp.where(self.shard_index() == self.layout.mp - 1, _first_boundary_ignored(starts), starts)


def doc_mask_off(cfg):
    """The model without the document mask (a control: the mask must change the proof's values)."""
    return cfg.replace(doc_mask=-1)
