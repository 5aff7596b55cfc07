"""Multi-process JAX: join the processes of one job into one set of global devices.

Call :func:`initialize` first thing, before any JAX computation or ``jax.devices()``: the
backend is built once, and only a backend built after initialization sees the other
processes' devices. ``meshlm launch`` starts local processes with the right arguments.
"""

from __future__ import annotations

import math
import os
import re
import signal
import socket
import sys
import threading
from typing import Any, NoReturn

import jax

from meshlm.errors import DistributedError
from meshlm.parallel import heartbeat

# Exit status of a process whose peers never showed up (the watchdog cannot raise; see below).
TIMEOUT_EXIT_CODE = 75
# Exit status (76) of a process whose peer joined but later stopped responding for init_timeout_s
# seconds (frozen, hung host); one line names the peer (see meshlm.parallel.heartbeat).
HEARTBEAT_EXIT_CODE = heartbeat.HEARTBEAT_EXIT_CODE
# JAX gets this much longer than our own deadline, so our clear message wins the race against
# the C++ client's LOG(FATAL) abort, which otherwise ends the process with a stack dump.
_JAX_GRACE_S = 10
_MIN_SHUTDOWN_S = 300  # JAX's own default shutdown timeout
_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")
_COORDINATOR = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.\-_]*):(\d{1,5})$")
# Environments in which plain ``jax.distributed.initialize()`` finds its own arguments.
_SLURM_VARS = (
    "SLURM_JOB_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
)
_OMPI_VAR = "OMPI_MCA_orte_hnp_uri"


