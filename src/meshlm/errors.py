"""User-facing errors. The CLI prints these as one line and exits non-zero; anything else is a bug."""

import errno
import signal


class MeshlmError(Exception):
    """Base class for errors caused by user input or environment, each naming the problem and fix."""


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) is a full disk or an exceeded quota: an
    OSError with ENOSPC / EDQUOT, or a message that says so (tensorstore reports it in text)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(error) or "Disk quota exceeded" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


# What XLA's runtime says when a device's memory runs out, at compile time (buffer assignment) or at
# run time (an allocation): a JaxRuntimeError (XlaRuntimeError before JAX 0.4.36) with one of these.
OUT_OF_MEMORY_TEXTS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OOM when allocating")
RUNTIME_ERRORS = ("JaxRuntimeError", "XlaRuntimeError")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` (or one it was raised from) is the runtime's out-of-memory on a device; by the
    class's name and message, so that this module imports no JAX."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if type(error).__name__ in RUNTIME_ERRORS and any(t in str(error) for t in OUT_OF_MEMORY_TEXTS):
            return True
        error = error.__cause__ or error.__context__
    return False


class ConfigError(MeshlmError):
    """An unknown preset, an unknown field, or a value that cannot work."""


class MeshError(MeshlmError):
    """A mesh that does not fit the devices, or a dimension the mesh cannot divide."""


class ShardingError(MeshlmError):
    """A parameter no sharding rule matches, or one whose dimension the mesh does not divide."""


class TokenRangeError(MeshlmError):
    """A token id outside [0, vocab_size): JAX would silently clamp it."""


class CheckpointError(MeshlmError):
    """A missing, incomplete, corrupt or mismatched checkpoint."""


class OutOfMemory(MeshlmError):
    """A device ran out of memory: what was asked, what fits, and the flags that cut memory
    (``perf.oom``); nothing saved was touched."""


class DataError(MeshlmError):
    """Unreadable or unusable training data."""


class DistributedError(MeshlmError):
    """Bad multi-process arguments, or peers that could not be reached in time."""


class GenerationError(MeshlmError):
    """Unusable generation input: an empty or too-long prompt, a bad sampling setting or prompt file."""


class TrainingError(MeshlmError):
    """Training cannot continue (e.g. a non-finite loss); the last good state has been saved."""


class VerifierError(MeshlmError):
    """The verifier itself failed (e.g. a control crashed): not a detection, and not a proof.

    The CLI exits with ``VERIFIER_EXIT_CODE`` for it, apart from user errors (2) and failed proofs (1).
    """


VERIFIER_EXIT_CODE = 3


class Interrupted(BaseException):
    """SIGINT or SIGTERM during start-up: the run stopped before its first step, so there was nothing
    to save. A BaseException, as KeyboardInterrupt is, so that no ``except Exception`` swallows it;
    the CLI prints it as one line and exits ``code`` (128 + the signal, as a shell reports it)."""

    def __init__(self, signum: int):
        self.signum, self.code = signum, 128 + signum
        super().__init__(
            f"{signal.Signals(signum).name} during start-up: stopped before the first step, nothing "
            "needed saving; run the same command to start (or resume) again"
        )
