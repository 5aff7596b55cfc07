"""Planted faults of flash attention (``--attention flash``: the Pallas splash kernel, ``model.flash``).

The model's own controls (the window off by one, the document mask off, the cap off, ...) change the
config or the model around the kernel, and so reach flash attention as they reach plain attention.
These plant inside ``model.flash`` (and ``model.flash_ring``), where only the flash kernel's run meets
them, while the sharded program is traced:

- *flash mask sees the next key*: each head's static mask also lets a query see the key one position
  after it (the causal mask's classic off-by-one): every model with attention;
- *flash document segments ignored*: the kernel's segment ids all one document (``--doc-mask``);
- *flash window one key wider*: the kernel's local mask one key wider than the variant's window (a
  model with a window shorter than the proof's sequence, without ``--doc-mask``: the proof's EOD-rich
  documents are shorter than a window, which then changes nothing);
- *flash ring's own chunk fully visible* (``--cp`` ring, ``model.flash_ring``): the pair of a query
  chunk and its own key chunk run with the full mask, not the causal one (its later keys visible).

The mask builder is a parameter of the kernel's primitives (``flash._bridge``), so a planted one is a
program of its own (the inertness check sees it) and a kernel of its own (no cached one is reused).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

from meshlm.model import flash, flash_ring
from meshlm.proof.control_record import Control, Where
from meshlm.proof.cp_controls import _planted


def _flash_ring_runs(w: Where) -> bool:
    """The flash kernel runs the --cp ring's steps."""
    return w.cfg is not None and w.attention and w.cfg.attention == "flash" and w.layout.cp_ring


def _full_diagonal(causal):
    return lambda t, window, chunk: masks.FullMask((t, t))


def _flash_runs(w: Where) -> bool:
    """The flash kernel runs in the sharded program (no cp: flash refuses it)."""
    return w.cfg is not None and w.attention and w.cfg.attention == "flash" and not w.layout.context_parallel


def _next_key_visible(mask_of):
    def planted(t, window, chunk):
        return mask_of(t, window, chunk) | masks.CausalMask((t, t), offset=1)

    return planted


def _one_document(segments):
    return lambda starts, t_padded: jnp.zeros_like(segments(starts, t_padded))


def _window_wider(mask_of):
    return lambda t, window, chunk: mask_of(t, window + 1 if window else 0, chunk)


FLASH_CONTROLS: tuple[Control, ...] = (
    Control(
        name="flash mask sees the next key",
        applies=_flash_runs,
        plant=lambda: _planted(flash, _mask=_next_key_visible),
    ),
    Control(
        name="flash document segments ignored",
        applies=lambda w: _flash_runs(w) and w.cfg.doc_mask >= 0,
        plant=lambda: _planted(flash, _segments=_one_document),
    ),
    Control(
        name="flash window one key wider",
        applies=lambda w: _flash_runs(w) and 0 < w.cfg.sliding_window < w.seq_len and w.cfg.doc_mask < 0,
        plant=lambda: _planted(flash, _mask=_window_wider),
    ),
    Control(
        name="flash ring's own chunk fully visible",
        applies=_flash_ring_runs,
        plant=lambda: _planted(flash_ring, _causal=_full_diagonal),
    ),
)
