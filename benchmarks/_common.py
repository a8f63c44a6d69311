"""Shared by the benchmark scripts: idle-CPU and contention gating (not a test helper)."""

from __future__ import annotations

import time
from collections.abc import Callable


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


class ContentionGate:
    """Detects contention that /proc/stat cannot see: on this shared host the vCPUs switch between a
    quiet state and a contended one (probably another tenant on the same physical cores), where AMX
    int8 runs ~2x and fp32 ~1.35x slower while our CPUs read idle (measured: ResNet-50 int8 at
    batch 8 flips between ~27 and ~57 ms from one second to the next). A short probe (`probe`, a few ms of the
    kind of compute being measured) is timed around each block; a block counts as quiet when the
    probe ran within `tolerance` of the fastest probe of the whole run, so classification happens
    at the end (`is_quiet`), once the fastest probe is known.
    """

    def __init__(self, probe: Callable[[], object], tolerance: float = 1.25, reps: int = 3):
        self.probe, self.tolerance, self.reps = probe, tolerance, reps
        self.best_s = float("inf")

    def sample(self) -> float:
        """Seconds of the fastest of `reps` probe runs now."""
        times = []
        for _ in range(self.reps):
            start = time.perf_counter()
            self.probe()
            times.append(time.perf_counter() - start)
        self.best_s = min(self.best_s, min(times))
        return min(times)

    def wait(self, timeout_s: float = 8.0) -> float:
        """Probe until the host looks quiet by the best probe so far (or `timeout_s`); returns the last probe."""
        deadline = time.monotonic() + timeout_s
        seconds = self.sample()
        while seconds > self.best_s * self.tolerance and time.monotonic() < deadline:
            seconds = self.sample()
        return seconds

    def is_quiet(self, *probe_seconds: float) -> bool:
        return max(probe_seconds) <= self.best_s * self.tolerance
