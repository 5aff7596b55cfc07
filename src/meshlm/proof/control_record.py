"""The records of a negative control (``proof.controls``): ``Where`` a control is proven (model and
mesh), and the ``Control`` itself: which one thing it changes in the sharded run."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

from meshlm.model.attention import kv_replicated
from meshlm.parallel.context import Parallel
from meshlm.parallel.layout import Layout


@dataclass(frozen=True, kw_only=True)
class Where:
    """What a control's applicability depends on: the model and the mesh it is proven on."""

    cfg: object  # the ModelConfig, or None for a user-defined Problem without one
    layout: Layout  # the mesh's axes and options the sharded run uses
    has_row_bias: bool  # whether row-parallel biases exist (added once, after the all-reduce)
    collectives: bool = False  # whether the communication check runs (it detects extra collectives)
    seq_len: int = 0  # positions per row of the proof's batch (0: not known; blockwise controls need
    # several blocks)
    planted_tie: bool = False  # the proof's own parameters carry the router tie (``moe_controls``); a
    # checkpoint's do not, so no tie-breaking control can show there

    @property
    def attention(self) -> bool:
        return self.cfg is not None and self.cfg.arch.attention

    @property
    def kv_replicated(self) -> bool:
        """KV heads replicated over mp (mp > n_kv_heads > 1) in some layers (Gemma 4's global layers may
        have KV heads of their own: ``attention_kinds``): each shard picks its query group's head."""
        if not self.attention:
            return False
        return any(k > 1 and kv_replicated(k, self.layout.mp) for _, k, _ in self.cfg.attention_kinds())


@dataclass(frozen=True, kw_only=True)
class Control:
    name: str  # shown in verify's output
    applies: Callable[[Where], bool]  # whether the fault can change the result on this model and mesh
    par_cls: type[Parallel] = Parallel  # the sharded run's parallel context
    cfg_change: Callable | None = None  # cfg -> cfg for the sharded run
    per_shard_clip: bool = False  # clip by a per-shard gradient norm (training step)
    # run through one training step with ``par_cls``: a fault in the state the step moves outside the
    # gradients (a mixture of experts' selection bias, ``proof.router_controls``)
    train_step: bool = False
    by_collectives: bool = False  # detected by the communication check, not by values
    # detected by ``--quant int8``'s bit-for-bit check of an int8 block (``proof.quant_exact``): a fault
    # whose values stay within the float tolerance (an int32 partial sum rescaled before its all-reduce)
    by_int8_block: bool = False
    params_change: Callable | None = None  # (cfg, params) -> the sharded run's parameters
    plant: Callable | None = None  # () -> a context manager planting the fault while the sharded run traces
    pipe_cls: Callable | None = None  # layout -> the engine's Pipeline subclass (a fault the pipeline holds)


@contextmanager
def replaced(where: dict, name: str, value):
    """``where[name]`` (a module's ``vars``, or a table of its) set to ``value`` while the sharded run
    traces: how a control plants its fault in the model code it names."""
    old = where[name]
    where[name] = value
    try:
        yield
    finally:
        where[name] = old
