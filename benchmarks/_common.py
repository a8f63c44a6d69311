"""Shared by the benchmark scripts: idle-CPU gating and interleaved timing (not a test helper)."""

from __future__ import annotations

import time


def cpu_busy_fraction(seconds: float = 0.25) -> float:
    """Fraction of all CPUs busy over `seconds`, from /proc/stat (other tenants show up here, not in ps)."""

    def sample():
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        idle = values[3] + values[4]
        return idle, sum(values)

    idle0, total0 = sample()
    time.sleep(seconds)
    idle1, total1 = sample()
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def wait_for_idle(max_busy: float = 0.15, timeout_s: float = 20.0) -> float:
    """Wait until the machine is quiet (or give up after `timeout_s`); returns the last busy fraction."""
    deadline = time.monotonic() + timeout_s
    busy = cpu_busy_fraction()
    while busy > max_busy and time.monotonic() < deadline:
        busy = cpu_busy_fraction()
    return busy
