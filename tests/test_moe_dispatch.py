"""--moe-dispatch auto (issue 57): ragged_dot on a TPU or a GPU, the block scan on CPU, resolved where each
command starts (``settings.dispatch_for``) so that what reads the config (the model, the planner, the
proof's controls, bench's implementations) reads the dispatch that runs; a chosen one kept. The
backend is faked by name (as ``test_flash``'s auto attention), or the CPU's "auto" made ragged_dot
(``FAST_DISPATCH``) so that the real commands, on their real CPU devices, show where it reaches."""

import jax
import pytest
from helpers import run_cli

from meshlm.errors import ConfigError
from meshlm.model.config import DISPATCHES, get_config
from meshlm.settings import DISPATCH_CHOICES, FAST_DISPATCH, ExpertDispatch, dispatch_for

MOE = get_config("tiny-mixtral")


class Captured(Exception):
    """Raised by a stand-in for a command's work: the config it was handed, nothing run."""

    def __init__(self, cfg):
        super().__init__("captured")
        self.cfg = cfg


def test_auto_is_ragged_dot_on_tpu_and_gpu_and_blocks_on_cpu(monkeypatch):
    """The choice per backend, a chosen dispatch kept on every backend, a bad one refused; train's step
    config (what its jitted programs compute) takes the faked backend's."""
    from meshlm.generate.generator import as_run_here
    from meshlm.train import run as train_run
    from meshlm.train.config import TrainConfig

    assert DISPATCH_CHOICES == ("auto", *DISPATCHES)  # the settings' copy of the model's names
    assert [dispatch_for("auto", b) for b in ("tpu", "gpu", "cpu")] == ["ragged_dot", "ragged_dot", "blocks"]
    assert ExpertDispatch().moe_dispatch == "auto" and ExpertDispatch().dispatch_kind("tpu") == "ragged_dot"
    for chosen in DISPATCHES:
        assert {dispatch_for(chosen, b) for b in ("tpu", "gpu", "cpu")} == {chosen}
    valid = "valid: auto, blocks, ragged_dot, gmm, dense"
    with pytest.raises(ConfigError, match=f"--moe-dispatch 'grouped'; {valid}"):
        dispatch_for("grouped", "cpu")
    with pytest.raises(ConfigError, match="moe_dispatch='grouped'; valid: auto, blocks"):
        TrainConfig(moe_dispatch="grouped")
    for backend, want in (("tpu", "ragged_dot"), ("gpu", "ragged_dot"), ("cpu", "blocks")):
        monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
        assert train_run.step_config(TrainConfig(), MOE).moe_dispatch == want
        assert train_run.step_config(TrainConfig(moe_dispatch="dense"), MOE).moe_dispatch == "dense"
        assert as_run_here(MOE.replace(moe_dispatch="dense")).moe_dispatch == want  # a loaded checkpoint's
    # the checkpoint keeps the preset's config (what a resume compares): the dispatch is the step's alone
    assert MOE.moe_dispatch == "blocks"


def test_train_takes_moe_dispatch_and_a_resume_may_change_it(capsys):
    from meshlm.train.config import resume_must_match

    assert "moe_dispatch" not in resume_must_match()  # speed, not values: a run resumes under another
    with pytest.raises(SystemExit) as exc:  # the flag's choices, checked before any work
        run_cli("train", "--moe-dispatch", "grouped")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--moe-dispatch: invalid choice: 'grouped'" in err and "'ragged_dot'" in err, err


@pytest.fixture
def accelerated_cpu(monkeypatch):
    """The CPU's "auto" made ragged_dot, as a TPU's is: the real commands on their real devices."""
    monkeypatch.setitem(FAST_DISPATCH, "cpu", "ragged_dot")


def _stop(monkeypatch, target: str, arg: int):
    def stand_in(*args, **kwargs):
        raise Captured(args[arg])

    monkeypatch.setattr(target, stand_in)


def _captured(*argv) -> str:
    with pytest.raises(Captured) as got:
        run_cli(*argv)
    return got.value.cfg.moe_dispatch


