"""Every control planted on every configuration ``meshlm verify`` accepts, traced (issue 36).

A control whose plant falls out of step with the code it replaces (``model.blockwise._needed`` gained a
parameter; the planted function kept the old signature) crashes when verify runs it: exit 3 on every
``--attention blockwise`` proof. So each configuration below builds the prover's own runs and traces
(``jit(...).trace``: no compile, no execution) the planted sharded program of every control that applies
there, exactly as ``run_control`` and ``pipeline_controls`` build it. A crash is a failure of this test;
JAX's varying-axis type check rejecting the program is what verify counts as a detection, and passes.
The configurations cover plain, blockwise and flash attention, both cp strategies (ring on 2 and 3 shards),
each pp schedule, pp x cp and the document mask under pp (their controls through the pipeline), a
sliding window in the kernel and the ring, soft-capping in the kernel and the ring, experts over ep
(with FSDP over the rest of dp and SP), FSDP and SP, and every tiny family preset; the last test
requires every control to apply on at least one of them, so a new control cannot go untested here."""

import dataclasses

import jax.numpy as jnp
import pytest

from meshlm.model.config import get_config
from meshlm.parallel.layout import Layout
from meshlm.proof import model_problem
from meshlm.proof.control_record import Control
from meshlm.proof.controls import CONTROLS
from meshlm.proof.cp_controls import CP_CONTROLS
from meshlm.proof.ep_controls import EP_CONTROLS
from meshlm.proof.family_faults import softcap_after_softmax
from meshlm.proof.inertness import INERT, inert_controls, inert_skips
from meshlm.proof.pipeline_proof import CONTROLS as PIPELINE_CONTROLS
from meshlm.proof.pipeline_proof import applicable_controls
from meshlm.proof.pipeline_verify import permute_controls
from meshlm.proof.prover import control_set, where_of
from meshlm.proof.runs import Runs

