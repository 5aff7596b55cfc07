"""LoRA (``model.lora``): the adapters' gradients equal the unsharded run's in float64 under 2x2, FSDP +
SP, pp 2 and cp 2 with the chat SFT loss, the base frozen (its gradients exactly 0), the merged weights'
forward equal to the adapted one, B = 0 the base, and the LoRA controls detected where they
apply; ``meshlm train --checkpoint --lora-rank`` saves the adapters alone with the base's fingerprint,
resumes bit for bit and refuses another base; bad targets are one line."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
from helpers import run_cli, saved_tiny_base

from meshlm.model import lora
from meshlm.model.config import get_config

TARGETS = "q,k,v,o,gate,up,down"


# The quick tier: the proof on 2x2 with the control of the adapters' sharding (B's gradient summed over
# the data shards) and the scale's (each other control recompiles the step).
QUICK_LORA = ("LoRA B gradient not summed over the data shards", "LoRA scale alpha/R applied twice")


# The LoRA proof on 2x2 is quick (with QUICK_LORA); every control on 2x2, FSDP + SP with dropout, pp and cp
# are slow: the same proof with more controls and on more layouts (its cost is its scale); the adapters'
# sharding bug class: the 2x2 quick cell; dropout's masks: test_dropout_masks_and_changes_the_gradient_...,
# quick.
@pytest.mark.parametrize(
    "layout,dropout,names",
    [
        (dict(dp=2, mp=2), 0.0, QUICK_LORA),
        pytest.param(dict(dp=2, mp=2), 0.0, None, marks=pytest.mark.slow),
        pytest.param(
            dict(dp=2, mp=2, fsdp=True, sp=True), 0.1, None, marks=pytest.mark.slow
        ),  # --lora-dropout: global tokens' masks
        pytest.param(
            dict(dp=1, mp=2, pp=2, microbatches=4), 0.0, None, marks=pytest.mark.slow
        ),  # (--pp refuses dropout)
        pytest.param(dict(dp=1, mp=2, cp=2), 0.1, None, marks=pytest.mark.slow),
    ],
    ids=["2x2-quick", "2x2", "fsdp-sp-dropout", "pp2", "cp2-dropout"],
)
def test_verify_lora_sft_equal_unsharded_and_its_controls_detected(layout, dropout, names):
    from meshlm.parallel.layout import Layout
    from meshlm.proof import format_report, model_problem, verify
    from meshlm.proof.lora import LORA_CONTROLS, lora_problem
    from meshlm.proof.sft import sft_problem

    lay = Layout(**layout)
    controls = tuple(c for c in LORA_CONTROLS if names is None or c.name in names)  # None: every one
    cfg = get_config("tiny-llama").replace(
        lora_rank=4, lora_alpha=8.0, lora_targets=TARGETS, lora_dropout=dropout
    )
    rows = 2 * lay.dp * lay.pipeline_microbatches
    problem = lora_problem(sft_problem(model_problem(cfg, "tiny-llama", lay, rows, 16)))
    with jax.enable_x64(True):
        # under pp the pipeline's controls on what SFT changes (the masked loss's and the adapters' gradients'
        # sum over micro-batches); its schedule faults are the engine's alone (tests/test_pp_verify.py)
        faults = ("one micro-batch's gradient dropped", "loss not divided by M")
        report = verify(problem, lay, dtype=np.float64, controls=controls, pipeline_faults=faults)
    assert report.ok, format_report(report)
    adapters = [p for p in report.params if lora.is_adapter(p.path)]
    assert len(adapters) == 14 and max(p.max_rel_err for p in adapters) <= 1e-12
    rows = {c["name"]: c for c in report.checks}
    for name in ("only adapter gradients", "merged weights' forward", "B = 0 gives the base's output"):
        assert rows[next(k for k in rows if name in k)]["ok"]
    detected = {c["name"]: c["detected"] for c in report.controls}
    assert detected["LoRA scale alpha/R applied twice"]
    if lay.dp * lay.cp > 1:  # the batch split over data shards: B's gradient is a sum over them
        assert detected["LoRA B gradient not summed over the data shards"]
    if dropout:  # each mask of the global token and feature: a per-shard numbering is detected
        assert detected["LoRA dropout: the same mask on every data shard"]
        assert detected["LoRA dropout: a row-parallel input's features numbered per mp shard"]


def _lora_steps_report(steps=2, dropout=0.1):
    from meshlm.parallel.layout import Layout
    from meshlm.proof import model_problem, verify
    from meshlm.proof.lora import lora_problem

    lay = Layout(dp=2, mp=2)
    cfg = get_config("tiny-llama").replace(
        lora_rank=2, lora_alpha=4.0, lora_targets="q,down", lora_dropout=dropout
    )
    with jax.enable_x64(True):
        return verify(
            lora_problem(model_problem(cfg, "tiny-llama", lay, 2, 8)),
            lay,
            dtype=np.float64,
            steps=steps,
            controls=(),
        )


# slow: its cost (a 2x2 float64 proof with 2 AdamW steps, ~15 CPU-s); LoRA's loss and gradients: the 2x2
# proof above, quick
@pytest.mark.slow
def test_verify_lora_proves_k_adamw_steps_of_the_adapters_and_the_base_kept():
    """``verify --lora-rank --steps K`` (issue 59): training's step (AdamW of the adapters alone, each
    token's dropout seed of the step's count) against the unsharded optax step of the adapters, every
    adapter and its AdamW moments within 1e-12 after each of 2 steps, no optimizer state for the base,
    and the sharded base bitwise its start."""
    from meshlm.proof import format_report

    report = _lora_steps_report()
    assert report.ok, format_report(report)
    paths = {p.path: p for p in report.params}
    adapters = [p for p in paths if lora.is_adapter(p)]
    assert len(adapters) == 4 and max(paths[p].max_rel_err for p in adapters) <= 1e-12
    moments = [p for p in paths if p.startswith("opt_state")]
    assert moments and all(paths[p].ok for p in moments)  # the counters (mu/nu fold into the adapters' rows)
    (kept,) = [c for c in report.checks if c["name"] == "LoRA: frozen base unchanged by the steps"]
    assert kept["ok"] and "base leaves bitwise their start" in kept["detail"], kept
    (steps,) = [c for c in report.checks if "reference is not the sharded program" in c["name"]]
    assert "training steps" in steps["detail"], steps


# slow: its cost (a second 2-step LoRA proof); the row's pass: the test above
@pytest.mark.slow
def test_a_step_that_moves_the_frozen_base_fails_the_lora_proof(monkeypatch):
    """The mutant: both steps put the adapters back into a base moved by 1e-3 (``Adapters.put`` is the
    one both share, so every value agrees): only the frozen-base row can see it, and fails."""
    moved = lambda params, trained: lora.combine(
        jax.tree.map(lambda x: x * 1.001, lora.base(params)), trained
    )
    monkeypatch.setattr(lora.Adapters, "put", staticmethod(moved))
    report = _lora_steps_report(dropout=0.0)
    (kept,) = [c for c in report.checks if c["name"] == "LoRA: frozen base unchanged by the steps"]
    assert not kept["ok"] and "moved: " in kept["detail"] and not report.ok


def test_bad_targets_are_one_line():
    from meshlm.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown target.*'x'.*valid: q,k,v,o,gate,up,down"):
        get_config("tiny-llama").replace(lora_rank=2, lora_targets="q,x")
    with pytest.raises(ConfigError, match="valid: q,k,v,o$"):  # a mixture of experts: no dense MLP
        get_config("tiny-mixtral").replace(lora_rank=2, lora_targets="gate")
    with pytest.raises(ConfigError, match="has no LoRA targets"):
        get_config("tiny").replace(lora_rank=2, lora_targets="q")
    # multi-head latent attention takes no adapters (DeepSeek-V3: a mixture of experts, so none at all;
    # it used to be accepted with no adapter created, and verify crashed on an empty adapter tree)
    with pytest.raises(ConfigError, match="no LoRA targets .multi-head latent attention takes no adapters"):
        get_config("tiny-deepseek-v3").replace(lora_rank=2, lora_targets="q")


def test_bad_dropout_is_one_line_and_refused_where_its_mask_cannot_go():
    from meshlm.errors import ConfigError
    from meshlm.parallel.layout import Layout
    from meshlm.proof.dpo import prove_dpo
    from meshlm.sharding.pipelined import check_pipelined
    from meshlm.train.dpo import check_dpo
    from meshlm.train.lora import LoraSettings, with_lora

    llama = get_config("tiny-llama")
    for p in (1.0, -0.1, float("nan")):
        with pytest.raises(ConfigError, match=r"lora_dropout must be .*\[0, 1\)"):
            llama.replace(lora_rank=2, lora_targets="q", lora_dropout=p)
    with pytest.raises(ConfigError, match="--lora-dropout need --lora-rank"):
        llama.replace(lora_dropout=0.1)
    with pytest.raises(ConfigError, match="--lora-dropout applies to LoRA adapters"):  # the flags alike
        with_lora(LoraSettings(lora_dropout=0.1), llama)
    with pytest.raises(ConfigError, match="more than one kind.*drop --lora-dropout"):
        get_config("tiny-mixtral").replace(lora_rank=2, lora_targets="q", lora_dropout=0.1)
    cfg = llama.replace(lora_rank=2, lora_targets="q", lora_dropout=0.1)
    with pytest.raises(ConfigError, match="--pp does not take --lora-dropout"):
        check_pipelined(cfg, Layout(pp=2, microbatches=2))
    with pytest.raises(ConfigError, match="trains without dropout.*drop --lora-dropout"):
        check_dpo(cfg)
    with pytest.raises(ConfigError, match="trains without dropout"):  # nor does its proof take it
        prove_dpo(cfg, "tiny-llama", Layout(dp=2), 4, 8)


def test_dropout_masks_and_changes_the_gradient_in_the_train_step_only():
    """P of the adapters' inputs dropped (the rest scaled by 1 / (1 - P)), another mask per layer,
    target and step; the gradient differs from P = 0's; a batch without the train step's seeds (eval,
    generate) computes P = 0's loss and gradients bitwise."""
    import haiku as hk
    import jax.numpy as jnp

    from meshlm.model import lora_dropout
    from meshlm.model.transformer import loss_fn
    from meshlm.parallel.context import Parallel
    from meshlm.sharding.spmd import reference_value_and_grad

    cfg = get_config("tiny-llama").replace(lora_rank=2, lora_alpha=4.0, lora_targets="q,o", lora_dropout=0.25)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 17), 0, cfg.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    seeded = lora_dropout.with_seeds(batch, 0, 0)
    x = jnp.ones((2, 16, cfg.d_model))
    masks = {}
    for layer, path, step in ((0, "attn/wq", 0), (1, "attn/wq", 0), (0, "attn/wo", 0), (0, "attn/wq", 1)):
        with lora_dropout.scope(cfg, lora_dropout.with_seeds(batch, 0, step)[lora_dropout.SEEDS]):
            lora_dropout._scopes[-1]["layer"] = jnp.uint32(layer)
            masks[layer, path, step] = np.asarray(
                lora_dropout.dropped(cfg, Parallel(), path, x, x.shape[-1:])
            )
    one = masks[0, "attn/wq", 0]
    assert abs((one == 0).mean() - 0.25) < 0.02  # 2048 draws: 4.5 standard deviations
    np.testing.assert_array_equal(np.unique(one), np.asarray([0.0, 1 / 0.75], np.float32))
    assert all((m != one).mean() > 0.2 for k, m in masks.items() if k != (0, "attn/wq", 0))
    init = hk.transform(loss_fn(cfg, Parallel())).init
    params = init(jax.random.PRNGKey(0), batch)
    drawn = jax.tree.map(
        lambda a: 0.5 * jax.random.normal(jax.random.PRNGKey(2), a.shape), lora.adapters(params)
    )
    params = lora.combine(lora.base(params), drawn)  # B != 0: A's gradient too
    grad = jax.jit(reference_value_and_grad(lambda par: loss_fn(cfg, par)))
    off = jax.jit(reference_value_and_grad(lambda par: loss_fn(cfg.replace(lora_dropout=0.0), par)))
    (_, g_on), (l_eval, g_eval), (l_off, g_off) = (
        grad(params, seeded),
        grad(params, batch),
        off(params, seeded),
    )
    assert l_eval == l_off and jax.tree.all(jax.tree.map(np.array_equal, g_eval, g_off))
    for name, g in lora.adapters(g_on)["layers/attn"].items():
        ref = np.asarray(g_off["layers/attn"][name])
        assert np.abs(np.asarray(g) - ref).max() > 1e-2 * np.abs(ref).max(), name


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return saved_tiny_base(tmp_path_factory.mktemp("lora"))


