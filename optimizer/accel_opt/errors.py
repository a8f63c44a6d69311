"""Typed errors, each carrying the process exit code the CLI maps it to (see README, "Exit codes")."""

from __future__ import annotations

import errno
import re
import tempfile
import traceback

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def first_line(exc: BaseException | Warning, limit: int = 300) -> str:
    """An exception's first non-empty line without terminal colour codes, for one-line errors."""
    text = _ANSI.sub("", str(exc)).strip()
    line = next((part.strip() for part in text.splitlines() if part.strip()), type(exc).__name__)
    return line if len(line) <= limit else line[: limit - 3] + "..."


class AccelOptError(Exception):
    """Base class: a failure we understand, reported as one line with a documented exit code."""

    exit_code = 70


class GateFailed(AccelOptError):
    """The build finished but a gate (accuracy, budget) was not met. Reports are written."""

    exit_code = 1


class CandidateDropped(AccelOptError):
    """`--precision auto` stopped a candidate's build early: its held-out samples cannot certify it, its first
    measurement is far outside what a rescue can recover, or even fully rescued it could not win. Auto reports the
    reason beside the candidate; no folder is written."""

    exit_code = 1


class TooFewToCertify(CandidateDropped):
    """`--precision auto` stopped a reduced candidate because its held-out samples are too few for any result to
    certify it: how many would do (held out, and the --data samples the recipe's split deals them from)."""

    exit_code = 6

    def __init__(self, message: str, samples_needed: int, data_samples_needed: int | None):
        super().__init__(message)
        self.samples_needed, self.data_samples_needed = samples_needed, data_samples_needed


class NotSignedOff(AccelOptError):
    """A folder its own build did not sign off: `runtime.load` refuses it, for every command and API, with the
    verdict's exit code (1: its gate failed; 6: too few held-out samples to certify it; 7: no measured benefit) and
    its reason, unless the caller allows it (`--allow-not-signed-off`, `allow_not_signed_off=True`)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code if exit_code in (1, 6, 7) else 1


class UsageError(AccelOptError):
    """Bad command line or recipe."""

    exit_code = 2


class InputRejected(AccelOptError):
    """The model or data is invalid or unsafe."""

    exit_code = 3


class Unsupported(AccelOptError):
    """Backend, device, precision or op not available on this machine."""

    exit_code = 4


class ResourceExhausted(AccelOptError):
    """Out of memory, disk, or time."""

    exit_code = 5


class InternalError(AccelOptError):
    """A bug in accel-opt."""

    exit_code = 70


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that every `finally` cleans up (staging folders, sessions)."""

    def __init__(self, signum: int):
        super().__init__(f"terminated by signal {signum}")
        self.signum = signum


_TERMINATION: list[int] = []  # the signal that asked this process to stop, once its handler ran


def request_termination(signum: int, _frame: object = None) -> None:
    """SIGTERM's handler: remembered, then raised. Remembered because the exception can land inside a library that
    swallows it and raises its own (measured: Polygraphy's array dispatch, `try: import numpy` with a bare except,
    then "shape is unsupported for objects of type: ndarray", exit 70 instead of 143)."""
    _TERMINATION.append(signum)
    raise Terminated(signum)


def termination_requested() -> Terminated | None:
    """The Terminated a signal raised in this process, whoever caught it since; None if none was asked."""
    return Terminated(_TERMINATION[0]) if _TERMINATION else None


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def no_space_error(exc: BaseException, where: object = None) -> ResourceExhausted | None:
    """A ResourceExhausted for a full disk (OSError ENOSPC/EDQUOT, or a native library's message saying
    so); None for anything else. `where`: the folder being written, named in the message."""
    if isinstance(exc, AccelOptError):
        return None
    full = isinstance(exc, OSError) and exc.errno in _NO_SPACE
    if not full and "No space left on device" not in str(exc):
        return None
    place = where or (exc.filename if isinstance(exc, OSError) else None)
    return ResourceExhausted(f"no space left on the device{f' holding {place}' if place else ''}; "
                             "free space or choose another --out")


def write_crash_log(exc: BaseException) -> str:
    """Write `exc`'s traceback to a log file and return its path (for one-line internal-error reports)."""
    with tempfile.NamedTemporaryFile("w", prefix="accel-opt-crash-", suffix=".log", delete=False) as f:
        traceback.print_exception(exc, file=f)
    return f.name