def initialize(
    coordinator: str | None,
    num_processes: int | None,
    process_id: int | None,
    *,
    init_timeout_s: int = 60,
) -> None:
    """Join the job at ``coordinator`` (``HOST:PORT`` of process 0) as ``process_id``.

    With all three arguments None this honours what JAX itself detects (``JAX_COORDINATOR_ADDRESS``,
    Slurm, Open MPI) and otherwise does nothing: a single-process run. A peer that never
    connects ends this process within about ``init_timeout_s`` seconds with a clear message and
    exit status ``TIMEOUT_EXIT_CODE``; a peer that dies later is detected by the heartbeat.
    """
    if not _is_int(init_timeout_s) or init_timeout_s < 1:
        raise DistributedError(f"init_timeout_s must be a positive int, got {init_timeout_s!r}")
    if coordinator is None and num_processes is None and process_id is None:
        if _environment_names_a_job():
            _join({}, init_timeout_s, "the job described by the environment")
        return
    _validate(coordinator, num_processes, process_id)
    if process_id == 0:
        _check_port_free(coordinator)
    where = f"process {process_id} of {num_processes} at coordinator {coordinator}"
    args = dict(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    _join({**args, **_bind_loopback(coordinator)}, init_timeout_s, where)


def exit_process(code: int = 0) -> NoReturn:
    """Exit with ``code``; on failure in a multi-process job, without waiting for the peers.

    At exit JAX waits (up to the shutdown timeout) in a barrier for every peer to exit too; a
    failing process would sit there while its peers sit in a collective waiting for it, and
    then all would abort, losing ``code``. Exiting at once lets ``meshlm launch`` see ``code``
    and stop the others.
    """
    if code != 0 and jax.distributed.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _bind_loopback(coordinator: str) -> dict[str, str]:
    """Peers reach a loopback coordinator only from this host: its service listens there, not on
    every interface (JAX's default, ``[::]:PORT``), unless the user chose a bind address."""
    host = coordinator.rsplit(":", 1)[0]
    if host in _LOOPBACK_HOSTS and not os.environ.get("JAX_COORDINATOR_BIND_ADDRESS"):
        return {"coordinator_bind_address": coordinator}
    return {}


def _check_port_free(coordinator: str) -> None:
    """Process 0 serves the coordinator: a port already taken is a clear error here (inside JAX's
    gRPC server it was seen to end the process with a segmentation fault)."""
    port = int(coordinator.rsplit(":", 1)[1])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError as e:
            raise DistributedError(
                f"coordinator port {port} is already in use on this host ({e.strerror}); "
                "choose another --coordinator port"
            ) from e


def is_main() -> bool:
    """True on process 0, the one that writes logs, checkpoints and results."""
    return jax.process_index() == 0


def agree(ok: bool) -> bool:
    """True only if ``ok`` on every process (a collective: call it on all of them), so that all
    processes take the same branch after a step that can fail on some of them only."""
    if jax.process_count() == 1:
        return ok
    import numpy as np  # noqa: PLC0415 - multi-process only
    from jax.experimental import multihost_utils  # noqa: PLC0415 - multi-process only

    return bool(np.all(multihost_utils.process_allgather(np.array(ok))))


def max_over_processes(value: int) -> int:
    """The largest of every process's ``value`` (a collective: call it on all of them)."""
    if jax.process_count() == 1:
        return value
    import numpy as np  # noqa: PLC0415 - multi-process only
    from jax.experimental import multihost_utils  # noqa: PLC0415 - multi-process only

    return int(np.max(multihost_utils.process_allgather(np.array(value, dtype=np.int32))))


def print0(*args: Any, **kwargs: Any) -> None:
    """``print`` on process 0 only, so N processes do not print N copies."""
    if is_main():
        print(*args, **kwargs)


def _validate(coordinator: Any, num_processes: Any, process_id: Any) -> None:
    """Raise DistributedError naming the first bad argument and how to fix it."""
    if None in (coordinator, num_processes, process_id):
        raise DistributedError(
            "coordinator, num_processes and process_id must be given together (got "
            f"{coordinator=}, {num_processes=}, {process_id=}); pass all three, or none for "
            "a single-process run"
        )
    if not _is_int(num_processes) or num_processes < 1:
        raise DistributedError(f"num_processes must be an int >= 1, got {num_processes!r}")
    if not _is_int(process_id) or not 0 <= process_id < num_processes:
        raise DistributedError(
            f"process_id must be an int in [0, {num_processes}) for {num_processes} processes, "
            f"got {process_id!r}; number the processes 0..{num_processes - 1}"
        )
    match = _COORDINATOR.match(coordinator) if isinstance(coordinator, str) else None
    if match is None or not 1 <= int(match.group(1)) <= 65535:
        raise DistributedError(
            f"coordinator must be HOST:PORT with a port in 1..65535 (e.g. 10.0.0.1:1234 or "
            f"[::1]:1234), got {coordinator!r}; use process 0's address and a free port"
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _environment_names_a_job() -> bool:
    """Whether JAX's own auto-detection would find a multi-process job in the environment."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    return all(v in os.environ for v in _SLURM_VARS) or _OMPI_VAR in os.environ


def _join(args: dict[str, Any], init_timeout_s: int, where: str) -> None:
    """Call ``jax.distributed.initialize`` with every wait bounded by ``init_timeout_s``."""
    if jax.distributed.is_initialized():
        raise DistributedError("meshlm.distributed.initialize was called twice; call it once")
    watchdog = _start_watchdog(init_timeout_s, where)
    try:
        _configure_cpu_backend(init_timeout_s)
        jax.distributed.initialize(
            **args,
            initialization_timeout=init_timeout_s + _JAX_GRACE_S,
            # Our heartbeat (below) reports a silent peer after init_timeout_s. JAX counts from
            # the last beat it received, which can be well before the peer froze (its clients
            # beat only a few times per timeout), so it gets twice ours plus the grace: its C++
            # abort must never come first.
            heartbeat_timeout_seconds=2 * init_timeout_s + _JAX_GRACE_S,
            shutdown_timeout_seconds=_shutdown_s(init_timeout_s) + _JAX_GRACE_S,
        )
    except (RuntimeError, ValueError, TypeError) as err:
        if "Failed to start RPC server" in str(err):
            hint = "the coordinator port is already in use on this host: choose another --coordinator port"
        else:
            hint = (
                "call meshlm.distributed.initialize once, before any JAX computation or jax.devices(), "
                "with coordinator, num_processes and process_id"
            )
        raise DistributedError(f"could not join {where} ({err}); {hint}") from err
    finally:
        watchdog.cancel()
    sys.excepthook = _exit_after(sys.excepthook)
    _restore_sigterm()
    _start_heartbeat(init_timeout_s)


def _restore_sigterm() -> None:
    """JAX's preemption notifier (started by initialize) catches SIGTERM in C++ and only logs it:
    a launched process would ignore the launcher's SIGTERM. Give it back its usual meaning, or the
    Python handler installed before (``meshlm train`` sets its flag before joining the job)."""
    if threading.current_thread() is threading.main_thread():
        handler = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, handler if callable(handler) else signal.SIG_DFL)


def _shutdown_s(init_timeout_s: int) -> int:
    """How long a finished process waits at exit for its peers to finish too. They are alive
    (the heartbeat watches that meanwhile), just slower: writing the loss curve, for instance."""
    return max(init_timeout_s, _MIN_SHUTDOWN_S)


def _start_heartbeat(timeout_s: int) -> None:
    from jax._src.distributed import global_state  # noqa: PLC0415 - the client JAX connected

    if global_state.num_processes and global_state.num_processes > 1:
        client, me, n = global_state.client, global_state.process_id, global_state.num_processes
        beat = heartbeat.Heartbeat(client, me, n, timeout_s, _shutdown_s(timeout_s))
        heartbeat.introduce(beat).start()


def _configure_cpu_backend(init_timeout_s: int) -> None:
    """Settings the CPU backend reads when it is built; JAX refuses them after that."""
    # gloo is what makes cross-process collectives work on CPU (JAX's default, pinned here).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # The topology exchange at backend creation has its own timeouts, in whole minutes.
    minutes = max(1, math.ceil(init_timeout_s / 60))
    jax.config.update("jax_cpu_get_local_topology_timeout_minutes", minutes)
    jax.config.update("jax_cpu_get_global_topology_timeout_minutes", minutes)


def _exit_after(hook: Any) -> Any:
    """An excepthook that reports as ``hook`` does, then exits without the shutdown barrier."""

    def report_and_exit(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        hook(kind, value, tb)
        exit_process(1)

    return report_and_exit


def _start_watchdog(seconds: int, where: str) -> threading.Timer:
    """End the process with a clear message if joining takes longer than ``seconds``.

    JAX's client blocks in C++ and then aborts the process on timeout, so no Python exception
    can be raised; a timer thread (the C++ call releases the GIL) is the only way to explain.
    """

    def expire() -> None:
        sys.stderr.write(
            f"meshlm: DistributedError: {where}: not all processes joined within {seconds} s. "
            "Start every process 0..N-1 with the same --coordinator and --num-processes, with "
            "process 0 on the coordinator host and its port reachable (or use `meshlm launch`)\n"
        )
        sys.stderr.flush()
        os._exit(TIMEOUT_EXIT_CODE)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    return timer