# slow: LoRA training, its checkpoint and resume (its cost); LoRA training on a converted model runs quick in
# tests/test_docs_commands.py (finetuning.md), an exact resume in tests/test_resume.py
@pytest.mark.slow
def test_train_saves_adapters_only_resumes_bitwise_refuses_another_base(base, tmp_path, capsys):
    """With --lora-dropout: the masks are of the step's count, so the resumed step draws the same."""
    from meshlm.io.checkpoint import Checkpointer
    from meshlm.io.model_io import save_model
    from meshlm.train.step import init_model

    ck, text = base
    argv = ["train", "--checkpoint", str(ck), "--lora-rank", "2", "--lora-alpha", "4", "--lora-targets"]
    argv += ["q,v,down", "--data", str(text), "--batch-size", "4", "--seq-len", "32", "--steps", "2"]
    argv += [
        "--save-every",
        "1",
        "--mesh",
        "2x2",
        "--lr",
        "1e-2",
        "--warmup-steps",
        "0",
        "--lora-dropout",
        "0.1",
    ]
    out = tmp_path / "run"
    assert run_cli(*argv, "--out", str(out)) == 0
    with Checkpointer(out) as c:
        meta = c.read_meta(2)
    assert len(meta["lora_base"]) == 16 and meta["model_config"]["lora_rank"] == 2
    assert meta["model_config"]["lora_dropout"] == 0.1
    arrays = _arrays(out, 2)  # the adapters and their AdamW moments, nothing of the base
    params = [k for k in arrays if k.startswith("['params']")]
    assert len(params) == 6 and all("lora_" in k for k in params), params
    assert all("lora_" in k for k in arrays if ".mu[" in k or ".nu[" in k)
    again = tmp_path / "again"  # resumed from step 1: step 2's adapters and AdamW state bit for bit
    shutil.copytree(out, again)
    shutil.rmtree(again / "2")
    assert run_cli(*argv, "--out", str(again)) == 0
    assert _arrays(again, 2) == arrays
    peft = tmp_path / "peft"  # the export names the dropout the adapters were trained with
    assert run_cli("convert", "--to-peft", str(out), "--out", str(peft), "--mesh", "1x1") == 0
    assert json.loads((peft / "adapter_config.json").read_text())["lora_dropout"] == 0.1
    other = tmp_path / "other"  # another base: the resume is refused in one line
    mesh = jax.make_mesh((1, 1), ("dp", "mp"), devices=jax.devices()[:1])
    save_model(other, get_config("tiny-lm"), init_model(get_config("tiny-lm"), mesh, seed=4)[0])
    capsys.readouterr()
    bad = [str(other) if a == str(ck) else a for a in argv]
    assert run_cli(*bad, "--out", str(out), "--steps", "3") == 2
    assert "holds LoRA adapters of another base" in capsys.readouterr().err


