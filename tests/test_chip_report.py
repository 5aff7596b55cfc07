"""``scripts/chip_report.py`` (every chip figure in one process, docs/benchmarks.md "The chip report"):
its CPU smoke runs a job in-process through ``meshlm.cli.main``, parses its JSON and writes both files;
a job that fails is a row with its error line, not the end of the report; off a chip without
``--cpu-smoke`` it refuses."""

import importlib.util
import json
import os
import sys
from pathlib import Path

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
    jobs = script._int8_jobs()
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
    kernel, scatter = jobs["decode bf16 prompt 512"], jobs["decode bf16 prompt 512 scatter"]
    assert (
        kernel.argv == scatter.argv and dict(scatter.env) == {"MESHLM_KV_WRITE": "scatter"} and not kernel.env
    )
