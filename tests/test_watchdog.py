"""The stall watch (``parallel.watchdog``, issue 59): a blocking read of a device program's output that
outlasts ``MESHLM_STALL_TIMEOUT`` ends the process with one line naming the program and its mesh, exit
3; reads that each finish are progress, however long they take together; a bad limit is one line
before any work. The programs block in a host callback that sleeps (a stand-in for devices that never
finish), on 2 devices so that the read, not the dispatch, waits for them; each in a subprocess."""

import os
import subprocess
import sys
import textwrap

import pytest
from helpers import run_cli

from meshlm.parallel import watchdog

# A 2-device program (a psum over a callback that sleeps SLEEP s), read back READS times under a name.
PROGRAM = textwrap.dedent(
    """
    import sys, time
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from meshlm.parallel import watchdog
    from meshlm.parallel.placement import to_host

    sleep, reads = float(sys.argv[1]), int(sys.argv[2])
    if sys.argv[3:] == ["bar"]:  # a progress bar on stderr, as the train loop draws one
        from tqdm import tqdm

        bar = tqdm(total=10, desc="train", unit="step", file=sys.stderr)
        bar.update(1)
    mesh = jax.make_mesh((2,), ("mp",), devices=jax.devices()[:2])
    slow = lambda x: (time.sleep(sleep), x)[1]
    body = lambda x: jax.lax.psum(jax.pure_callback(slow, jax.ShapeDtypeStruct(x.shape, x.dtype), x), "mp")
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("mp"), out_specs=P()))
    x = jax.device_put(jnp.ones(4), NamedSharding(mesh, P("mp")))
    with watchdog.program("the test's step", "1x2"):
        for _ in range(reads):
            to_host(step(x))
    print("finished")
    """
)


def _run(sleep: float, reads: int, limit: str, *extra: str):
    env = {**os.environ, watchdog.ENV: limit}
    argv = [sys.executable, "-c", PROGRAM, str(sleep), str(reads), *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)


def test_a_program_that_never_finishes_ends_with_one_line():
    """The line starts a line of its own below the progress bar (issue 66, item 5: it was glued to the
    bar's carriage-returned line), and says a step longer than the limit is the other possibility."""
    out = _run(600, 1, "1", "bar")
    assert out.returncode == watchdog.STALL_EXIT_CODE == 3, out.stderr[-2000:]
    lines = out.stderr.strip().split("\n")  # not splitlines: the bar's carriage returns are not lines
    assert lines[-1].startswith("meshlm: error: the test's step on mesh 1x2 made no progress for 1 s")
    assert "train:" in lines[-2]  # the bar, ended before the error
    assert "or one step longer than that" in lines[-1] and "raise it for steps that long" in lines[-1]
    assert f"{watchdog.ENV} sets the limit" in lines[-1] and "Traceback" not in out.stderr
    assert "finished" not in out.stdout


def test_each_finished_read_is_progress():
    """Five reads of 0.6 s each under a limit of 2 s: 3 s in all, never 2 s without progress."""
    out = _run(sleep=0.6, reads=5, limit="2")
    assert out.returncode == 0 and "finished" in out.stdout, out.stderr[-2000:]


@pytest.mark.parametrize("limit", ["-1", "soon", "inf"])
def test_a_bad_limit_is_one_line_before_any_work(limit, monkeypatch, capsys):
    monkeypatch.setenv(watchdog.ENV, limit)
    assert run_cli("memory", "--config", "tiny-llama", "--mesh", "1x1") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"meshlm: error: {watchdog.ENV}={limit!r} is not a number")


def test_the_limit_defaults_and_zero_turns_the_watch_off(monkeypatch):
    monkeypatch.delenv(watchdog.ENV, raising=False)
    assert watchdog.check_settings().limit_s == watchdog.DEFAULT_LIMIT_S == 1800
    monkeypatch.setenv(watchdog.ENV, "0")
    assert watchdog.check_settings().limit_s == 0
