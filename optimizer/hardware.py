"""Facts about this machine's CPU, read once for every module that needs them (threads, ISA flags, model)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
# Flags worth recording in a manifest: they decide which kernels (and compiled blobs) run here.
FLAGS_OF_INTEREST = (
    "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
    "avx512_fp16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16", "amx_fp16", "asimd", "sve",
)


def available_cpus() -> int:
    """CPUs this process may run on (respects taskset/cgroup affinity, unlike os.cpu_count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _cpuinfo_field(keys: tuple[str, ...], cpuinfo: Path) -> str | None:
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in keys:
                return value.strip()
    except OSError:
        pass
    return None


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The CPU feature flags of the first core (empty where /proc/cpuinfo is absent)."""
    return frozenset((_cpuinfo_field(("flags", "Features"), cpuinfo) or "").split())


def cpu_info() -> dict[str, object]:
    """The CPU record of a manifest."""
    return {
        "model": _cpuinfo_field(("model name",), CPUINFO) or platform.processor() or platform.machine(),
        "machine": platform.machine(),
        "logical_cpus": os.cpu_count(),
        "available_cpus": available_cpus(),
        "flags": sorted(cpu_flags() & set(FLAGS_OF_INTEREST)),
        "os": f"{platform.system()} {platform.release()}",
    }