ALL_CONTROLS = CONTROLS + CP_CONTROLS + EP_CONTROLS  # the prover's default list
BW = dict(attention="blockwise", attn_block=4)  # several K/V blocks per shard, a ragged last one
FSDP_SP = Layout(dp=2, mp=2, fsdp=True, sp=True)
EP2, ONE = Layout(dp=2, mp=2, ep=2), {"n_layers": 1}  # a family's experts over ep: one layer is enough
PERIOD = {"n_layers": 2}  # tiny-qwen3.5's one period (a linear, a full layer) of its two
L4 = {"n_layers": 2, "global_every": 2, "dense_layers": (0,)}  # tiny-llama4's two kinds of layer, once
# name: (preset, config changes, layout, batch, seq_len). Shapes tiny: only traced.
CONFIGS = {
    "seed ff 2x2 fsdp sp": ("seed", {}, FSDP_SP, 2, 8),
    "tiny-gptj 2x2 plain": ("tiny-gptj", {}, Layout(dp=2, mp=2), 2, 8),
    "tiny-gpt2vocab 1x2 (padded vocab)": ("tiny-gpt2vocab", {}, Layout(mp=2), 1, 8),
    "tiny-gqa 1x4 blockwise (KV replicated)": ("tiny-gqa", BW, Layout(mp=4), 1, 10),
    "tiny-mistral 1x2 (window)": ("tiny-mistral", {}, Layout(mp=2), 1, 18),
    # a window of 10 on blocks of 8: the kernel's window and its block-skip rule, through the ring
    "tiny-mistral-w10 1x2 cp2 ring blockwise (window)": (
        "tiny-mistral-w10",
        {"attention": "blockwise", "attn_block": 8},
        Layout(mp=2, cp=2),
        1,
        32,
    ),
    "tiny-gemma 1x2": ("tiny-gemma", {}, Layout(mp=2), 1, 8),
    "tiny-llama3 2x2 fsdp sp doc-mask (tied)": ("tiny-llama3", {"doc_mask": 0}, FSDP_SP, 2, 8),
    # the loss in chunks of 3 tokens: the chunked loss's fault (``proof.loss_controls``)
    "tiny-qwen2 1x2 (q/k/v bias, tied, loss chunks)": ("tiny-qwen2", {"loss_chunk": 3}, Layout(mp=2), 1, 8),
    "tiny-qwen3 1x2 (per-head q/k norm)": ("tiny-qwen3", {}, Layout(mp=2), 1, 8),
    "tiny-smollm3 1x2 (NoPE layers)": ("tiny-smollm3", {}, Layout(mp=2), 1, 8),
    # a chunked dense layer and a NoPE MoE layer: the preset's four repeat them (a trace grows per layer)
    "tiny-llama4 1x2 blockwise (chunks, NoPE layers)": ("tiny-llama4", {**BW, **L4}, Layout(mp=2), 1, 18),
    # learned sinks under the ring (once after the merge) and over dp (their gradient summed)
    "tiny-gpt-oss 2x1 cp2 ring blockwise (sinks, windows)": ("tiny-gpt-oss", BW, Layout(dp=2, cp=2), 2, 16),
    "tiny-olmo2 2x2 (q/k norm over the projection)": ("tiny-olmo2", {}, Layout(dp=2, mp=2), 2, 8),
    "tiny-phi3 1x2 (fused q/k/v and gate/up, window)": ("tiny-phi3", {}, Layout(mp=2), 1, 18),
    "tiny-mixtral 2x2 (mixture of experts, capacity)": (
        "tiny-mixtral",
        {"moe_capacity_factor": 0.5},
        Layout(dp=2, mp=2),
        2,
        8,
    ),
    "tiny-gemma 1x2 soft-capped": (
        "tiny-gemma",
        {"attn_softcap": 50.0, "final_softcap": 30.0},
        Layout(mp=2),
        1,
        8,
    ),
    # one local/global pattern each (the trace grows with the unrolled layers)
    "tiny-gemma2 1x2 (local/global, soft-capped)": ("tiny-gemma2", {"n_layers": 2}, Layout(mp=2), 1, 10),
    "tiny-gemma3 1x2 (two rotary bases, q/k norm)": ("tiny-gemma3", {"n_layers": 3}, Layout(mp=2), 1, 10),
    # Gemma 4's pieces: per-layer inputs, keys as values, shared KV (the stack's carry) over dp and mp
    "tiny-gemma4 2x2 (per-layer inputs, keys as values, shared KV)": (
        "tiny-gemma4",
        {"n_layers": 4, "global_every": 2},  # the last two layers read layers 0 and 1's KV
        Layout(dp=2, mp=2),
        2,
        10,
    ),
    # its global layers of their own shape (heads of 64, their 2 KV heads replicated beside 4 split): a
    # stack of their own, every control through its periods scan
    "tiny-gemma4 1x4 (global layers of their own shape)": (
        "tiny-gemma4",
        {"n_layers": 4, "global_every": 2, "n_kv_heads": 4, "global_head_dim": 64, "global_kv_heads": 2},
        Layout(mp=4),
        1,
        10,
    ),
    # Gemma 4's MoE block beside the MLP (the router on the residual), its experts over ep
    "tiny-gemma4-moe 2x2 ep2 (MoE block beside the MLP)": (
        "tiny-gemma4-moe",
        {"n_layers": 2, "global_every": 2, "kv_shared_layers": 0},
        EP2,
        2,
        8,
    ),
    "tiny-llama 1x1 blockwise doc-mask": ("tiny-llama", {**BW, "doc_mask": 0}, Layout(), 1, 18),
    # the flash kernel (Pallas splash, interpret mode here): its mask, window and segments' controls
    "tiny-mistral-w10 1x2 flash (window)": (
        "tiny-mistral-w10",
        {"attention": "flash", **ONE},
        Layout(mp=2),
        1,
        16,
    ),
    "tiny-llama 1x2 cp2 ring flash": ("tiny-llama", {"attention": "flash", **ONE}, Layout(mp=2, cp=2), 1, 16),
    "tiny-llama 2x2 flash doc-mask": (
        "tiny-llama",
        {"attention": "flash", "doc_mask": 0},
        Layout(dp=2, mp=2),
        2,
        8,
    ),
    "tiny-llama 2x2 cp2 ring fsdp sp blockwise soft-capped": (
        "tiny-llama",
        {**BW, "attn_block": 5, "attn_softcap": 0.05},  # the kernel's and the ring's soft-cap controls
        Layout(dp=2, mp=2, cp=2, fsdp=True, sp=True),
        2,
        24,
    ),
    # plain attention under the ring: the ring runs the kernel, never the plain softmax (issue 47)
    "tiny-gemma 1x2 cp2 ring plain soft-capped": (
        "tiny-gemma",
        {"attn_softcap": 5.0, "attn_block": 4},
        Layout(mp=2, cp=2),
        1,
        16,
    ),
    "tiny-gqa 1x2 cp2 allgather blockwise": (
        "tiny-gqa",
        BW,
        Layout(mp=2, cp=2, cp_strategy="allgather"),
        1,
        20,
    ),
    "tiny-lm 1x1 cp3 ring": ("tiny-lm", {"attn_block": 4}, Layout(cp=3), 1, 30),
    "tiny-mixtral 4x2 ep2 fsdp sp": ("tiny-mixtral", {}, Layout(dp=4, mp=2, ep=2, fsdp=True, sp=True), 4, 8),
    "tiny-cpu-moe 2x2 ep2 (sigmoid router, groups, selection bias)": ("tiny-cpu-moe", ONE, EP2, 2, 8),
    "tiny-qwen3-moe 2x2 ep2 (per-head q/k norm, experts by ragged_dot)": (
        "tiny-qwen3-moe",
        {**ONE, "moe_dispatch": "ragged_dot"},
        EP2,
        2,
        8,
    ),
    # the megablox grouped matmul (interpret mode here) over ep and mp: its group offsets' control
    "tiny-mixtral 2x2 ep2 (experts by gmm)": ("tiny-mixtral", {**ONE, "moe_dispatch": "gmm"}, EP2, 2, 8),
    # the "dense" reference dispatch under ep: its all-to-alls' controls
    "tiny-olmoe 2x2 ep2 (projection q/k norm, dense dispatch)": (
        "tiny-olmoe",
        {**ONE, "moe_dispatch": "dense"},
        EP2,
        2,
        8,
    ),
    # a shared expert (its controls under SP) and a dense layer among the MoE layers (two stacks)
    "tiny-qwen2-moe 1x2 sp": ("tiny-qwen2-moe", {"n_layers": 2}, Layout(mp=2, sp=True), 1, 8),
    # linear attention (Gated DeltaNet) beside full attention: its rule's controls, documents, heads over mp
    "tiny-qwen3.5 2x2 fsdp sp doc-mask": ("tiny-qwen3.5", {"doc_mask": 0, **PERIOD}, FSDP_SP, 2, 10),
    # under cp: the state maps and the conv tails between chunks (chunks of 4 tokens: K - 1 = 3 fit)
    "tiny-qwen3.5 1x2 cp2 ring": ("tiny-qwen3.5", PERIOD, Layout(mp=2, cp=2), 1, 16),
    # multi-head latent attention with YaRN and DeepSeek's MoE (issue 43), one MoE layer (the dense
    # layer's stack is tiny-qwen2-moe's): the MLA controls on mp, the router's and the experts' over ep
    "tiny-deepseek-v3 2x2 ep2 (MLA, YaRN, DeepSeek's MoE)": (
        "tiny-deepseek-v3",
        {**ONE, "dense_layers": []},
        EP2,
        2,
        8,
    ),
    "tiny-llama pp2 gpipe": ("tiny-llama", {}, Layout(pp=2, microbatches=4, pp_schedule="gpipe"), 4, 8),
    "tiny-llama pp2x1x2 cp2 ring gpipe": (  # the ring's kernel on several K/V blocks (12 > 4 per shard)
        "tiny-llama",
        {"attn_block": 4},
        Layout(pp=2, mp=2, cp=2, microbatches=2, pp_schedule="gpipe"),
        2,
        24,
    ),
    # SP's and the document mask's controls through 1F1B in one configuration: each pp configuration traces
    # the whole pipeline once per control (~2 s each), and the two share the model's and the pipeline's
    "tiny-llama pp2x1x2 sp doc-mask 1f1b": (
        "tiny-llama",
        {"doc_mask": 0},
        Layout(pp=2, mp=2, sp=True, microbatches=2, pp_schedule="1f1b"),  # the stash traces the starts' types
        2,
        8,
    ),
    "tiny-deep pp2 interleaved V2": (
        "tiny-deep",
        {},
        Layout(pp=2, microbatches=4, pp_schedule="interleaved", virtual_stages=2),
        4,
        8,
    ),
}


