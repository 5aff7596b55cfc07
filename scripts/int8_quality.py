"""int8 training's quality on the chip (issue 65 item 4): qwen3-0.6b trained twice, bf16 and
``--bf16 --quant int8``, the same data, seed and schedule, and the int8 run's losses over the bf16 run's.

Both runs are ``meshlm train`` in this process (the chip admits one program at a time), one after the
other: the bf16 run first, then the int8 run with ``--compare`` the bf16 run's directory, so the int8
run's own ``loss_curve.png`` draws both runs' curves. The quality figure is the validation loss on the
held-out split at the last step (``val_loss``, evaluated every 100 steps on the same batches in both
runs); the train loss beside it is the mean of the last 20 steps' (the same batches in both: paired).

The data is the main job's (``meshlm train`` without ``--data``): the Python standard library's ``.py``
files, and from scratch a 1024-id byte-level BPE trained on their training split, which sets the
model's vocabulary (docs/training.md): qwen3-0.6b's 28 layers of width 1024 with a 1024-row tied
embedding, 441M parameters, not the preset's 151,936-id vocabulary (596M), whose tokenizer the chip
cannot download. ``--tokenizer PATH`` trains with a tokenizer.json carried there instead (Qwen3's own
gives the full vocabulary; at 4 x 512 its logits, 1.2 GB in float32, fit beside the model).

Batch 4 x 512: 2048 tokens a step, ~0.1 s on a v5e with ``--remat selective``, so the two runs' 600
steps, their compiles and checkpoints fit ~4 minutes of one chip call (8 x 512 adds ~30 s a run), and
300 steps see 614k of the corpus' ~2.8M training tokens: no token twice.

The run directories (each with a checkpoint, ~5 GB) go under ``--runs`` (default: a temporary
directory, deleted at the end); ``--out`` gets two small files: ``int8_quality.png`` (the int8 run's
loss curve, both runs on it) and ``int8_quality.json`` (the summary and both runs' metrics rows; the
bf16 run's figure and rows are there from its end on, for an int8 run that fails). One JSON line last:
the summary.

    PYTHONPATH=src python scripts/int8_quality.py --out OUT                # on the chip, ~200 s
    PYTHONPATH=src python scripts/int8_quality.py --out OUT --cpu-smoke    # tiny-qwen3, 4 steps, CPU
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = 0.02  # the issue's: the int8 run's loss within 2% of the bf16 run's
TAIL = 20  # train steps averaged for the final train loss
RUNS = ("bf16", "int8")

CHIP = (
    "--config", "qwen3-0.6b", "--mesh", "1x1", "--bf16", "--remat", "selective",
    "--batch-size", "4", "--seq-len", "512", "--steps", "300", "--lr", "3e-4", "--warmup-steps", "30",
    "--eval-every", "100", "--eval-batches", "16",
)  # fmt: skip
# the same family (tied embeddings, q/k norms) and remat on docs/*.md with a 300-id BPE of them, on CPU
SMOKE = (
    "--config", "tiny-qwen3", "--mesh", "1x1", "--bf16", "--remat", "selective", "--batch-size", "2",
    "--seq-len", "32", "--steps", "4", "--eval-every", "2", "--eval-batches", "1",
    "--data", str(ROOT / "docs" / "*.md"),
)  # fmt: skip
# every run: one checkpoint, at the end (nothing resumes it); no sample (a generation program to compile)
QUIET = ("--save-every", "0", "--keep", "1", "--sample-tokens", "0", "--json")


class _Tee(io.TextIOBase):
    """stderr as it was (the progress bar, the run's lines), and a copy kept for a failure's message."""

    def __init__(self, stream):
        self.stream, self.kept = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def _train(argv: list[str]) -> dict:
    """``meshlm train ARGV`` in this process; its --json summary. A failed run stops the script with its
    last lines of stderr (its error line; the progress bar's, when it stopped in the loop)."""
    from meshlm.cli import main

    out, err = io.StringIO(), _Tee(sys.stderr)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["train", *argv])
    if code:
        tail = " / ".join(err.kept.getvalue().strip().splitlines()[-3:])
        raise SystemExit(f"int8_quality: `meshlm train {' '.join(argv)}` exited {code}: {tail}"[-2000:])
    return json.loads([ln for ln in out.getvalue().splitlines() if ln.startswith("{")][-1])


def _release() -> None:
    """The finished run's executables and buffers gone before the next run builds its state."""
    import jax

    jax.clear_caches()
    gc.collect()


def _run_rows(rows: list[dict], batch_tokens: int) -> dict:
    """One run's figures from its metrics.jsonl rows: each validation, the last train steps' mean loss,
    the median step time and MFU (the first step, which holds the compile, left out)."""
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "val_loss" in r]
    timed = [r for r in train[1:] if r.get("tokens_per_s")]
    step_ms = statistics.median(batch_tokens / r["tokens_per_s"] for r in timed) * 1e3 if timed else None
    mfu = [r["mfu"] for r in timed if r.get("mfu") is not None]
    return {
        "val_loss": {r["step"]: r["val_loss"] for r in evals},
        "val_bpb": {r["step"]: r["val_bpb"] for r in evals},
        "train_loss_tail": statistics.fmean(r["loss"] for r in train[-TAIL:]),
        "steps": train[-1]["step"] if train else 0,
        "step_ms_median": step_ms,
        "mfu_median": statistics.median(mfu) if mfu else None,
    }


