"""verify compiles each program once, and a checkpoint's proof compiles no init (issue 66, item 8:
its time was XLA compiling one program after another). The controls' programs compile on a pool
while the proof runs (``proof.ahead``); the report is the sequential proof's, bit for bit."""

import dataclasses
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import compiler

from meshlm.model.config import get_config
from meshlm.parallel.layout import Layout
from meshlm.proof import model_problem, verify
from meshlm.proof.ahead import Compiler, cores, idle_workers
from meshlm.proof.controls import CONTROLS
from meshlm.proof.runs import Runs

LAYOUT = Layout(mp=2)
# one of each kind: a planted loss-and-gradients program, a training step's, a communication check's
KINDS = (
    "dropped all-reduce",
    "per-shard gradient-norm clipping",
    "extra all-reduce after each row-parallel one",
)
CHOSEN = tuple(c for c in CONTROLS if c.name in KINDS)


def _checkpoint_problem():
    problem = model_problem(get_config("tiny-llama"), "tiny-llama", LAYOUT, 1, 8)
    params = Runs(problem, LAYOUT, jnp.float64, 0).params  # as a checkpoint's, read on the layout
    return dataclasses.replace(problem, load_params=lambda layout: params)


def test_a_checkpoints_proof_compiles_each_program_once_and_concurrently_the_same(monkeypatch):
    """Every XLA program of a checkpoint's proof (its controls of every kind, the communication check)
    is compiled once: the optimizer's initial state, the honest step's collectives and the traces the
    inertness check made used to be compiled again by the controls that share them, and the init
    program ran for parameters the checkpoint then replaced. The rows with two compiling threads are
    those without any, bit for bit (float64: the x64 switch is the calling thread's, not the pool's)."""
    with jax.enable_x64(True):
        _compiles_once_and_the_same(monkeypatch, _checkpoint_problem())


def _compiles_once_and_the_same(monkeypatch, problem):
    compiled: Counter = Counter()
    real = compiler.compile_or_get_cached

    def counting(backend, computation, devices, *args, **kwargs):  # every compile asked of XLA
        compiled[str(computation), tuple(d.id for d in np.ravel(devices))] += 1
        return real(backend, computation, devices, *args, **kwargs)

    monkeypatch.setattr(compiler, "compile_or_get_cached", counting)
    ahead = verify(problem, LAYOUT, dtype=jnp.float64, controls=CHOSEN, collectives=True, compile_workers=2)
    monkeypatch.setattr(compiler, "compile_or_get_cached", real)
    assert ahead.ok and [c["name"] for c in ahead.controls] == list(KINDS), ahead.controls
    twice = [text.splitlines()[0] for (text, _), n in compiled.items() if n > 1]
    assert twice == [], twice
    assert compiled and not any("threefry" in text for text, _ in compiled), "the init program compiled"
    one_thread = verify(
        problem, LAYOUT, dtype=jnp.float64, controls=CHOSEN, collectives=True, compile_workers=0
    )
    assert one_thread.to_json() == ahead.to_json()


def test_the_compiling_threads_are_the_idle_cores_less_the_main_thread():
    assert [idle_workers(2, load) for load in (0.0, 0.4, 1.4, 2.6, 12.0)] == [1, 1, 1, 0, 0]
    assert idle_workers(13, 1.0) == 12 and idle_workers(1, 0.0) == 0
    with Compiler() as c:
        assert 0 <= c.workers < cores()
    with Compiler(0) as c:  # none: each program compiled where it is asked for, its error kept
        future = c.submit(lambda: 1 / 0)
        assert isinstance(future.exception(), ZeroDivisionError)