def _problem(name):
    preset, changes, layout, batch, seq = CONFIGS[name]
    cfg = get_config(preset).replace(**changes)
    kw = dict(dp=layout.dp, fsdp=layout.fsdp, sp=layout.sp, pp=layout.pp, ep=layout.ep)
    return model_problem(cfg, name, layout.mp, batch, seq, **kw), layout


def _applicable(problem, layout) -> list:
    """(name, trace) of each control verify runs on this configuration (``prover.verify``'s choice)."""
    where = where_of(problem, layout, collectives=True)
    chosen = [(c.name, c) for c in control_set(where, ALL_CONTROLS)]
    if layout.pipelined:  # the model's controls through the pipeline, the ring's by its permute count
        chosen += [(c.name, c) for c in permute_controls(ALL_CONTROLS, where, True)]
        chosen += [(f"pipeline: {n}", n) for n in applicable_controls(layout.pipeline)]
    return chosen


# slow: its cost is its scale (every control traced on 42 configurations, ~10 CPU-min); the quick tier
# runs each axis's and each model kind's controls in their own proofs, and the checks below
@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_every_applicable_control_runs_and_changes_its_program(name):
    """Each control's planted program traces (a crash: verify's exit 3, "control ... crashed") and
    differs from the unplanted one (``proof.inertness``: else verify skips it, proving less than it
    claims)."""
    problem, layout = _problem(name)
    runs = Runs(problem, layout, jnp.float32, 0)
    assert inert_controls([c for _, c in _applicable(problem, layout)], runs) == []


