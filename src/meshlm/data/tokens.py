"""Host-side token checks. JAX clamps out-of-range gather indices and one-hot gives zero rows, so an
id outside [0, vocab_size) would silently produce a wrong loss: we refuse it before it reaches a device."""

from __future__ import annotations

import numpy as np

from meshlm.errors import TokenRangeError


def check_token_range(ids, vocab_size: int, what: str = "tokens") -> None:
    """Raise TokenRangeError naming the first id outside [0, vocab_size) and its position."""
    arr = np.asarray(ids)
    if arr.size == 0:
        return
    if not np.issubdtype(arr.dtype, np.integer):
        raise TokenRangeError(f"{what} must be integer token ids, got dtype {arr.dtype}")
    bad = (arr < 0) | (arr >= vocab_size)
    if bad.any():
        pos = tuple(int(i) for i in np.argwhere(bad)[0])
        raise TokenRangeError(
            f"{what} contains token id {int(arr[pos])} at position {pos}, outside the vocabulary "
            f"[0, {vocab_size}); use a config whose vocab_size covers the data (bytes need 256)"
        )


def check_batch(batch: dict, vocab_size: int) -> None:
    for key in ("inputs", "targets"):
        if key in batch:
            check_token_range(batch[key], vocab_size, key)
