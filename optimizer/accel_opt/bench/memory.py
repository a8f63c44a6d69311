"""Process memory readings for the benchmarks (Linux /proc; getrusage elsewhere)."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def _status_mib(field: str) -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def reset_peak_rss_mib() -> float:
    """Reset the process's peak-RSS mark (Linux clear_refs 5) and return the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        log.debug("cannot reset peak RSS; peak includes earlier work")
    return _status_mib("VmRSS")


def peak_rss_mib() -> float:
    return _status_mib("VmHWM")
