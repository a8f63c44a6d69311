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


# The CPU classes whose integer and bf16 kernels differ (ONNX Runtime's MLAS and oneDNN both pick their kernels
# by CPUID at run time). Ordered from the least to the most capable x86 class; "arm64" and "other" stand apart.
CPU_CLASSES = ("avx2", "avx512", "avx_vnni", "avx512_vnni", "amx")
NON_X86_CLASSES = ("arm64", "other")
# Classes whose u8 x s8 int8 kernels multiply-add pairs into int16 (VPMADDUBSW) and can saturate: 255 * 127 * 2
# = 64770 > 32767. VNNI (VPDPBUSD) and AMX accumulate in int32; 7-bit weights (reduce_range) keep the pair sum
# within int16 (255 * 63 * 2 = 32130).
SATURATING_INT8_CLASSES = ("avx2", "avx512")
# oneDNN's ISA cap (the environment variable ONEDNN_MAX_CPU_ISA, which OpenVINO's CPU plugin obeys) -> our class.
_ONEDNN_CAPS = {"SSE41": "avx2", "AVX": "avx2", "AVX2": "avx2", "AVX2_VNNI": "avx_vnni", "AVX2_VNNI_2": "avx_vnni",
                "AVX512_CORE": "avx512", "AVX512_CORE_VNNI": "avx512_vnni", "AVX512_CORE_BF16": "avx512_vnni",
                "AVX512_CORE_FP16": "avx512_vnni", "AVX10_1_512": "avx512_vnni"}


def cpu_class(flags: frozenset[str] | None = None, machine: str | None = None) -> str:
    """The kernel class of a CPU: avx2, avx512 (no VNNI), avx_vnni, avx512_vnni, amx, arm64 or other."""
    flags = cpu_flags() if flags is None else flags
    machine = (machine or platform.machine()).lower()
    if machine in ("aarch64", "arm64"):
        return "arm64"
    if "amx_int8" in flags:
        return "amx"
    if "avx512_vnni" in flags:
        return "avx512_vnni"
    if "avx_vnni" in flags:
        return "avx_vnni"
    if "avx512bw" in flags:
        return "avx512"
    if "avx2" in flags:
        return "avx2"
    return "other"


def kernel_class(backend: str, flags: frozenset[str] | None = None) -> str:
    """The CPU class whose kernels `backend` runs here: the CPU's class, lowered by oneDNN's ISA cap for OpenVINO
    (ONEDNN_MAX_CPU_ISA, also how a lower class is emulated on one machine)."""
    here = cpu_class(flags)
    cap = _ONEDNN_CAPS.get(os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()) if backend == "openvino" else None
    if cap is None or here not in CPU_CLASSES:
        return here
    return min(here, cap, key=CPU_CLASSES.index)


def saturating_int8(cpu: str) -> bool:
    """True when int8 u8 x s8 kernels of this class can saturate their int16 pair sums."""
    return cpu in SATURATING_INT8_CLASSES
