"""``ModelConfig``'s dispatch field: how a mixture of experts reaches its experts (``parallel.grouped``).

Kept apart from the dispatch code, which imports JAX: configs are validated before devices exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.errors import ConfigError

# The dispatch implementations (``moe_dispatch``): "dense" is the all-local reference, every expert on
# every token (``parallel.experts.dense_experts``): what the proof compares the others with.
DISPATCHES = ("blocks", "ragged_dot", "dense")


@dataclass(frozen=True)
class DispatchFields:
    """``ModelConfig``'s dispatch field (a base, as ``MoEFields``): how a mixture of experts reaches
    its experts (``DISPATCHES``). Not a model fact: the values are the same whichever is chosen (the
    proof shows it), so a saved config without it loads with the default."""

    moe_dispatch: str = "blocks"


def check_dispatch(cfg) -> None:
    if cfg.moe_dispatch not in DISPATCHES:
        raise ConfigError(f"moe_dispatch must be one of {', '.join(DISPATCHES)}, got {cfg.moe_dispatch!r}")