def summarize(rows: dict[str, list[dict]], batch_tokens: int) -> dict:
    """Both runs' figures and the int8 run's over the bf16 run's: the validation loss and bpb at the
    last evaluation, the last train steps' mean loss, and whether the validation loss is within 2%."""
    runs = {name: _run_rows(rows[name], batch_tokens) for name in RUNS}
    f, q = runs["bf16"], runs["int8"]
    last = max(f["val_loss"])
    if last not in q["val_loss"]:
        raise SystemExit(f"int8_quality: the int8 run has no validation at step {last}, the bf16 run's last")
    ratio = q["val_loss"][last] / f["val_loss"][last]
    quality = {
        "step": last,
        "val_loss_ratio": ratio,
        "val_bpb_ratio": q["val_bpb"][last] / f["val_bpb"][last],
        "train_loss_tail_ratio": q["train_loss_tail"] / f["train_loss_tail"],
        "target": TARGET,
        "within_target": abs(ratio - 1) <= TARGET,
    }
    return {"quality": quality, "runs": runs}


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for int8_quality.png and int8_quality.json")
    p.add_argument("--runs", default=None, help="the two run directories' parent (default: temporary)")
    p.add_argument("--tokenizer", default=None, help="a tokenizer.json for both runs (default: bpe-1024)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny-qwen3, batch 2 x 32, 4 steps, on CPU")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = Path(args.runs or tempfile.mkdtemp(prefix="int8-quality-"))
    try:
        summary = _both(args, runs, out)
    finally:
        if args.runs is None:  # ours: the checkpoints go
            shutil.rmtree(runs, ignore_errors=True)
    print(json.dumps(summary))
    return 0


def train_argvs(cpu_smoke: bool, tokenizer: str | None, runs: Path) -> tuple[list[str], list[str]]:
    """``meshlm train``'s arguments for the bf16 run and the int8 run beside it: the same but
    ``--quant int8``, the bf16 run's tokenizer (one BPE, trained once, and the losses per token on one
    axis) and ``--compare`` the bf16 run (its curves in the int8 run's PNG)."""
    base = list(SMOKE if cpu_smoke else CHIP) + list(QUIET)
    tokenizer = tokenizer or ("bpe-300" if cpu_smoke else "")
    first = base + (["--tokenizer", tokenizer] if tokenizer else []) + ["--out", str(runs / "bf16")]
    second = base + ["--quant", "int8", "--tokenizer", str(runs / "bf16" / "tokenizer.json")]
    return first, second + ["--compare", str(runs / "bf16"), "--out", str(runs / "int8")]


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _both(args, runs: Path, out: Path) -> dict:
    """The two runs (``train_argvs``), then the two files into ``out`` (the bf16 run's already after
    it: what a failed int8 run leaves there)."""
    first, second = train_argvs(args.cpu_smoke, args.tokenizer, runs)
    argvs = {"bf16": ["meshlm", "train", *first], "int8": ["meshlm", "train", *second]}
    wall = {"bf16": _train(first)["wall_s"]}
    _release()
    shutil.copyfile(runs / "bf16" / "loss_curve.png", out / "int8_quality.png")
    (out / "int8_quality.json").write_text(
        json.dumps({"argv": argvs, "metrics": {"bf16": _rows(runs / "bf16")}})
    )
    if args.runs is None:  # only the bf16 run's metrics and tokenizer are read from here on
        for sub in (p for p in (runs / "bf16").iterdir() if p.is_dir()):
            shutil.rmtree(sub)
    wall["int8"] = _train(second)["wall_s"]
    _release()
    rows = {name: _rows(runs / name) for name in RUNS}
    tokens = int(first[first.index("--batch-size") + 1]) * int(first[first.index("--seq-len") + 1])
    summary = {**summarize(rows, tokens), "argv": argvs, "wall_s": wall}
    shutil.copyfile(runs / "int8" / "loss_curve.png", out / "int8_quality.png")
    (out / "int8_quality.json").write_text(json.dumps({**summary, "metrics": rows}, indent=1))
    return summary


if __name__ == "__main__":
    sys.exit(main())
