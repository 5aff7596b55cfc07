"""Each test's CPU time, for ranking tests on a shared machine where wall time is noise.

``MESHLM_CPU_TIMES=DIR python -m pytest -q`` (tests/conftest.py loads these hooks then): each worker
appends one JSON line per test to ``DIR/<worker>-<pid>.jsonl``: the test's id, its user + system CPU
seconds (this process's, and its waited-for subprocesses' under ``children``), its wall seconds, and
JAX's compile events during it (``jax``: seconds of tracing, lowering and backend compiling, and the
persistent cache's hits and misses); plus lines for the session's start and the end of collection (a
worker's fixed cost: importing and collecting every test file). Rank them with e.g.
``cat DIR/*.jsonl | jq -s 'map(select(.event == "test")) | sort_by(-.cpu) | .[:40]'``.
"""

import json
import os
import resource
import time

import pytest

_EVENTS = {  # JAX's monitoring events (jax._src.dispatch, compiler) by a short name
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
    "/jax/compilation_cache/cache_hits": "cache_hits",
    "/jax/compilation_cache/cache_misses": "cache_misses",
}
_jax: dict[str, float] = {}
_out = []


def _cpu() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def _write(record: dict) -> None:
    if not _out:
        directory = os.environ["MESHLM_CPU_TIMES"]
        os.makedirs(directory, exist_ok=True)
        name = f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}.jsonl"
        _out.append(open(os.path.join(directory, name), "a", buffering=1))  # noqa: SIM115 - the session's
    _out[0].write(json.dumps(record) + "\n")


def _count(event: str, seconds: float = 1.0, **_) -> None:
    if (name := _EVENTS.get(event)) is not None:
        _jax[name] = _jax.get(name, 0.0) + seconds


def pytest_sessionstart(session):
    from jax import monitoring

    monitoring.register_event_duration_secs_listener(_count)
    monitoring.register_event_listener(_count)
    _write({"event": "sessionstart", "cpu": _cpu()[0]})


def pytest_collection_finish(session):
    _write({"event": "collected", "cpu": _cpu()[0]})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    (own, children), wall = _cpu(), time.perf_counter()
    _jax.clear()
    yield
    (own2, children2), wall2 = _cpu(), time.perf_counter()
    record = {"event": "test", "id": item.nodeid, "cpu": own2 - own, "children": children2 - children}
    _write({**record, "wall": wall2 - wall, "jax": {k: round(v, 3) for k, v in _jax.items()}})
