"""Shared by the tests that train: a small deterministic corpus and the `meshlm train` argv for it."""

import sys
from pathlib import Path

TEXT = "def f(x):\n    return x * 2 + 1  # a comment\n" * 400


def write_corpus(directory: Path) -> str:
    for i in range(6):
        (directory / f"f{i}.py").write_text(TEXT.replace("f(", f"g{i}("))
    return str(directory)


def train_args(corpus: str, out, steps: int, *, save_every: int = 3, eval_every: int = 0) -> list[str]:
    """`meshlm train` of the tiny-lm preset on a 2x2 mesh (add --devices or run under launch)."""
    flags = (
        f"--config tiny-lm --steps {steps} --batch-size 8 --seq-len 32 --warmup-steps 2 "
        f"--eval-every {eval_every} --save-every {save_every} --sample-tokens 0 --mesh 2x2"
    )
    return ["train", "--data", corpus, *flags.split(), "--out", str(out)]


def meshlm_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "meshlm", *args]


def wait_for(predicate, timeout_s: float = 240.0, poll_s: float = 0.05) -> bool:
    """Poll ``predicate`` until it holds or ``timeout_s`` passes (waiting on a subprocess, not timing it)."""
    import time

    end = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(poll_s)
    return True


def run_cli(*argv: str) -> int:
    """``meshlm ARGV`` in this process, through ``meshlm.cli.main``: the real error path (a user error
    is one line on stderr and exit code 2). Read the output with pytest's ``capsys``."""
    from meshlm.cli import main

    return main(list(argv))


def run_meshlm(*args: str, timeout: float = 300, **kwargs):
    """``python -m meshlm ARGS`` in a subprocess (a fresh JAX, its own devices); text output captured."""
    import subprocess

    return subprocess.run(meshlm_argv(*args), capture_output=True, text=True, timeout=timeout, **kwargs)


def read_metrics(out) -> list[dict]:
    """Every row of a run directory's metrics.jsonl."""
    import json

    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def train_rows(out) -> list[dict]:
    return [r for r in read_metrics(out) if "loss" in r]


def eval_rows(out) -> list[dict]:
    return [r for r in read_metrics(out) if "val_loss" in r]


def tiny_lm_config(corpus: str, out, **kw):
    """The TrainConfig the training tests start from: the tiny-lm preset on ``corpus``, writing to
    ``out``, batch 8 x 32, one warm-up step, no evaluation, checkpoint or sample until the end;
    ``kw`` changes what a test needs (each test file fixes its own steps and sizes)."""
    from meshlm.train.config import TrainConfig

    base = dict(config="tiny-lm", data=(corpus,), batch_size=8, seq_len=32, warmup_steps=1)
    base |= dict(eval_every=0, eval_batches=1, save_every=0, sample_tokens=0)
    return TrainConfig(**{**base, **kw, "out": str(out)})


def verify_preset(
    name: str, dp: int, mp: int, *, batch: int, seq: int = 16, steps: int = 0, dtype=None, cfg=None, **kw
):
    """``meshlm.verify`` of the preset ``name`` (or ``cfg``) on a dp x mp mesh: random [batch, seq]
    tokens, float32 unless ``dtype``; ``kw`` goes to ``verify`` (controls, collectives, ...)."""
    import jax.numpy as jnp

    from meshlm.model.config import get_config
    from meshlm.parallel.mesh import make_mesh
    from meshlm.proof import model_problem, verify

    problem = model_problem(cfg or get_config(name), name, mp, batch, seq)
    return verify(problem, make_mesh(dp, mp), steps=steps, dtype=dtype or jnp.float32, **kw)


def sharded_logits(cfg, params, tokens, mesh=(2, 2), **axes):
    """[mp, B, T, V] numpy: each model shard's gathered copy of the full logits (``axes``: more of the
    ``Layout``'s, e.g. ep=2)."""
    import haiku as hk
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from meshlm.model.transformer import logits_fn
    from meshlm.parallel.context import Parallel
    from meshlm.parallel.layout import Layout
    from meshlm.sharding.rules import model_specs, shardings

    layout = Layout(*mesh, **axes)
    specs = model_specs(cfg, params, layout)
    apply = hk.transform(logits_fn(cfg, Parallel.on(layout))).apply
    fn = jax.shard_map(
        lambda p, t: apply(p, None, t)[None],
        mesh=layout.mesh,
        in_specs=(specs, layout.spec("batch", None)),
        out_specs=P("mp", *layout.spec("batch", None, None)),
    )
    return np.asarray(jax.jit(fn)(jax.device_put(params, shardings(specs, layout.mesh)), tokens))


def save_lora_run(cfg, base, path, base_path, seed: int = 0) -> dict:
    """A LoRA run at ``path`` of ``cfg`` (its rank, alpha and targets) over the base checkpoint at
    ``base_path`` (``base``: its parameters): random adapters (B nonzero, so they change the model),
    saved with the base's fingerprint as training records it. Returns the adapters."""
    import jax
    import numpy as np

    from meshlm.io.model_io import LORA_BASE, LORA_BASE_PATH, base_fingerprint, save_model
    from meshlm.model import lora
    from meshlm.model.transformer import param_shapes

    rng = np.random.default_rng(seed)
    shapes = lora.adapters(param_shapes(cfg))
    adapters = jax.tree.map(
        lambda s: jax.numpy.asarray(0.2 * rng.standard_normal(s.shape), np.float32), shapes
    )
    save_model(path, cfg, adapters, meta={LORA_BASE: base_fingerprint(base), LORA_BASE_PATH: str(base_path)})
    return adapters


def saved_tiny_base(directory):
    """A random tiny-lm saved as a checkpoint in ``directory``/base (seed 3) and a text file beside it:
    (checkpoint path, text path), the base the LoRA tests fine-tune."""
    import jax

    from meshlm.io.model_io import save_model
    from meshlm.model.config import get_config
    from meshlm.train.step import init_model

    out = directory / "base"
    cfg = get_config("tiny-lm")
    mesh = jax.make_mesh((1, 1), ("dp", "mp"), devices=jax.devices()[:1])
    save_model(out, cfg, init_model(cfg, mesh, seed=3)[0])
    text = directory / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog; " * 120)
    return out, text


def jitted_vjp(fn, args, dout):
    """(fn(*args), its gradients against ``dout``) as one compiled program, as the model runs a kernel
    (one program, not one per operation)."""
    import jax

    def both(args, dout):
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(dout)

    return jax.jit(both)(args, dout)
