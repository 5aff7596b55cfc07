"""A user-defined model proven with ``meshlm.verify``: a bigram-plus-MLP language model written
with meshlm layers and its own rules table (first match wins).

Run: python examples/custom_model.py   (uses 4 fake CPU devices, mesh 2x2)
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from meshlm.model.layers import MLP, VocabEmbed, VocabHead, vocab_parallel_xent  # noqa: E402
from meshlm.parallel.axes import MP  # noqa: E402
from meshlm.parallel.mesh import make_mesh  # noqa: E402
from meshlm.proof import Problem, format_report, verify  # noqa: E402
from meshlm.sharding.rules import param_specs  # noqa: E402

VOCAB, WIDTH, HIDDEN = 128, 64, 256

# The model's own table: path regex -> spec of the parameter's dims (no rule = an error).
RULES = (
    (r"^tok/embeddings$", (MP, None)),
    (r"^tok/b$", (None,)),
    (r"^ffn/w_in$", (None, MP)),
    (r"^ffn/b_in$", (MP,)),
    (r"^ffn/w_out$", (MP, None)),
    (r"^ffn/b_out$", (None,)),
    (r"^out/w$", (None, MP)),
    (r"^out/b$", (MP,)),
)


def build_loss(par):
    """par -> Haiku loss(batch): the same code runs unsharded and inside shard_map."""

    def loss(batch):
        x = VocabEmbed(vocab_size=VOCAB, d_model=WIDTH, par=par, stddev=0.05, bias=True, name="tok")(
            batch["inputs"]
        )
        partial, b = MLP(
            hidden_dim=HIDDEN, par=par, kind="gelu", bias=True, stddev_in=0.05, stddev_out=0.05, name="ffn"
        )(par.f(x))
        x = x + par.row_out(partial, b)
        logits = VocabHead(vocab_size=VOCAB, par=par, stddev=0.05, bias=True, name="out").local_logits(
            par.f(x)
        )
        return par.batch_mean(jnp.mean(vocab_parallel_xent(par, logits, batch["targets"], z_loss=1e-4)))

    return loss


def problem(mp: int) -> Problem:
    rng = np.random.default_rng(0)
    batch = {k: rng.integers(0, VOCAB, (8, 16), dtype=np.int32) for k in ("inputs", "targets")}
    return Problem(build_loss, lambda abstract: param_specs(abstract, mp, RULES), batch, name="custom")


if __name__ == "__main__":
    report = verify(problem(2), make_mesh(2, 2), steps=2)
    print(format_report(report))
    raise SystemExit(0 if report.ok else 1)