def _arrays(run_dir, step) -> dict:
    """The integrity record's {array: shape, dtype, bit fingerprint} of a step (``io.integrity``)."""
    return json.loads((run_dir / str(step) / "integrity" / "metadata").read_text())["arrays"]


# slow: LoRA SFT training under pp, its cost (the adapters' proof under pp is the slow layout above; LoRA
# training and resume: test_train_saves_adapters_only_..., quick)
@pytest.mark.slow
def test_lora_sft_trains_on_a_chat_store_under_pp(tmp_path):
    """SFT + LoRA on a chat store (the masked loss) through the pipeline, --pp 2 with 4 micro-batches:
    the loss moves and only the adapters are saved."""
    from helpers import train_rows
    from test_chat_sft import CONVERSATIONS, EXAMPLES, chat_tokenizer_dir

    from meshlm.io.model_io import save_model
    from meshlm.train.step import init_model

    tok = chat_tokenizer_dir(tmp_path / "tok", (EXAMPLES / "chatml.jinja").read_text())
    store = str(tmp_path / "chat")
    prepare = ["data", "prepare", "--chat", "--tokenizer", str(tok), "--data", str(CONVERSATIONS)]
    assert run_cli(*prepare, "--seq-len", "64", "--val-fraction", "0.2", "--out", store) == 0
    cfg = get_config("tiny-llama").replace(vocab_size=320)
    mesh = jax.make_mesh((1, 1), ("dp", "mp"), devices=jax.devices()[:1])
    save_model(tmp_path / "base", cfg, init_model(cfg, mesh, seed=0)[0], meta={"tokenizer": {"kind": "none"}})
    argv = [
        "train",
        "--checkpoint",
        str(tmp_path / "base"),
        "--data",
        store,
        "--tokenizer",
        f"{store}/tokenizer.json",
    ]
    argv += [
        "--lora-rank",
        "2",
        "--lora-targets",
        "q,v,down",
        "--seq-len",
        "64",
        "--batch-size",
        "4",
        "--lr",
        "3e-2",
    ]
    argv += [
        "--steps",
        "3",
        "--warmup-steps",
        "0",
        "--eval-every",
        "0",
        "--sample-tokens",
        "0",
        "--save-every",
        "3",
    ]
    assert (
        run_cli(*argv, "--pp", "2", "--microbatches", "4", "--mesh", "1x2", "--out", str(tmp_path / "run"))
        == 0
    )
    losses = [r["loss"] for r in train_rows(tmp_path / "run")]
    assert len(losses) == 3 and np.isfinite(losses).all() and losses[-1] != losses[0]
    params = [k for k in _arrays(tmp_path / "run", 3) if k.startswith("['params']")]
    assert len(params) == 6 and all("lora_" in k for k in params), params


