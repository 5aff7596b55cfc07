"""The named points (``Parallel.tap``) where controls plant faults that no real operation of
``Parallel`` carries, each as a method of ``Tapped`` that a control overrides.

The ground-floor ``Parallel`` keeps only real behaviour: a tap there is the identity. A control that
changes a tap subclasses ``Tapped`` and overrides that tap's method; a tap name without a method here
is an error (AttributeError while tracing), so a misspelt name cannot pass silently.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.parallel.context import Parallel


@dataclass(frozen=True)
class Tapped(Parallel):
    """``Parallel`` with each tap routed to its method (all identities here)."""

    def tap(self, name: str, x):
        return getattr(self, name)(x)

    def norm_param(self, p):
        """A replicated norm parameter under ``sp``, as layers use it."""
        return p

    def lora_b(self, b):
        """A LoRA adapter's B [R, out] as this shard uses it (``model.lora``): the stored one."""
        return b

    def lora_scale(self, s):
        """A LoRA adapter's scale alpha / R, applied once (``model.lora``)."""
        return s

    def lora_seeds(self, s):
        """This shard's tokens' dropout seeds [B, T] (``model.lora_dropout``): their global numbers."""
        return s

    def lora_feature_offset(self, offset):
        """The global index of this shard's first input feature of a LoRA target (``lora_dropout``)."""
        return offset

    def own_heads(self, w):
        """The query-head weights [D, H/mp, E] this shard computes with: its own slice."""
        return w

    def tied_table(self, table):
        """The embedding slice [V/mp, D] a tied head projects onto: this shard's own, the very array
        the lookup reads, so both uses' gradients add up in it."""
        return table

    def head_bias(self, b):
        """The q/k/v bias [heads, E] this shard adds: its own heads' slice."""
        return b

    def linear_key_heads(self, qk):
        """A linear-attention layer's (q, k) [B, T, Kh/mp, dk] each, this shard's own key heads, as
        the delta rule pairs them with this shard's value heads (``model.linear_attention``)."""
        return qk

    def doc_starts(self, starts):
        """[B, T] where each token's document starts (``--doc-mask``), as attention and the rotary
        positions use it."""
        return starts

    def combine_weights(self, w):
        """A mixture-of-experts layer's combine weights [B, T, k] as the column-parallel region uses
        them (after ``f``: their gradient is the sum over mp of the experts' partial outputs)."""
        return w

    def shared_gate(self, w):
        """Qwen2-MoE's shared-expert gate weight [D, 1], replicated over mp, as the MoE layer uses it."""
        return w

    def shared_expert(self, y):
        """A MoE layer's gated shared-expert output [B, T, D], partial over mp (this shard's hidden
        units), as it joins the experts' partial output before the row-parallel sum."""
        return y

    def group_scores(self, s):
        """A MoE router's expert-group scores [.., n_group] of each token (``model.routers``: the sum of
        each group's top-2 choice scores), as the group choice ranks them."""
        return s

    def expert_weight(self, w):
        """An expert weight [E/ep, ...] as the MoE layer uses it (after any FSDP gather)."""
        return w
