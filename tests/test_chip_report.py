"""``scripts/chip_report.py`` (every chip figure in one process, docs/benchmarks.md "The chip report"):
its CPU smoke runs a job in-process through ``meshlm.cli.main``, parses its JSON and writes both files;
a job that fails is a row with its error line, not the end of the report; off a chip without
``--cpu-smoke`` it refuses."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("chip_report", ROOT / "scripts" / "chip_report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_chip_report_cpu_smoke_writes_every_job_and_its_failures(tmp_path):
    script = _script()
    out = tmp_path / "report"
    code = script.main(
        ["--cpu-smoke", "--out", str(out), "--groups", "plan", "--only", "0.6b remat=full batch=1"]
    )
    assert code == 0
    doc = json.loads((out / "chip_report.json").read_text())
    (job,) = doc["jobs"]
    assert job["code"] == 0 and job["error"] is None
    assert job["output"]["plan"]["compiled"]["peak"] > 0  # the plan's JSON, parsed
    assert "| plan (cpu) |" in (out / "chip_report.md").read_text()
    bad = script.Job("plan", "bad", ("plan", "--config", "no-such-model", "--json"))
    res = script.run_job(bad, bad.argv)
    assert res.code == 2 and "no-such-model" in res.error and res.output is None


def test_chip_report_refuses_off_a_chip(tmp_path, capsys):
    assert _script().main(["--out", str(tmp_path), "--groups", "plan", "--only", "batch=1"]) == 2
    assert "no accelerator here" in capsys.readouterr().out


def test_the_int8_group_times_bf16_and_int8_side_by_side_in_one_bench_run_each():
    """Issue 65 item 3's jobs (llama-100m 8 x 512, qwen3-0.6b 8 x 2048 with the loss in chunks, a MoE):
    each one bench command the CLI accepts, timing meshlm and meshlm-int8 together (their ratio and the
    int8 MFU come from bench: tests/test_quant.py's bench test); its CPU smoke a MoE under int8."""
    from meshlm.cli import build_parser

    script = _script()
    jobs = [j for j in script._int8_jobs() if j.argv[0] == "bench"]
    assert [j.name.split()[0] for j in jobs] == ["llama-100m", "qwen3-0.6b", "qwen3-0.6b", "qwen3-moe-100m"]
    impls = []
    for job in jobs:
        args = build_parser().parse_args(list(job.argv))
        assert (args.quant, args.batch_size, args.compute_dtype) == ("int8", 8, "bfloat16"), job.argv
        impls.append(args.impls)
    # qwen3-0.6b does not fit twice on the chip: each implementation alone, their ratio from the rows
    assert impls == ["meshlm,meshlm-int8", "meshlm", "meshlm-int8", "meshlm,meshlm-int8"]
    assert "--loss-chunk" in jobs[1].argv and "tiny-qwen3-moe" in jobs[0].smoke
    results = [
        script.Result(
            job, output={"results": [{"impl": job.argv[job.argv.index("--impls") + 1], "step_s_median": t}]}
        )
        for job, t in zip(jobs[1:3], (1.0, 0.8), strict=True)
    ]
    (row,) = script._alone_ratios(results)
    assert (
        "| qwen3-0.6b 8x2048 full | meshlm-int8/meshlm step time (alone, unpaired) | 0.800 = 1.25x |" in row
    )


def test_a_jobs_environment_is_set_while_it_runs_and_restored(monkeypatch):
    script = _script()
    monkeypatch.delenv("MESHLM_DENSE_BACKWARD", raising=False)
    # a bad value reaches the job (its error line names it) and is gone after it
    bad = script.Job("one-chip", "env", ("verify", "--config", "tiny", "--mesh", "1x1", "--seq-len", "8"))
    bad = script.Job(bad.group, bad.name, bad.argv, env=(("MESHLM_DENSE_BACKWARD", "nope"),))
    res = script.run_job(bad, bad.argv)
    assert res.code == 2 and "MESHLM_DENSE_BACKWARD='nope'" in res.error
    assert "MESHLM_DENSE_BACKWARD" not in os.environ


def _quality_script():
    spec = importlib.util.spec_from_file_location("int8_quality", ROOT / "scripts" / "int8_quality.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_int8_quality_job_trains_qwen3_06b_300_steps_in_bf16_then_int8_beside_it(tmp_path):
    """Issue 65 item 4 on the chip (scripts/int8_quality.py): two `meshlm train` runs the CLI accepts,
    equal but for --quant int8, the int8 one on the bf16 one's tokenizer and drawing its curves
    (--compare); the summary's ratio of the last validation losses against the 2% target; the report's
    row of it; a failed run's error line in the script's; the job writes into the report's --out."""
    from meshlm.cli import build_parser
    from meshlm.cli.train import train_config

    quality = _quality_script()
    (job,) = [j for j in _script()._int8_jobs() if "quality" in j.name]
    assert job.argv == ("scripts/int8_quality.py", "--out", "{out}")
    first, second = quality.train_argvs(False, None, tmp_path)
    f, q = (train_config(build_parser().parse_args(["train", *argv])) for argv in (first, second))
    assert (f.config, f.steps, f.batch_size, f.seq_len, f.eval_every, f.sample_tokens) == (
        "qwen3-0.6b",
        300,
        4,
        512,
        100,
        0,
    )
    assert (f.quant, q.quant, f.compute_dtype, f.tokenizer) == ("none", "int8", "bfloat16", "")
    assert q.compare == f.out and q.tokenizer == f"{f.out}/tokenizer.json" and q.out != f.out
    unequal = {k for k in vars(f) if getattr(f, k) != getattr(q, k)}
    assert unequal == {"quant", "compare", "tokenizer", "out"}, unequal

    def rows(val, train):  # an eval at 0 and 300, train losses 1..300
        return (
            [{"step": 0, "val_loss": 7.0, "val_bpb": 4.0}]
            + [{"step": s, "loss": train, "tokens_per_s": 2048 / 0.1} for s in range(1, 301)]
            + [{"step": 300, "val_loss": val, "val_bpb": val / 2}]
        )

    summary = quality.summarize({"bf16": rows(3.0, 3.2), "int8": rows(3.09, 3.2)}, 2048)
    assert summary["quality"]["val_loss_ratio"] == pytest.approx(1.03) and summary["quality"]["step"] == 300
    assert not summary["quality"]["within_target"] and summary["quality"]["train_loss_tail_ratio"] == 1.0
    assert summary["runs"]["int8"]["step_ms_median"] == pytest.approx(100.0)
    ok = quality.summarize({"bf16": rows(3.0, 3.2), "int8": rows(3.05, 3.3)}, 2048)["quality"]
    assert ok["within_target"] and ok["train_loss_tail_ratio"] == pytest.approx(3.3 / 3.2)
    with pytest.raises(SystemExit, match="no validation at step 300"):
        quality.summarize({"bf16": rows(3.0, 3.2), "int8": rows(3.0, 3.2)[:-1]}, 2048)
    with pytest.raises(SystemExit, match="exited 2: meshlm: error: .*no-such-model"):  # its error line
        quality._train(["--config", "no-such-model", "--out", str(tmp_path / "bad")])
    output = json.loads(json.dumps(summary))  # as the report reads it: the steps' keys are strings
    table = "\n".join(_script()._quality_rows(_script().Result(job, output=output)))
    assert "| int8 | 100.00 | | | | 3.0900 |" in table
    assert "| int8/bf16 val loss, step 300 | 1.0300 (train, last steps: 1.0000), NOT within 2% |" in table


# slow: two tiny trainings in-process (~20 s quiet, over a minute under load); the quick
# test_the_int8_quality_job_trains_qwen3_06b_300_steps_in_bf16_then_int8_beside_it catches a wrong
# argument list, summary or report row
@pytest.mark.slow
def test_the_int8_quality_cpu_smoke_writes_both_curves_and_the_ratio_into_the_reports_out(tmp_path):
    script = _script()
    out = tmp_path / "report"
    argv = ["--cpu-smoke", "--out", str(out), "--groups", "int8", "--only", "quality"]
    assert script.main(argv) == 0
    (job,) = json.loads((out / "chip_report.json").read_text())["jobs"]
    assert job["code"] == 0 and job["error"] is None, job
    quality = job["output"]["quality"]
    assert quality["step"] == 4 and abs(quality["val_loss_ratio"] - 1) < 0.02
    # only the small files come back: no run directory (checkpoints) under --out
    assert sorted(p.name for p in out.iterdir()) == [
        "chip_report.json",
        "chip_report.md",
        "int8_quality.json",
        "int8_quality.png",
    ]
    assert (out / "int8_quality.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((out / "int8_quality.json").read_text())
    assert [len([r for r in saved["metrics"][n] if "loss" in r]) for n in ("bf16", "int8")] == [4, 4]
    assert "int8/bf16 val loss, step 4" in (out / "chip_report.md").read_text()


def test_the_kv_write_job_times_scatter_and_kernel_and_decode_runs_both_ways(tmp_path):
    """Issue 64: the cache write alone (scripts/kv_write.py: its CPU smoke, interpret mode, the two ways'
    caches equal) and the bf16 decode with the kernel's writes (the TPU's default) and with the scatter's."""
    script = _script()
    code = script.main(["--cpu-smoke", "--out", str(tmp_path), "--groups", "kernels", "--only", "kv write"])
    assert code == 0
    (job,) = json.loads((tmp_path / "chip_report.json").read_text())["jobs"]
    (row,) = job["output"]["rows"]
    assert job["code"] == 0 and row["equal"] is True and row["scatter_us"] > 0 and row["kernel_us"] > 0
    assert "scatter / kernel us a write" in (tmp_path / "chip_report.md").read_text()
    jobs = {j.name: j for j in script._kernel_jobs()}
    kernel, scatter = jobs["decode bf16 prompt 512"], jobs["decode scatter bf16 prompt 512"]
    assert (
        kernel.argv == scatter.argv and dict(scatter.env) == {"MESHLM_KV_WRITE": "scatter"} and not kernel.env
    )


def test_the_experts_jobs_run_the_scatter_combine_beside_the_gathers():
    """Issue 64: the experts' bench and step profile with the rows moved by gathers (the default) and
    the same command with ``MESHLM_MOE_COMBINE=scatter`` (the scatter-adds they replaced)."""
    script = _script()
    kernels, profile = ({j.name: j for j in f()} for f in (script._kernel_jobs, script._profile_jobs))
    for jobs, name in ((kernels, "experts qwen3-moe-100m"), (profile, "step qwen3-moe-100m")):
        gathers, scatters = jobs[name], jobs[f"{name} scatter combine"]
        assert gathers.argv == scatters.argv and not gathers.env
        assert dict(scatters.env) == {"MESHLM_MOE_COMBINE": "scatter"}


def test_the_decode_profile_job_is_a_row_and_the_floor_jobs_shrink_the_model(tmp_path):
    """Issue 64: scripts/decode_profile.py's step (its CPU smoke) is one markdown row with its wall and
    device time a step; the floor jobs run the same script with ``--shrink`` at batch 1 and 8."""
    script = _script()
    argv = ["--cpu-smoke", "--out", str(tmp_path), "--groups", "kernels", "--only", "decode profile bf16"]
    assert script.main(argv) == 0
    jobs = json.loads((tmp_path / "chip_report.json").read_text())["jobs"]
    assert [j["code"] for j in jobs if j["output"]] == [0]
    md = (tmp_path / "chip_report.md").read_text()
    assert "| decode profile bf16 | decode tiny-llama batch 2 float32 |" in md and "device ops" in md
    floors = [j for j in script._kernel_jobs() if j.name.startswith("decode floor")]
    assert [j.argv[-3:] for j in floors] == [("--batch", "1", "--shrink"), ("--batch", "8", "--shrink")]


def test_the_decode_chunks_job_times_each_length_with_the_same_tokens(tmp_path):
    """Issue 64: scripts/decode_chunks.py at several chunk lengths (its CPU smoke: 8 and 16), one
    markdown row with each length's ms a step and whether the tokens were single steps' at each."""
    script = _script()
    argv = ["--cpu-smoke", "--out", str(tmp_path), "--groups", "kernels", "--only", "decode chunks"]
    assert script.main(argv) == 0
    jobs = [j for j in json.loads((tmp_path / "chip_report.json").read_text())["jobs"] if j["output"]]
    assert [j["code"] for j in jobs] == [0] and jobs[0]["output"]["same_tokens"] is True
    md = (tmp_path / "chip_report.md").read_text()
    assert "| decode chunks 16 8 32 64 bf16 b1 | decode batch 2 bfloat16: chunk " in md and "chunk 16 " in md


def test_no_job_name_holds_a_comma_and_the_experts_pairs_double_the_tokens():
    """``--only`` splits its list on commas: a job named "chunks 16,8" would match every job naming an
    "8" (a chip call once ran two unplanned jobs so). The a3b pairs: dense-eq beside ragged_dot at batch 8
    and 16, float32 and bf16 moments (what grows with the tokens, what does not)."""
    script = _script()
    jobs = [j for f in script.GROUPS.values() for j in f()]
    assert not [j.name for j in jobs if "," in j.name]
    a3b = {j.name: j.argv for j in script._kernel_jobs() if j.name.startswith("experts a3b")}
    for name, argv in a3b.items():
        text = " ".join(argv)
        assert "--impls ragged_dot-dispatch,dense-eq" in text and "qwen3-moe-a3b-chip" in text
        assert ("--batch-size 16" in text) == ("b16" in name)
        assert ("--opt-dtype bf16" in text) == ("bf16 moments" in name)
    assert len(a3b) == 4


def test_the_decode_values_and_vmem_jobs_pair_each_case(tmp_path):
    """Issue 64: batch 1's values apart against fused (``MESHLM_FLAT_VALUES``), a pair a case, and the
    decode programs' VMEM options (``MESHLM_DECODE_XLA_OPTIONS``: default, the copies' overlap ratio,
    VMEM assignment off), three a case; the fused one's CPU smoke runs under its environment."""
    script = _script()
    jobs = script._kernel_jobs()
    values = {j.name: dict(j.env) for j in jobs if j.name.startswith("decode values")}
    assert len(values) == 6 and all(env["MESHLM_FLAT_VALUES"] in name for name, env in values.items())
    vmem = [j for j in jobs if j.name.startswith("decode vmem")]
    assert len(vmem) == 12 and not any(j.smoke for j in vmem)  # the v5e compiler's options
    for j in vmem:
        options = dict(j.env)["MESHLM_DECODE_XLA_OPTIONS"]
        assert (json.loads(options) if options else {}) == (
            json.loads(script._jobs.VMEM_OPTIONS[j.name.split()[2]]) if j.name.split()[2] != "default" else {}
        )
    argv = [
        "--cpu-smoke",
        "--out",
        str(tmp_path),
        "--groups",
        "kernels",
        "--only",
        "decode values fused bf16 512",
    ]
    assert script.main(argv) == 0
    ran = [j for j in json.loads((tmp_path / "chip_report.json").read_text())["jobs"] if j["output"]]
    assert [j["code"] for j in ran] == [0] and ran[0]["env"] == {"MESHLM_FLAT_VALUES": "fused"}
    assert ran[0]["output"]["same_tokens"] is True
