"""Typed errors, each carrying the process exit code the CLI maps it to (see README, "Exit codes")."""

from __future__ import annotations

import re

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