def test_the_resolved_dispatch_reaches_verify_bench_and_plan(accelerated_cpu, monkeypatch):
    """verify's config (what the proof's controls read: ``moe_controls``' blocks-only control), bench's
    (its implementations, the ``moe`` section's "dispatch") and plan's (the row bounds and collectives
    of ``perf.activations`` and ``perf.memory_collectives``) hold the resolved dispatch; a chosen one
    is kept."""
    _stop(monkeypatch, "meshlm.cli.verify._prove", 2)
    verify = ("verify", "--config", "tiny-mixtral", "--mesh", "2x1", "--ep", "2", "--devices", "2")
    assert _captured(*verify) == "ragged_dot"
    assert _captured(*verify, "--moe-dispatch", "blocks") == "blocks"
    _stop(monkeypatch, "meshlm.cli.bench._bench", 1)
    bench = ("bench", "--config", "tiny-mixtral", "--mesh", "1x1", "--devices", "1")
    assert _captured(*bench) == "ragged_dot"
    assert _captured(*bench, "--moe-dispatch", "dense") == "dense"
    _stop(monkeypatch, "meshlm.perf.plan_search.plan", 0)
    plan = ("plan", "--config", "tiny-mixtral", "--mesh", "1x1")
    assert _captured(*plan) == "ragged_dot"
    assert _captured(*plan, "--moe-dispatch", "blocks") == "blocks"


def test_a_saved_config_runs_with_the_backends_dispatch(accelerated_cpu, monkeypatch, tmp_path):
    """A checkpoint saved with "blocks" (every config before auto) generates and evaluates with the
    backend's dispatch: the saved value is not read."""
    from meshlm.generate.generator import Generator
    from meshlm.io.model_io import read_config, save_model
    from meshlm.parallel.mesh import make_mesh
    from meshlm.train.step import init_model

    cfg = MOE.replace(n_layers=1, vocab_size=256)  # bytes: eval reads this file
    save_model(tmp_path / "ckpt", cfg, init_model(cfg, make_mesh(1, 1), 0)[0], step=1)
    assert read_config(tmp_path / "ckpt")[0].moe_dispatch == "blocks"
    _stop(monkeypatch, "meshlm.train.evaluation.evaluate_stream", 0)

    def generate(self, *args, **kwargs):
        raise Captured(self.cfg)

    monkeypatch.setattr(Generator, "generate", generate)
    ckpt = ("--checkpoint", str(tmp_path / "ckpt"), "--mesh", "1x1")
    assert _captured("generate", *ckpt, "--prompt", "12") == "ragged_dot"
    assert _captured("eval", *ckpt, "--data", __file__) == "ragged_dot"


# ~60 s on a loaded 2-core machine; ragged_dot's values and gradients in float64, quickly:
# test_ep.py::test_dispatch_equals_all_local (its ragged_dot cases); its rows control:
# test_moe.py::test_the_rows_control_moves_rows_where_they_are_one_block
@pytest.mark.slow
def test_ragged_dot_is_proven_in_float64_on_cpu_with_its_controls():
    """What "auto" runs on an accelerator, proven where CI runs: tiny-qwen2-moe (a dense layer 0, a MoE
    layer with a shared expert) on 2x2 in float64 by ragged_dot, the reference "dense" as always
    (``proof.problem``): loss and every gradient equal the unsharded model's, and the controls are
    ragged_dot's: those of the block scan (a weight gradient added to the neighbour's, the padding
    rows' leak) do not apply, every other MoE control is detected."""
    from helpers import verify_preset

    from meshlm.proof import format_report
    from meshlm.proof.moe_controls import MOE_CONTROLS

    cfg = get_config("tiny-qwen2-moe").replace(n_layers=2, moe_dispatch="ragged_dot")
    with jax.enable_x64(True):
        report = verify_preset(
            "tiny-qwen2-moe", 2, 2, batch=2, seq=8, dtype=jax.numpy.float64, cfg=cfg, controls=MOE_CONTROLS
        )
    assert report.ok and max(p.max_rel_err for p in report.params) <= 1e-12, format_report(report)
    # test_moe's proof by "blocks" runs all but 5 (the capacity's, one of norm_topk_prob's two, gmm's
    # offsets, the scatter-add combine's padding leak, the gathers' absent choices: no ep, no drops); the
    # block scan's neighbour gradient one more
    names = {c["name"] for c in report.controls}
    assert len(names) == len(MOE_CONTROLS) - 6 and not any("neighbour" in n or "padding" in n for n in names)