# slow: its cost (a checkpoint's traces of every control); an inert control fails every proof:
# test_an_inert_control_is_a_prover_bug, quick
@pytest.mark.slow
def test_no_tie_control_on_a_checkpoint():
    """A converted checkpoint's router carries no planted tie (``planted_tie`` False): neither
    tie-breaking control applies (each would change the program and never the values), and every other
    control changes the program."""
    problem, layout = _problem("tiny-olmoe 2x2 ep2 (projection q/k norm, dense dispatch)")
    problem = dataclasses.replace(problem, prepare_params=None)  # as a checkpoint: no planted tie
    chosen = [c for _, c in _applicable(problem, layout)]
    assert not [c.name for c in chosen if "ties" in c.name]
    assert inert_controls(chosen, Runs(problem, layout, jnp.float32, 0)) == []


def test_an_inert_control_is_skipped_with_its_reason():
    """The soft-cap control's old ``applies`` (plain attention, the cp ring included), planted on
    purpose: its plant reaches no code the ring runs, so the check names it inert, and verify skips it
    with that reason (it used to raise a prover bug, exit 3, on a correct model; issue 59: a control
    that cannot change the program is skipped, never a failure -- the test above holds every control's
    ``applies`` to programs it changes). Trace only: the skip's row in a proof,
    tests/test_control_skips.py."""
    problem, layout = _problem("tiny-gemma 1x2 cp2 ring plain soft-capped")
    old = Control(
        name="soft-cap after the softmax (old applies)",
        applies=lambda w: w.cfg.attention == "plain",
        plant=softcap_after_softmax,
    )
    runs = Runs(problem, layout, jnp.float32, 0)
    assert inert_skips([old], runs) == {old.name: INERT}
    assert "changes nothing" in INERT


# Controls whose configuration has no cell here: their own float64 proof plants each and sees it detected,
# which its program changing is a part of (a cell would cost a minute of MLA, MoE and MTP traces on cp
# or through the pipeline).
OWN_PROOF = {
    "MTP labels not taken across the cp shard boundary": "tests/test_mtp.py (1x2-cp2)",
    "MTP loss counted on every pp stage": "tests/test_mtp.py (pp2 x cp2)",
}


def test_every_control_applies_on_some_configuration(monkeypatch):
    every = {c.name for c in ALL_CONTROLS} | {f"pipeline: {n}" for n in PIPELINE_CONTROLS}
    applied = set()
    # the experts' combine by gathers (the default) and by scatter-adds (MESHLM_MOE_COMBINE=scatter, a
    # measurement's switch): each has its own padding fault (tests/test_ep.py's capacity test runs both)
    for combine in ("gather", "scatter"):
        monkeypatch.setenv("MESHLM_MOE_COMBINE", combine)
        for name in CONFIGS:
            applied |= {label for label, _ in _applicable(*_problem(name))}
    assert every - applied == set(OWN_PROOF)
