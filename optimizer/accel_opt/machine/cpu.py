"""Facts about a CPU: the host's are read once, at the edge (the CLI and the public API), into a CpuProfile that every
class-dependent decision below takes as an input, so tests can make those decisions as any class would."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
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
    """The CPU record of a manifest, for this machine."""
    return CpuProfile.here().record()


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


def cpu_class(flags: frozenset[str], machine: str) -> str:
    """The kernel class of a CPU with these flags: avx2, avx512 (no VNNI), avx_vnni, avx512_vnni, amx, arm64 or other.
    """
    machine = machine.lower()
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


def saturating_int8(cpu: str) -> bool:
    """True when int8 u8 x s8 kernels of this class can saturate their int16 pair sums."""
    return cpu in SATURATING_INT8_CLASSES


# Representative flags of each class, as /proc/cpuinfo lists them on the CPUs the project has run on (Zen 3 for avx2,
# Skylake-SP for avx512, Alder Lake for avx_vnni, Zen 4 for avx512_vnni, Sapphire Rapids for amx): what a test injects
# to make a class-dependent decision as that class would.
_AVX2_FLAGS = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
_AVX512_FLAGS = _AVX2_FLAGS | {"avx512f", "avx512bw", "avx512vl"}
CLASS_FLAGS: dict[str, frozenset[str]] = {
    "avx2": _AVX2_FLAGS,
    "avx512": _AVX512_FLAGS,
    "avx_vnni": _AVX2_FLAGS | {"avx_vnni"},
    "avx512_vnni": _AVX512_FLAGS | {"avx512_vnni", "avx512_bf16"},
    "amx": _AVX512_FLAGS | {"avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16"},
}
# What OpenVINO's CPU plugin reports as OPTIMIZATION_CAPABILITIES everywhere; it adds BF16 / FP16 where they are native.
_OPENVINO_BASE_CAPABILITIES = ("FP32", "INT8", "BIN", "EXPORT_IMPORT")
INT8_DOT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})  # int8 dot products accumulating in int32
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
FP16_FLAGS = frozenset({"avx512_fp16", "amx_fp16"})


@dataclass(frozen=True)
class CpuProfile:
    """The CPU facts every class-dependent decision takes: auto's candidates and their share of the search's time,
    the int8 weight range (saturating kernels), native bf16/fp16, the class a sign-off is made for (oneDNN's ISA cap
    lowers OpenVINO's). `here()` reads this machine once, at the CLI/API edge; `of_class(name)` decides as another
    class would (tests run such decisions under every class). `openvino_capabilities` None: ask the installed
    OpenVINO (it reads this machine)."""

    flags: frozenset[str]
    machine: str = "x86_64"
    onednn_max_cpu_isa: str = ""  # the environment's ONEDNN_MAX_CPU_ISA, upper case ("" when unset)
    openvino_capabilities: tuple[str, ...] | None = None
    model: str = ""  # the CPU's model name, as the manifest records it (it decides nothing)

    @classmethod
    def here(cls) -> CpuProfile:
        """This machine's profile, from /proc/cpuinfo (flags, model name) and the environment's ONEDNN_MAX_CPU_ISA."""
        model = _cpuinfo_field(("model name",), CPUINFO) or platform.processor() or platform.machine()
        return cls(cpu_flags(), platform.machine(), os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper(), model=model)

    @classmethod
    def of_class(cls, name: str, onednn_max_cpu_isa: str = "") -> CpuProfile:
        """A CPU of class `name` (one of CLASS_FLAGS), with the capabilities its OpenVINO CPU plugin reports."""
        if name not in CLASS_FLAGS:
            raise ValueError(f"unknown CPU class {name!r}; one of {', '.join(CLASS_FLAGS)}")
        flags = CLASS_FLAGS[name]
        native = tuple(cap for cap, wanted in (("BF16", BF16_FLAGS), ("FP16", FP16_FLAGS)) if flags & wanted)
        return cls(flags, "x86_64", onednn_max_cpu_isa.upper(), _OPENVINO_BASE_CAPABILITIES + native,
                   model=f"a CPU of class {name}")

    @property
    def cpu_class(self) -> str:
        return cpu_class(self.flags, self.machine)

    def kernel_class(self, backend: str) -> str:
        """The class whose kernels `backend` runs on this CPU: its class, lowered by oneDNN's ISA cap for OpenVINO
        (ONEDNN_MAX_CPU_ISA, also how a lower class is emulated on one machine)."""
        here = self.cpu_class
        cap = _ONEDNN_CAPS.get(self.onednn_max_cpu_isa) if backend == "openvino" else None
        if cap is None or here not in CPU_CLASSES:
            return here
        return min(here, cap, key=CPU_CLASSES.index)

    @property
    def saturating_int8(self) -> bool:
        return saturating_int8(self.cpu_class)

    @property
    def int8_dot_products(self) -> bool:
        """int8 dot products in hardware (VNNI or AMX): where int8 pays off most."""
        return bool(self.flags & INT8_DOT_FLAGS)

    @property
    def native_bf16(self) -> bool:
        return bool(self.flags & BF16_FLAGS)

    @property
    def native_fp16(self) -> bool:
        return bool(self.flags & FP16_FLAGS)

    def record(self) -> dict[str, object]:
        """The CPU record of a manifest (the CPU counts and the OS are this process's: they decide nothing)."""
        return {
            "model": self.model,
            "machine": self.machine,
            "logical_cpus": os.cpu_count(),
            "available_cpus": available_cpus(),
            "flags": sorted(self.flags & set(FLAGS_OF_INTEREST)),
            "os": f"{platform.system()} {platform.release()}",
        }