def test_plan_counts_adapter_state_only():
    """``meshlm plan``'s estimate: AdamW moments (and gradients) of the adapters alone, none for the
    frozen base; the parameters are the base's plus the adapters'."""
    from meshlm.parallel.layout import Layout
    from meshlm.parallel.placement import bytes_per_device
    from meshlm.perf.plan import analytic, planned_params
    from meshlm.perf.plan_settings import PlanSettings

    cfg = get_config("tiny-llama")
    adapted = cfg.replace(lora_rank=4, lora_targets=TARGETS)
    settings, lay = PlanSettings(batch_size=8, seq_len=32), Layout(dp=2, mp=2)
    full, lo = analytic(cfg, lay, settings), analytic(adapted, lay, settings)
    adapters = bytes_per_device(lora.adapters(planned_params(adapted, lay, settings)[1]))
    assert lo["opt_state"] == 2 * adapters and lo["gradients"] == adapters
    assert lo["params"] == full["params"] + adapters and lo["opt_state"] < full["opt_state"] / 5


def test_controls_of_frozen_gradients_apply_only_without_adapters():
    """A fault only a frozen weight's gradient shows (FSDP's reduce-scatter, SP's norm sum) cannot be
    detected under LoRA: ``for_lora`` keeps it off there, and on where the model has no adapters."""
    from meshlm.parallel.layout import Layout
    from meshlm.proof.control_record import Where
    from meshlm.proof.controls import CONTROLS
    from meshlm.proof.lora import FROZEN_ONLY, for_lora

    names = {c.name for c in CONTROLS}
    assert {"FSDP gradient kept from one data shard", "SP norm gradients not summed over mp"} <= names
    lay = Layout(dp=2, mp=2, fsdp=True, sp=True)
    cfg = get_config("tiny-llama")
    for adapted, want in ((cfg, True), (cfg.replace(lora_rank=2, lora_targets="q"), False)):
        where = Where(cfg=adapted, layout=lay, has_row_bias=False)
        chosen = {c.name for c in for_lora(CONTROLS) if c.applies(where)}
        assert ("FSDP gradient kept from one data shard" in chosen) is want
        assert ("SP norm gradients not summed over mp" in chosen) is want
        assert "dropped all-reduce" in chosen
    assert len(FROZEN_ONLY) == 6


# slow: its cost (a proof with the compiled step's collectives, ~16 CPU-s); no quick test reads LoRA's bound
@pytest.mark.slow
def test_the_communication_bound_counts_the_adapters_replicated_factors():
    """Seen on ``verify --config tiny-gemma3 --mesh 1x2 --lora-rank 2`` (issue 59's sweep): all-reduce
    bytes 229,856 against a bound of 216,456. A column-parallel base's A (a row-parallel base's B) is
    replicated over mp and its gradient a partial sum there, all-reduced: the bound now counts it
    (``perf.memory_collectives.lora_replicated``), and the communication rows pass."""
    from meshlm.parallel.layout import Layout
    from meshlm.proof import format_report, model_problem, verify
    from meshlm.proof.lora import lora_problem

    lay = Layout(mp=2)
    cfg = get_config("tiny-gemma3").replace(lora_rank=2, lora_alpha=4.0, lora_targets="q,k,v,o")
    report = verify(
        lora_problem(model_problem(cfg, "tiny-gemma3", lay, 1, 16)), lay, controls=(), collectives=True
    )
    rows = {c["name"]: c for c in report.checks}
    assert rows["all-reduce bytes per step"]["ok"] and rows["all-reduces per step"]["ok"], format_report(
        report
    )
