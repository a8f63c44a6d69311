"""Memory this process may still take: what the kernel says is available, within the cgroup's limit when there is one
(a container's limit is what the OOM killer enforces, not the host's free memory)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def available_memory_bytes() -> int | None:
    """MemAvailable, bounded by the cgroup v2 limit less its usage; None where neither can be read."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = (CGROUP / "memory.max").read_text().strip()
        if limit != "max":
            found.append(max(0, int(limit) - int((CGROUP / "memory.current").read_text())))
    except (OSError, ValueError):
        pass
    if not found and hasattr(os, "sysconf"):
        with contextlib.suppress(ValueError, OSError):
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    return min(found) if found else None
